#!/usr/bin/env bash
# One device call (1 GPU) for the grouped FP8 experts: GPU tests, the experts benchmark with
# each GEMM path, and the layer benchmark against DeepSpeed and the grouped bf16 layer.
# usage (device, repo root, .whl carried): bash tools/device/gpu_grouped_layer.sh
set -u
source tools/device/device_env.sh || exit 1
timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider tests/test_grouped_gemm.py \
    tests/test_fp8_experts.py tests/test_fp8_gemm_loop.py > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log)"; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
for mode in auto grouped; do
  DS_FP4_EXPERT_GEMMS=$mode timeout ${T_EXPERTS:-80} python3 tools/bench_experts.py \
      --out $OUT/experts_h200_$mode > $OUT/experts_$mode.log 2>&1
  echo "experts $mode rc=$?"; grep -E "^\| [a-c]" $OUT/experts_$mode.log | cut -d'|' -f2-8 | head -4
done
timeout ${T_LAYER:-330} python3 tools/bench_moe_layer.py --out $OUT \
    --configs ${CONFIGS:-dsv3-e32-top2,h4096-e16-top2,dsv3-e16-top8} \
    --variants ${VARIANTS:-deepspeed-bf16,grouped-bf16,fp4,fp4-grouped,fp4-loop,autoep-bf16,autoep-fp4,autoep-fp4-fp8experts} \
    > $OUT/layer.log 2>&1
echo "layer rc=$?"; tail -3 $OUT/layer.log
grep -E "^\| (dsv3|h4096|small)" $OUT/bench_moe_layer_*_1rank.md | cut -d'|' -f2-11,19 | head -16
