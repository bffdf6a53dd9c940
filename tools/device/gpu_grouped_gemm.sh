#!/usr/bin/env bash
# One device call: GPU tests of the grouped FP8 GEMMs, then their benchmark.
#  usage (device, repo root, .whl carried): bash tools/device/gpu_grouped_gemm.sh
set -u
source tools/device/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${T_TEST:-200} python3 -m pytest -q -x tests/test_grouped_gemm.py 2>&1 | tail -15
timeout ${T_BENCH:-330} python3 tools/bench_grouped_gemm.py --out $OUT/grouped_gemm_h200 \
    "$@" > $OUT/bench.log 2>&1; echo "bench rc=$?"
tail -30 $OUT/bench.log
