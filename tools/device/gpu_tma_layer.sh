#!/usr/bin/env bash
# One device call (1 GPU) for issues 18 and 13 after the TMA/persistent grouped GEMMs and
# AutoEP's 128-row aligned permutation: GPU tests of the GEMMs and of both FP8 experts, the
# grouped GEMM benchmark, the layer benchmark (legacy, grouped bf16 and AutoEP rows), and
# the GPU time by kernel of AutoEP bf16 beside the recipe with FP8 experts.
# usage (device, repo root, .whl carried): bash tools/device/gpu_tma_layer.sh
set -u
source tools/device/device_env.sh || exit 1
t0=$(date +%s)
timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider tests/test_grouped_gemm.py \
    tests/test_fp8_experts.py tests/test_autoep_fp8_experts.py tests/test_autoep.py \
    > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log) $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
timeout ${T_GEMM:-100} python3 tools/bench_grouped_gemm.py --out $OUT/grouped_gemm_h200 \
    > $OUT/gemm.log 2>&1
echo "gemm rc=$? $(( $(date +%s) - t0 ))s"
grep -E "^\| [0-9]" $OUT/grouped_gemm_h200.md | cut -d'|' -f2-7
timeout ${T_LAYER:-240} python3 tools/bench_moe_layer.py --out $OUT \
    --configs ${CONFIGS:-dsv3-e32-top2,dsv3-e16-top8,h4096-e16-top2} \
    --variants ${VARIANTS:-deepspeed-bf16,grouped-bf16,fp4,autoep-bf16,autoep-fp4,autoep-fp4-fp8experts} \
    > $OUT/layer.log 2>&1
echo "layer rc=$? $(( $(date +%s) - t0 ))s"; tail -2 $OUT/layer.log
grep -E "^\| (dsv3|h4096)" $OUT/bench_moe_layer_*_1rank.md | cut -d'|' -f2-4,6,8-9,10,12 | head -20
left=$(( ${BUDGET:-560} - ($(date +%s) - t0) ))
if [ $left -gt 40 ]; then
  timeout $left python3 tools/profile_layer.py --config dsv3-e32-top2 \
      --variants autoep-bf16,autoep-fp4-fp8experts --out $OUT/profile_layer > $OUT/profile.log 2>&1
  echo "profile rc=$?"; grep -E "^\| " $OUT/profile.log | head -30
fi
