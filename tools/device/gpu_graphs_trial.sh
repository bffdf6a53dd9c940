#!/usr/bin/env bash
# One device call (1 GPU) for issues 13 and 14: the layer benchmark with AutoEP rows and
# the recipe with and without expert CUDA graphs, then the main job's tokens/s and peak
# memory per recipe (each its own process) on issue 14's model and the default GPU model,
# fp4 with expert_graphs auto and false.
# usage (device, repo root, .whl carried): bash tools/device/gpu_graphs_trial.sh
set -u
source tools/device/device_env.sh || exit 1
work=$OUT/trial; mkdir -p $work
device_versions > $work/env.txt 2>&1
t0=$(date +%s)
timeout ${T_LAYER:-240} python3 tools/bench_moe_layer.py --out $work/layer \
    --configs ${CONFIGS:-dsv3-e32-top2,dsv3-e16-top8} \
    --variants ${VARIANTS:-deepspeed-bf16,grouped-bf16,fp4,fp4-eager,autoep-bf16,autoep-fp4,autoep-fp4-fp8experts} \
    > $work/layer.log 2>&1
echo "layer rc=$? $(( $(date +%s) - t0 ))s"
BIG="--layers 4 --hidden 2048 --heads 16 --experts 16 --ffn 1024 --seq-len 1024 --micro-batch 8"
CFG=ds_config_examples/fp4_moe.json
for model in big dflt; do
  sizes=""; [ $model = big ] && sizes=$BIG
  for r in bf16 fp4 bench/ablation_configs/fp4_eager_experts.json; do
    n=$(basename $r .json)
    timeout 100 python3 tools/train_moe.py --deepspeed_config $CFG --recipe $r $sizes \
        --steps ${STEPS:-40} --eval-batches 1 --no-progress --out $work/${model}_$n > $work/${model}_$n.log 2>&1
    echo "$model $n rc=$? $(( $(date +%s) - t0 ))s"
  done
done
python3 - $work <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/*/summary.json")):
    for s in json.load(open(f)):
        print(f"{f.split('/')[-2]:24s} tok/s {s['tokens_per_s_per_gpu']:>9,.0f} step {s['step_time_ms']:.1f} ms "
              f"peak {s['peak_mem_mb']:>8,.0f} kept {s['kept_for_backward_mb'] or 0:>7,.0f} "
              f"fwd/bwd {s.get('peak_mem_forward_mb') or 0:,.0f}/{s.get('peak_mem_backward_mb') or 0:,.0f}")
PY
grep -E "^\| (dsv3|h4096)" $work/layer/bench_moe_layer_*_1rank.md | cut -d'|' -f2-12 | head -16
tar czf $OUT/trial.tgz -C $work . && rm -rf $work
if [ -n "${TESTS:-}" ]; then
  timeout ${T_TESTS:-90} python3 -m pytest -x -q -p no:cacheprovider --tb=short $TESTS > $OUT/tests.log 2>&1
  echo "tests rc=$? $(tail -1 $OUT/tests.log)"; grep -E "^(FAILED|ERROR|E )" $OUT/tests.log | head -20
fi
