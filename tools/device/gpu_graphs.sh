#!/usr/bin/env bash
# One device call for expert_graphs (issue 6): the layer benchmark (its variants include
# fp4 = expert_graphs auto and fp4-eager = false), the host time of the small layer, and the
# main job with graphs (auto) and without (twice: two eager runs show how far runs of this
# model drift apart anyway, from nondeterministic kernels outside the experts).
# usage (device, repo root, .whl carried): NGPUS=2 bash tools/device/gpu_graphs.sh [STEPS]
set -u
STEPS=${1:-200}
NGPUS=${NGPUS:-2}
source tools/device/device_env.sh || exit 1
w=/tmp/ds_fp4_graphs; rm -rf $w; mkdir -p $w/bench $w/train
device_versions > $w/env.txt 2>&1
t0=$(date +%s)
if [ "$NGPUS" -gt 1 ]; then
    timeout 200 deepspeed --num_gpus $NGPUS --master_port 29690 tools/bench_moe_layer.py --out $w/bench > $w/bench.log 2>&1
    echo "bench rc=$? $(( $(date +%s) - t0 ))s"; t0=$(date +%s)
    timeout 60 deepspeed --num_gpus $NGPUS --master_port 29695 tools/host_overhead.py --layer small \
        --variants deepspeed-bf16,fp4-eager,fp4 --out $w/host_layer_small > $w/host.log 2>&1
    echo "host rc=$? $(( $(date +%s) - t0 ))s"
else
    timeout 170 python3 tools/bench_moe_layer.py --out $w/bench > $w/bench.log 2>&1
    echo "bench rc=$? $(( $(date +%s) - t0 ))s"
fi
port=29700
for recipe in fp4 bench/ablation_configs/fp4_eager_experts.json bench/ablation_configs/fp4_eager_experts.json; do
    name=$(basename $recipe .json); [ -d $w/train/$name ] && name=${name}_again
    t0=$(date +%s)
    timeout 90 deepspeed --num_gpus $NGPUS --master_port $((port++)) tools/train_moe.py \
        --deepspeed_config ds_config_examples/fp4_moe.json --recipe $recipe --steps $STEPS \
        --no-progress --out $w/train/$name > $w/train_$name.log 2>&1
    echo "train $name rc=$? $(( $(date +%s) - t0 ))s"; grep -E "^\| fp4" $w/train_$name.log | tail -1 | cut -c1-200
done
tar czf $OUT/graphs.tgz -C $w .
grep -E "^\| (small|h4096|dsv3)" $w/bench/*.md | cut -d'|' -f2-8,12
