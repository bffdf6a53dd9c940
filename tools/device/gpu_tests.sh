#!/usr/bin/env bash
# One device call (1 GPU): the GPU tests of the kernels, the FP8 experts (legacy and AutoEP)
# and the exactness counters, with the log under $OUT. TESTS="..." runs other files.
# usage (device, repo root, .whl carried): bash tools/device/gpu_tests.sh
set -u
source tools/device/device_env.sh || exit 1
timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_kernels_cuda.py \
    tests/test_ops_out.py tests/test_fp8_segments.py tests/test_fp8_tiles.py \
    tests/test_grouped_gemm.py tests/test_fp8_experts.py tests/test_fp8_gemm_loop.py \
    tests/test_autoep_fp8_experts.py tests/test_exactness.py} > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log)"; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -20
