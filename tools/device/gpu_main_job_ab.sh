#!/usr/bin/env bash
# The main job's speed and peak under ds_config variants, one GPU, each run its own process,
# in interleaved rounds; tools/main_job_ab.py tables them (issue 14: tokens/s at the peak).
# usage (device, repo root, .whl carried): bash tools/device/gpu_main_job_ab.sh
#   MODELS="i14 gpu"   i14: issue 14's model; gpu: the main job's GPU defaults; i14ep: issue
#                      14's sizes on the main job's AutoEP model (--moe autoep)
#   CONFIGS="example checked"   example: ds_config_examples/fp4_moe.json as shipped (bf16
#                      overflow check off); checked: the same with DeepSpeed's default,
#                      "bf16": {"check_grad_overflow": true}. (The session-11 run in
#                      bench/results/main_job_ab_h200 predates the shipped setting: its
#                      "default" was the check on, its "nocheck" the check off.)
#                      graphs: the shipped config with "expert_graphs": "auto" (CUDA graphs of
#                      the FP8 experts' passes; bf16 runs DeepSpeed's layer either way);
#                      eager: the same with "expert_graphs": false (fp4 only, as graphs);
#                      gtrue: "expert_graphs": true (also graphs DeepSpeed's gate; fp4 only)
#   RECIPES="bf16 fp4"  ROUNDS=2  STEPS=40  BUDGET=480 (seconds; later runs are skipped)
#   SKIP=REGEX          runs whose name (model__config__recipe__rN) matches are left out
#   PIN="taskset -c 0-7"  a prefix for every run (to try whether fixed cores narrow the
#                      spread between runs of one recipe: 97-135 ms in session 15)
set -u
source tools/device/device_env.sh || exit 1
work=${WORK:-/tmp/ds_fp4_main_ab}; rm -rf $work; mkdir -p $work/runs
device_versions > $work/env.txt 2>&1
python3 - $work <<'EOF'
import json, sys
cfg = json.load(open("ds_config_examples/fp4_moe.json"))
json.dump({**cfg, "bf16": {**cfg["bf16"], "check_grad_overflow": True}},
          open(f"{sys.argv[1]}/checked.json", "w"), indent=1)
for name, graphs in (("graphs", "auto"), ("eager", False), ("gtrue", True)):
    json.dump({**cfg, "fp4_moe": {**cfg["fp4_moe"], "expert_graphs": graphs}},
              open(f"{sys.argv[1]}/{name}.json", "w"), indent=1)
EOF
I14="--layers 4 --hidden 2048 --heads 16 --experts 16 --ffn 1024 --seq-len 1024 --micro-batch 8"
declare -A model_args=([i14]="$I14" [gpu]="" [i14ep]="$I14 --moe autoep")
declare -A config_path=([example]=ds_config_examples/fp4_moe.json [checked]=$work/checked.json
                        [graphs]=$work/graphs.json [eager]=$work/eager.json
                        [gtrue]=$work/gtrue.json)
t0=$(date +%s)
for round in $(seq 1 ${ROUNDS:-2}); do
  for model in ${MODELS:-i14 gpu}; do
    for config in ${CONFIGS:-example checked}; do
      for recipe in ${RECIPES:-bf16 fp4}; do
        recipe_arg=$recipe   # graphs: fp4 with the config's own section (bf16 is unchanged)
        case $config in graphs|eager|gtrue)
          [ $recipe = bf16 ] && continue; recipe_arg=$work/$config.json;;
        esac
        name=${model}__${config}__${recipe}__r$round
        if [ -n "${SKIP:-}" ] && [[ $name =~ $SKIP ]]; then continue; fi
        if [ $(( $(date +%s) - t0 )) -gt ${BUDGET:-480} ]; then echo "skipped $name (budget)"; continue; fi
        timeout 120 ${PIN:-} deepspeed --num_gpus 1 --master_port 29700 tools/train_moe.py \
            --deepspeed_config ${config_path[$config]} --recipe $recipe_arg --steps ${STEPS:-40} \
            ${model_args[$model]} --no-progress --out $work/runs/$name > $work/runs/$name.log 2>&1
        echo "$name rc=$? $(( $(date +%s) - t0 ))s"
        # each finished run under $OUT at once: a call cut by its time limit keeps them
        mkdir -p $OUT/runs && cp -r $work/runs/$name $OUT/runs/ 2>/dev/null
      done
    done
  done
done
python3 tools/main_job_ab.py $work/runs --out $work | tee $work/table.txt
for f in $work/runs/*.log; do tail -n 30 $f > $f.tail; rm $f; done
tar czf $OUT/main_job_ab.tgz -C $work . && rm -rf $OUT/runs
