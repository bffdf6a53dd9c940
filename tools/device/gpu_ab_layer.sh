#!/usr/bin/env bash
# One device call (1 GPU): the legacy layer's recipes at issue 14's sizes (h2048-e16-top2) at
# this tree and at an older one (OLD=dir with that tree, its bench given the same config), the
# GPU time by kernel of both recipes, then the main job's issue-14 model at both trees: finds
# which change moved a recipe's speed.
# usage (device, repo root, .whl carried): OLD=old bash tools/device/gpu_ab_layer.sh
#   CONFIG: one config or a comma list (the profile takes the first); T_LAYER: seconds per tree
#   OLD_CONFIG, OLD_VARIANTS, OLD_RECIPES: what runs at the old tree (default: as at this one)
#   PROFILE= (empty): no profile
set -u
source tools/device/device_env.sh || exit 1
t0=$(date +%s); CFG=${CONFIG:-h2048-e16-top2}; V=${VARIANTS:-deepspeed-bf16,fp8,fp4}
BIG="--layers 4 --hidden 2048 --heads 16 --experts 16 --ffn 1024 --seq-len 1024 --micro-batch 8"
for tree in . $OLD; do
  name=$( [ $tree = . ] && echo new || echo old ); mkdir -p $OUT/$name
  cfg=$CFG; v=$V; [ $name = old ] && cfg=${OLD_CONFIG:-$CFG} && v=${OLD_VARIANTS:-$V}
  (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH timeout ${T_LAYER:-120} python3 tools/bench_moe_layer.py --configs $cfg \
      --variants $v --out $OUT/$name > $OUT/$name/layer.log 2>&1)
  echo "layer $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "^\| (${cfg//,/|}) " $OUT/$name/bench_moe_layer_*_1rank.md | cut -d'|' -f2,3,6,11 | head -24
done
[ -n "${PROFILE-1}" ] && timeout 100 python3 tools/profile_layer.py --config ${CFG%%,*} --variants ${PROFILE_VARIANTS:-fp8,fp4} --out $OUT/profile \
    > $OUT/profile.log 2>&1; echo "profile rc=$?"
for tree in . $OLD; do
  name=$( [ $tree = . ] && echo new || echo old )
  recipes=${RECIPES:-fp4 fp8}; [ $name = old ] && recipes=${OLD_RECIPES:-$recipes}
  for r in $recipes; do
    (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH timeout 90 python3 tools/train_moe.py --recipe $r $BIG \
        --deepspeed_config ds_config_examples/fp4_moe.json --steps 30 --eval-batches 1 \
        --no-progress --out $OUT/$name/train_$r > $OUT/$name/train_$r.log 2>&1)
    echo "train $name $r rc=$? $(grep -ho '"step_time_ms": [0-9.]*' $OUT/$name/train_$r/summary.json) $(( $(date +%s) - t0 ))s"
  done
done
grep -E "^\| " $OUT/profile.md | head -70
