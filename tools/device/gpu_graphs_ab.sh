#!/usr/bin/env bash
# One device call for a change to expert_graphs: its GPU tests, then the main job A/B
# (gpu_main_job_ab.sh) on this tree and, with .old carried (an older tree made by
# `git archive REV | tar -x -C .old`), the same fp4 runs on the old tree, in one call.
# usage (device, repo root, .whl and .old carried): bash tools/device/gpu_graphs_ab.sh
#   TESTS="..." (gpu_tests.sh), MODELS, CONFIGS, RECIPES, ROUNDS, STEPS, BUDGET as for
#   gpu_main_job_ab.sh; OLD_MODELS, OLD_CONFIGS, OLD_RECIPES, OLD_ROUNDS for the old tree.
set -u
source tools/device/device_env.sh || exit 1
final=$OUT
mkdir -p $OUT/new $OUT/old
OUT=$OUT/new bash tools/device/gpu_tests.sh
OUT=$OUT/new WORK=/tmp/ab_new bash tools/device/gpu_main_job_ab.sh | tail -n 20
if [ -d .old ]; then
  (cd .old && OUT=$final/old WORK=/tmp/ab_old MODELS=${OLD_MODELS:-gpu} \
      CONFIGS=${OLD_CONFIGS:-graphs} RECIPES=${OLD_RECIPES:-fp4} ROUNDS=${OLD_ROUNDS:-1} \
      bash tools/device/gpu_main_job_ab.sh | tail -n 8)
fi
tar czf $final/graphs_ab.tgz -C $final new old && rm -rf $final/new $final/old
