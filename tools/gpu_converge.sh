#!/usr/bin/env bash
# Convergence run of issue 6 in one device call (2 GPUs): the bf16, fp8 and fp4 recipes of
# the main job at the same time, each its own 2-rank job on both GPUs (the small model
# leaves the GPUs mostly idle, so three jobs take little longer than one), then
# tools/compare_runs.py puts them side by side (table, CSVs, PNG).
# usage (device, repo root, .whl carried): bash tools/gpu_converge.sh STEPS [extra train args]
set -u
OUT=${OUT:-/tmp/ds_fp4_gpu_out}
STEPS=${1:-3000}; shift || true
mkdir -p "$OUT"
source tools/install-wheels.sh || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
work=/tmp/ds_fp4_converge; rm -rf $work; mkdir -p $work
{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, cupy, deepspeed; print('torch', torch.__version__, 'cupy', cupy.__version__, 'deepspeed', deepspeed.__version__)"; date -u; } > $work/env.txt 2>&1
t0=$(date +%s)
port=29610
for recipe in bf16 fp8 fp4; do
    timeout ${T_TRAIN:-520} deepspeed --num_gpus 2 --master_port $port tools/train_moe.py \
        --deepspeed_config ds_config_examples/fp4_moe.json --recipe $recipe --steps $STEPS \
        --no-progress --out $work/$recipe "$@" > $work/train_$recipe.log 2>&1 &
    port=$((port + 1))
done
wait
echo "3 concurrent recipes x $STEPS steps: $(( $(date +%s) - t0 ))s" | tee -a $work/env.txt
python3 tools/compare_runs.py $work/bf16 $work/fp8 $work/fp4 --out $work/compare > $work/compare.log 2>&1
echo "compare rc=$?" | tee -a $work/env.txt
tar czf $OUT/converge.tgz -C $work .
for recipe in bf16 fp8 fp4; do tail -n 3 $work/train_$recipe.log | cut -c1-200; done
cat $work/compare.log | tail -n 8
