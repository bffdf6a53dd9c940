#!/usr/bin/env bash
# One device call (2 GPUs) for issues 4 and 6: the main job on NCCL with the CUDA kernels
# (all three recipes, short), then the layer benchmark on 2 ranks and on 1.
# usage (device, repo root, .whl carried): bash tools/device/gpu_moe.sh STEPS
set -u
STEPS=${1:-200}
source tools/device/device_env.sh || exit 1
work=/tmp/ds_fp4_moe; mkdir -p $work/train $work/bench
device_versions > $work/env.txt 2>&1
t0=$(date +%s)
timeout ${T_TRAIN:-330} deepspeed --num_gpus 2 tools/train_moe.py --deepspeed_config ds_config_examples/fp4_moe.json \
    --compare bf16,fp8,fp4 --steps $STEPS --micro-batch 32 --no-progress --out $work/train > $work/train.log 2>&1
echo "train rc=$? $(( $(date +%s) - t0 ))s" | tee -a $work/env.txt
t0=$(date +%s)
timeout ${T_BENCH2:-150} deepspeed --num_gpus 2 tools/bench_moe_layer.py --out $work/bench > $work/bench2.log 2>&1
echo "bench 2 ranks rc=$? $(( $(date +%s) - t0 ))s" | tee -a $work/env.txt
t0=$(date +%s)
timeout ${T_BENCH1:-90} python3 tools/bench_moe_layer.py --out $work/bench > $work/bench1.log 2>&1
echo "bench 1 rank rc=$? $(( $(date +%s) - t0 ))s" | tee -a $work/env.txt
tar czf $OUT/moe_results.tgz -C $work .
tail -25 $work/train.log; tail -30 $work/bench2.log | cut -c1-220
