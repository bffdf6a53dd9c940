#!/usr/bin/env bash
# One device call (1 GPU) for issue 18's weight gradients: the K-grouped trial variants of
# bench/NOTES_wgrad.md section 3 beside the shipped kernel and bf16 _grouped_mm at the three
# sizes, with each compiled kernel's registers, spills, shared memory and loops. No DeepSpeed
# needed, so no wheels. usage (device, repo root): bash tools/device/gpu_wgrad_trials.sh
set -u
OUT=${OUT:-/tmp/ds_fp4_gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import inspect, triton; print('triton', triton.__version__); import triton.experimental.gluon.language as gl; print('gl.warp_specialize', inspect.signature(gl.warp_specialize))" 2>&1 | tail -2
timeout ${T_TRIALS:-540} python3 tools/grouped_gemm_trials.py --kinds wgrad_gate_up,wgrad_down \
    --variants ${VARIANTS:-p2,p2s,p3,p2e,p2x,p2xe,p2sxe} --configs "${CONFIGS:-64,128,4,3}" \
    --out $OUT/wgrad_trials > $OUT/wgrad_trials.log 2>&1
echo "trials rc=$?"; grep -E "bf16 .* best" $OUT/wgrad_trials.log
grep -E "^\| " $OUT/wgrad_trials.md | head -60
