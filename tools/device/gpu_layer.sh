#!/usr/bin/env bash
# One device call (2 GPUs) for the layer benchmark of issue 6 with the shipped defaults:
# tools/bench_moe_layer.py on one rank (GPU 0, EP 1), then on two ranks (EP 2). Each
# config's variants are timed in interleaved rounds (the median round counts).
# usage (device, repo root, .whl carried): bash tools/device/gpu_layer.sh [bench_moe_layer args]
set -u
source tools/device/device_env.sh || exit 1
work=/tmp/ds_fp4_layer; mkdir -p $work
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; nproc
  python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
  date -u; } > $work/env.txt 2>&1
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout ${T_ONE:-260} python3 tools/bench_moe_layer.py --out $work/r1 "$@" \
    > $work/r1.log 2>&1
echo "1 rank rc=$? $(( $(date +%s) - t0 ))s"
t0=$(date +%s)
timeout ${T_TWO:-300} deepspeed --num_gpus 2 --master_port 29671 tools/bench_moe_layer.py \
    --out $work/r2 "$@" > $work/r2.log 2>&1
echo "2 ranks rc=$? $(( $(date +%s) - t0 ))s"
tar czf $OUT/layer.tgz -C $work .
for r in r1 r2; do   # config | variant | experts | ms | vs DS | kept vs DS | targets
    echo "== $r"; grep "^| [sdh]" $work/$r/*.md | cut -d'|' -f2-4,6,8,10,17 | grep -v "^ *[0-9]" \
        | grep -v " x " | head -28
done
