#!/usr/bin/env bash
# One device call (1 GPU) for issue 5: the FP8-experts and colwise GPU tests, then the
# experts benchmark. usage (device, repo root, .whl carried): bash tools/device/gpu_experts.sh
set -u
source tools/device/device_env.sh || exit 1
timeout ${T_TESTS:-100} python3 -m pytest -q -p no:cacheprovider tests/test_fp8_experts.py tests/test_fp8_tiles.py \
    tests/test_fp8_segments.py tests/test_kernels_cuda.py \
    -k "fp8_experts or Experts or tiles or segments or gemm or colwise" > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log)"
timeout ${T_BENCH:-120} python3 tools/bench_experts.py --out $OUT/experts_h200 > $OUT/bench.log 2>&1
echo "bench rc=$?"; tail -22 $OUT/bench.log
