#!/usr/bin/env bash
# One device call for a change to expert_graphs: its GPU tests, then the main job A/B
# (gpu_main_job_ab.sh) on this tree and, with .old carried (an older tree made by
# `git archive REV | tar -x -C .old`), the same fp4 runs on the old tree, in one call.
# usage (device, repo root, .whl and .old carried): bash tools/device/gpu_graphs_ab.sh
#   TESTS="..." (gpu_tests.sh), MODELS, CONFIGS, RECIPES, ROUNDS, STEPS, BUDGET as for
#   gpu_main_job_ab.sh; OLD_MODELS, OLD_CONFIGS, OLD_RECIPES, OLD_ROUNDS for the old tree;
#   HOST_LAYER=CONFIG (e.g. h512-e8-top2): first, tools/host_overhead.py on that layer for
#   HOST_VARIANTS (default deepspeed-bf16,fp4) in each tree; ROUNDS=0 skips the main job.
set -u
source tools/device/device_env.sh || exit 1
final=$OUT
mkdir -p $OUT/new $OUT/old
OUT=$OUT/new bash tools/device/gpu_tests.sh
host_layer() {   # host issue time of one layer fwd+bwd, this tree; $1: output prefix
  [ -n "${HOST_LAYER:-}" ] || return 0
  timeout 200 deepspeed --num_gpus 1 --master_port 29703 tools/host_overhead.py \
      --layer $HOST_LAYER --variants ${HOST_VARIANTS:-deepspeed-bf16,fp4} --out $1 2>&1 \
      | grep -A6 '"host issue ms"'
}
host_layer $OUT/new/host
[ -d .old ] && (cd .old && host_layer $final/old/host)
[ "${ROUNDS:-2}" = 0 ] || OUT=$OUT/new WORK=/tmp/ab_new bash tools/device/gpu_main_job_ab.sh | tail -n 20
if [ -d .old ] && [ "${OLD_ROUNDS:-1}" != 0 ]; then
  (cd .old && OUT=$final/old WORK=/tmp/ab_old MODELS=${OLD_MODELS:-gpu} \
      CONFIGS=${OLD_CONFIGS:-graphs} RECIPES=${OLD_RECIPES:-fp4} ROUNDS=${OLD_ROUNDS:-1} \
      bash tools/device/gpu_main_job_ab.sh | tail -n 8)
fi
tar czf $final/graphs_ab.tgz -C $final new old && rm -rf $final/new $final/old
