#!/usr/bin/env bash
# One device call (1 GPU) for issue 13: the GPU tests of the caches and of AutoEP's FP8
# experts, then the layer benchmark at the sizes with every AutoEP row (the eager
# and the fused combine, each recipe's kept copies) beside the legacy and grouped rows.
# usage (device, repo root, .whl carried): bash tools/device/gpu_autoep_layer.sh
set -u
source tools/device/device_env.sh || exit 1
t0=$(date +%s)
timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider tests/test_cache_cuda.py \
    tests/test_autoep_fp8_experts.py ${TESTS:-} > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log) $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)|Error" $OUT/tests.log | head
timeout ${T_LAYER:-380} python3 tools/bench_moe_layer.py --out $OUT \
    --configs ${CONFIGS:-dsv3-e32-top2,dsv3-e16-top8,h4096-e16-top2} \
    --variants ${VARIANTS:-deepspeed-bf16,grouped-bf16,fp4,autoep-bf16,autoep-bf16-fused,autoep-fp4,autoep-fp4-fused,autoep-fp4-actfp8,autoep-fp4-fp8experts,autoep-fp4-fp8experts-fused,fp4-monitor,autoep-fp4-fp8experts-monitor} \
    > $OUT/layer.log 2>&1
echo "layer rc=$? $(( $(date +%s) - t0 ))s"; tail -3 $OUT/layer.log
grep -E "^\| (dsv3|h4096)" $OUT/bench_moe_layer_*_1rank.md | cut -d'|' -f2-4,6,8-9,10,12 | head -40
