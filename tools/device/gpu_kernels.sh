#!/usr/bin/env bash
# One device call for issue 3: GPU tests of every kernel against the reference, then
# compute-sanitizer memcheck and racecheck on a small subset, then the benchmark.
# Full logs and results go to $OUT; the last lines printed are the summary.
#   usage (device): bash tools/device/gpu_kernels.sh [--no-compile]
set -u
OUT=${OUT:-/tmp/ds_fp4_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=python3
BENCH_ARGS=("$@")
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# (at most 8 files come back from $OUT: summary, tests, sanitizer and bench logs, json, md, ncu)
note "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader)"
note "$($PY -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)")"

t0=$(date +%s)
timeout "${T_TESTS:-330}" $PY -m pytest tests/test_kernels_cuda.py -q -p no:cacheprovider \
    -rfE --tb=short > "$OUT/tests.log" 2>&1
rc=$?
note "tests: rc=$rc $(tail -1 "$OUT/tests.log") [$(( $(date +%s) - t0 ))s]"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -25 | tee -a "$SUMMARY"

SUBSET="test_quantize_strided_inputs or test_dequantize_mxfp4_row_views or test_zero_and_negative_zero \
or test_nan_and_inf or test_empty_inputs or test_mxfp4_to_fp8_overflow or test_portable \
or (test_mxfp4_to_fp8_colwise and 384 and typical) or (test_dequantize_fp8_rows and float32) \
or (test_mxfp4_to_fp8 and 256 and spread15)"
t0=$(date +%s)
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${T_SAN:-200}" compute-sanitizer --tool memcheck \
    --error-exitcode 99 --print-limit 30 $PY -m pytest tests/test_kernels_cuda.py -q \
    -p no:cacheprovider -k "$SUBSET" > "$OUT/memcheck.tmp" 2>&1
rc=$?
note "memcheck: rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.tmp" | tail -1) | $(grep -E 'passed|failed' "$OUT/memcheck.tmp" | tail -1) [$(( $(date +%s) - t0 ))s]"
t0=$(date +%s)
timeout "${T_RACE:-150}" compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 30 \
    $PY -m pytest tests/test_kernels_cuda.py -q -p no:cacheprovider \
    -k "test_mxfp4_to_fp8_colwise and (384 or 128) and (typical or spread20)" > "$OUT/racecheck.tmp" 2>&1
rc=$?
note "racecheck: rc=$rc $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.tmp" | tail -1) | $(grep -E 'passed|failed' "$OUT/racecheck.tmp" | tail -1) [$(( $(date +%s) - t0 ))s]"
cat "$OUT/memcheck.tmp" "$OUT/racecheck.tmp" > "$OUT/sanitizer.log" && rm -f "$OUT"/*.tmp

t0=$(date +%s)
timeout "${T_BENCH:-400}" $PY tools/bench_kernels.py --out "$OUT" "${BENCH_ARGS[@]}" > "$OUT/bench.log" 2>&1
rc=$?
note "bench: rc=$rc [$(( $(date +%s) - t0 ))s]"
tail -3 "$OUT/bench.log" | grep -iE "error|Traceback" | tee -a "$SUMMARY"
t0=$(date +%s)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
    timeout "${T_NCU:-120}" "$NCU" --clock-control none -k regex:"mxfp4|fp8_quantize_bf16" \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        $PY tools/profile_kernels.py > "$OUT/ncu.txt" 2>&1
    note "ncu: rc=$? [$(( $(date +%s) - t0 ))s]"
    grep -E "^  [a-z_0-9]+ \(|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Compute \(SM\) Throughput" "$OUT/ncu.txt" | head -80 >> "$SUMMARY"
else
    note "ncu: not found"
fi
echo "==== summary"
cat "$SUMMARY"
[ -f "$OUT/kernels_h200.md" ] && cat "$OUT/kernels_h200.md" || tail -30 "$OUT/bench.log"
