#!/usr/bin/env bash
# Convergence run of issue 6 in one device call (2 GPUs): the bf16, fp8 and fp4 recipes of
# the main job at the same time, each its own 2-rank job on both GPUs (the small model
# leaves the GPUs mostly idle, so three jobs take little longer than one), then
# tools/compare_runs.py puts them side by side (table, CSVs, PNG).
# usage (device, repo root, .whl carried): bash tools/device/gpu_converge.sh STEPS [extra train args]
# RECIPES="..." picks other recipes (names or ds_config paths; default bf16 fp8 fp4); each
# run's folder is named after the recipe (a path's file name without .json).
set -u
STEPS=${1:-3000}; shift || true
source tools/device/device_env.sh || exit 1
work=/tmp/ds_fp4_converge; rm -rf $work; mkdir -p $work
{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,driver_version --format=csv;
  python3 -c "import torch, cupy, deepspeed; print('torch', torch.__version__, 'cupy', cupy.__version__, 'deepspeed', deepspeed.__version__)"; date -u; } > $work/env.txt 2>&1
t0=$(date +%s)
port=29610
names=()
for recipe in ${RECIPES:-bf16 fp8 fp4}; do
    name=$(basename "$recipe" .json); names+=("$work/$name")
    timeout ${T_TRAIN:-520} deepspeed --num_gpus 2 --master_port $port tools/train_moe.py \
        --deepspeed_config ds_config_examples/fp4_moe.json --recipe $recipe --steps $STEPS \
        --no-progress --out $work/$name "$@" > $work/train_$name.log 2>&1 &
    port=$((port + 1))
done
wait
echo "${#names[@]} concurrent recipes x $STEPS steps: $(( $(date +%s) - t0 ))s" | tee -a $work/env.txt
python3 tools/compare_runs.py ${COMPARE_WITH:-} "${names[@]}" --out $work/compare > $work/compare.log 2>&1
echo "compare rc=$?" | tee -a $work/env.txt
tar czf $OUT/converge.tgz -C $work .
for name in "${names[@]}"; do tail -n 3 $work/train_$(basename $name).log | cut -c1-200; done
cat $work/compare.log | tail -n 8
