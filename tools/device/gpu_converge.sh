#!/usr/bin/env bash
# Convergence run of issue 6 in one device call (2 GPUs): the bf16, fp8 and fp4 recipes of
# the main job at the same time, each its own 2-rank job on both GPUs (the small model
# leaves the GPUs mostly idle, so three jobs take little longer than one), then
# tools/compare_runs.py puts them side by side (table, CSVs, PNG).
# usage (device, repo root, .whl carried): bash tools/device/gpu_converge.sh STEPS [extra train args]
# RECIPES="..." picks other recipes (names or ds_config paths; default bf16 fp8 fp4); each
# run's folder is named after the recipe (a path's file name without .json).
# SEEDS="1 2 3 4 5" runs every recipe once per seed (--seed; folders <recipe>_seed<S>) and
# merges them with compare_runs.py --seeds (mean, standard error, bands); NGPU=1 for one GPU.
# TAG=_lr1001 labels every run <recipe>_lr1001 (--run-name), e.g. a bf16 twin run with
# another --lr, merged later with the bf16 runs of the same seeds (COMPARE_WITH=their folders).
# WORK (a folder, default /tmp/ds_fp4_converge; $OUT/<its name>.tgz) and PORT (the first
# master port) let two of these run at once.
# CROSS="bf16 fp8 fp4" (issue 16): each run saves its final checkpoint (under $WORK/ckpt,
# left out of the tarball), then is evaluated under each of those recipes (--eval-only, its
# own included: that one must give the run's own final held-out loss), into
# cross/<run>_as_<recipe>; tools/cross_eval.py splits each recipe's held-out gap into
# what its weights and what its forward numerics make.
set -u
STEPS=${1:-3000}; shift || true
source tools/device/device_env.sh || exit 1
work=${WORK:-/tmp/ds_fp4_converge}; rm -rf $work; mkdir -p $work
device_versions > $work/env.txt 2>&1
t0=$(date +%s)
port=${PORT:-29610}
names=()
for seed in ${SEEDS:-default}; do
  for recipe in ${RECIPES:-bf16 fp8 fp4}; do
    name=$(basename "$recipe" .json)${TAG:-}; run_args=()
    [ -n "${TAG:-}" ] && run_args=(--run-name $name)
    if [ "$seed" != default ]; then name=${name}_seed$seed; run_args+=(--seed $seed); fi
    names+=("$work/$name")
    [ -n "${CROSS:-}" ] && run_args+=(--save $work/ckpt/$name)
    timeout ${T_TRAIN:-520} deepspeed --num_gpus ${NGPU:-2} --master_port $port tools/train_moe.py \
        --deepspeed_config ds_config_examples/fp4_moe.json --recipe $recipe --steps $STEPS \
        "${run_args[@]}" --no-progress --out $work/$name "$@" > $work/train_$name.log 2>&1 &
    port=$((port + 1))
  done
done
wait
echo "${#names[@]} concurrent runs x $STEPS steps: $(( $(date +%s) - t0 ))s" | tee -a $work/env.txt
if [ -n "${CROSS:-}" ]; then
  t1=$(date +%s); mkdir -p $work/cross
  for run in "${names[@]}"; do
    name=$(basename $run); seed_args=()
    [[ $name =~ _seed([0-9]+)$ ]] && seed_args=(--seed ${BASH_REMATCH[1]})
    [ -d $work/ckpt/$name ] || { echo "no checkpoint of $name" | tee -a $work/env.txt; continue; }
    for recipe in $CROSS; do
      as=${name}_as_$(basename "$recipe" .json)
      timeout ${T_EVAL:-240} deepspeed --num_gpus ${NGPU:-2} --master_port $port tools/train_moe.py \
          --deepspeed_config ds_config_examples/fp4_moe.json --recipe $recipe --steps $STEPS \
          --eval-only --load $work/ckpt/$name "${seed_args[@]}" --run-name $as --no-progress \
          --out $work/cross/$as "$@" > $work/cross/eval_$as.log 2>&1 &
      port=$((port + 1))
    done
  done
  wait
  echo "cross evaluations: $(( $(date +%s) - t1 ))s" | tee -a $work/env.txt
  python3 tools/cross_eval.py "${names[@]}" --cross $work/cross --out $work/cross_eval \
      > $work/cross_eval.log 2>&1
  echo "cross_eval rc=$?" | tee -a $work/env.txt
fi
merge=(); [ -n "${SEEDS:-}" ] && merge=(--seeds)
python3 tools/compare_runs.py "${merge[@]}" ${COMPARE_WITH:-} "${names[@]}" --out $work/compare > $work/compare.log 2>&1
echo "compare rc=$?" | tee -a $work/env.txt
tar czf $OUT/$(basename $work).tgz --exclude=./ckpt -C $work .
for name in "${names[@]}"; do tail -n 3 $work/train_$(basename $name).log | cut -c1-200; done
cat $work/compare.log | tail -n 8
[ -n "${CROSS:-}" ] && tail -n 20 $work/cross_eval.log
