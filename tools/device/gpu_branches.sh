#!/usr/bin/env bash
# Branches of bf16 trunks in one device call (issue 16; tools/branches.py says why): a bf16
# trunk per seed on the full run's LR schedule, saving a checkpoint at each branch point,
# then from each checkpoint a short branch per recipe on the same schedule (started as soon
# as the trunk has saved it), then tools/branches.py over all of them. Checkpoints stay on
# the device (hundreds of MB each).
# usage (device, repo root, .whl carried): bash tools/device/gpu_branches.sh [extra train args]
#   SEEDS ("1 2 3 4 5"), SCHEDULE (3000: the LR schedule's steps), AT ("1000": branch points,
#   after the loss's fast phase), LEN (250: steps per branch; the trunk runs to the last point
#   + LEN), JOBS (13 at once: the 25 default branches in two waves;
#   a job took ~0.12 s a step with 5 at once on the H200), BRANCHES: "NAME=RECIPE[@LR] ..." (LR
#   absolute; the GPU default is 1e-3; BRANCHES= runs none), T_TRAIN: seconds per job,
#   PREFIXES ("": none): "NAME=RECIPE[@LR] ..." runs that take RECIPE for the first K steps
#   only (K each point of AT), then go on in bf16 to K + LEN as "after_NAME": where in the
#   run a recipe's effect arises. "after_NAME" keeps its prefix's peak LR, so a bf16 twin
#   prefix (bf16@0.001001) makes a twin of the whole run: the drift the first K steps seed.
set -u
source tools/device/device_env.sh || exit 1
SEEDS=${SEEDS:-1 2 3 4 5}; SCHEDULE=${SCHEDULE:-3000}; AT=${AT:-1000}; LEN=${LEN:-250}
A=bench/ablation_configs   # the default branches: the bf16 twin (the drift left), the FP8
# GEMMs alone, the paper's recipe, and its MXFP4 copies of x and of z apart
BRANCHES=${BRANCHES-bf16_lr1001=bf16@0.001001 bf16wires_fp8experts=$A/bf16wires_fp8experts.json fp4=fp4 fp4_zfp8=$A/fp4_zfp8.json fp4_xfp8=$A/fp4_xfp8.json}
work=${WORK:-/tmp/ds_fp4_branches}; rm -rf $work; mkdir -p $work/ck
device_versions > $work/env.txt 2>&1
CFG=ds_config_examples/fp4_moe.json
last=0; every=0   # the last branch point and the points' greatest common divisor
gcd() { local a=$1 b=$2; while [ $b -ne 0 ]; do local t=$b; b=$(( a % b )); a=$t; done; echo $a; }
for k in $AT; do [ $k -gt $last ] && last=$k; every=$(gcd $k $every); done
t0=$(date +%s)
job() {   # name, then train_moe.py arguments; at most JOBS at once
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-13}" ]; do wait -n; done
  local name=$1; shift
  timeout ${T_TRAIN:-300} python3 tools/train_moe.py --deepspeed_config $CFG --no-progress \
      --schedule-steps $SCHEDULE --out $work/$name "$@" > $work/$name.log 2>&1 &
}
spec() {   # NAME=RECIPE[@LR]: sets name, recipe and lr (the --lr arguments, or none)
  name=${1%%=*}; local rest=${1#*=}; recipe=${rest%@*}; lr=()
  [ "$rest" != "$recipe" ] && lr=(--lr ${rest#*@})
  return 0
}
declare -A owner   # checkpoint folder -> the pid of the run that writes it
ready() {   # folder, step: wait until the folder's 'latest' reaches the step (DeepSpeed
  # writes it after the tag's files), so branches start while their trunk runs on
  local l
  while :; do
    l=$(cat $1/latest 2>/dev/null); l=${l#step}
    [ -n "$l" ] && [ "$l" -ge $2 ] && return 0
    kill -0 ${owner[$1]} 2>/dev/null || { echo "no checkpoint step$2 in $1"; return 1; }
    sleep 2
  done
}
for s in $SEEDS; do
  job trunk_seed$s --recipe bf16 --seed $s --steps $(( last + LEN )) --save $work/ck/seed$s \
      --save-interval $every "$@"
  owner[$work/ck/seed$s]=$!
  for p in ${PREFIXES:-}; do
    spec $p
    job ${name}_prefix_seed$s --recipe $recipe --run-name $name --seed $s --steps $last \
        --save $work/ck/${name}_seed$s --save-interval $every "${lr[@]}" "$@"
    owner[$work/ck/${name}_seed$s]=$!
  done
done
for k in $AT; do for s in $SEEDS; do
  for b in $BRANCHES; do
    spec $b
    ready $work/ck/seed$s $k || continue
    job ${name}_seed${s}_from$k --recipe $recipe --run-name $name --seed $s \
        --load $work/ck/seed$s --load-tag step$k --steps $(( k + LEN )) "${lr[@]}" "$@"
  done
  for p in ${PREFIXES:-}; do
    spec $p
    ready $work/ck/${name}_seed$s $k || continue
    job after_${name}_seed${s}_from$k --recipe bf16 --run-name after_$name --seed $s \
        --load $work/ck/${name}_seed$s --load-tag step$k --steps $(( k + LEN )) "$@"
  done
done; done
wait
echo "trunks and branches: $(( $(date +%s) - t0 ))s"
python3 tools/branches.py --trunks $work/trunk_seed*/ --branches $work/*_from*/ \
    --window $(( LEN / 5 > 0 ? LEN / 5 : 1 )) --out $work/summary > $work/branches.log 2>&1
echo "branches.py rc=$?"; cat $work/branches.log | tail -n 12
grep -l "Error\|error:" $work/*.log | head -5
rm -rf $work/ck; tar czf $OUT/$(basename $work).tgz -C $work .
