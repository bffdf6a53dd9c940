#!/usr/bin/env bash
# One device call (1 GPU): a smoke run of fp4_moe.bf16_start_steps on the main job. Three runs
# with the same seed at once: bf16, bf16 again (a GPU run is not bit-reproducible: this one
# says how far two bf16 runs drift), and fp4 with bf16_start_steps = N. The last must train
# as bf16 for its first N steps and as fp4 after.
# tools/bf16_start_check.py compares them and prints a verdict; logs and curves
# land in $OUT/bf16_start.tgz.
# usage (device, repo root, .whl carried): N=100 STEPS=200 bash tools/device/gpu_bf16_start.sh
set -u
source tools/device/device_env.sh || exit 1
N=${N:-100}; STEPS=${STEPS:-200}
work=/tmp/ds_fp4_bf16_start; rm -rf $work; mkdir -p $work
device_versions > $work/env.txt 2>&1
# the recipe of bench/ablation_configs/fp4_bf16start1000.json, with N steps
python3 -c 'import json, sys
cfg = json.load(open("bench/ablation_configs/fp4_bf16start1000.json"))
cfg["fp4_moe"]["bf16_start_steps"] = int(sys.argv[1])
print(json.dumps(cfg))' "$N" > $work/fp4_start.json
port=29620
for recipe in bf16 bf16_rerun $work/fp4_start.json; do
  name=$(basename $recipe .json); [ $name = bf16_rerun ] && recipe=bf16
  timeout ${T_TRAIN:-400} deepspeed --num_gpus 1 --master_port $port tools/train_moe.py \
      --deepspeed_config ds_config_examples/fp4_moe.json --recipe $recipe --run-name $name \
      --steps $STEPS --eval-interval $N --no-progress --out $work/$name > $work/train_$name.log 2>&1 &
  port=$((port + 1))
done
wait
python3 tools/bf16_start_check.py $work/bf16/metrics_bf16.csv \
    $work/fp4_start/metrics_fp4_start.csv --switch $N \
    --rerun $work/bf16_rerun/metrics_bf16_rerun.csv | tee $work/check.txt
tail -n 3 $work/train_*.log
tar czf $OUT/bf16_start.tgz -C $work .
