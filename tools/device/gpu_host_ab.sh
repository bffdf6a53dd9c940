#!/usr/bin/env bash
# One device call (1 GPU): the layer benchmark at this tree and at an older one (OLD=dir
# holding that tree), twice each, alternating (old, new, old, new: the host's drift shows
# as the spread between a tree's two runs), each followed by the host's issue time per variant
# where the tree's host_overhead.py has --issue-only, then the host time by function at this
# tree (host_overhead.py --breakdown). For changes that cut host time.
# usage (device, repo root, .whl carried, OLD carried):
#   OLD=old CONFIGS=h4096-e16-top2 VARIANTS=grouped-bf16,fp4 bash tools/device/gpu_host_ab.sh
#   ROUNDS (default 2), T_LAYER (seconds per benchmark run), BREAKDOWN= (empty: none),
#   BD_VARIANTS (the breakdown's variants; default VARIANTS), LAYER_BENCH= (empty: only the
#   host issue times, no layer benchmark), ISSUE_CONFIGS (the host issue times' configs;
#   default CONFIGS; empty: none)
set -u
source tools/device/device_env.sh > $OUT/env.txt 2>&1 || { cat $OUT/env.txt; exit 1; }
t0=$(date +%s); CFG=${CONFIGS:-h4096-e16-top2}; V=${VARIANTS:-grouped-bf16,fp4}
for round in $(seq ${ROUNDS:-2}); do
  for tree in ${OLD:-} .; do
    name=$( [ $tree = . ] && echo new || echo old )$round; mkdir -p $OUT/$name
    if [ -n "${LAYER_BENCH-1}" ]; then
      (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH timeout ${T_LAYER:-200} python3 tools/bench_moe_layer.py \
          --configs $CFG --variants $V --out $OUT/$name > $OUT/$name/layer.log 2>&1)
      echo "layer $name rc=$? $(( $(date +%s) - t0 ))s"
    fi
    # the host's own issue time per variant, where the tree's host_overhead.py has the flag
    if grep -q -- --issue-only $tree/tools/host_overhead.py; then
      ISSUE=${ISSUE_CONFIGS-$CFG}
      for L in ${ISSUE//,/ }; do
        (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH timeout 120 deepspeed --num_gpus 1 --master_port 29706 \
            tools/host_overhead.py --layer $L --issue-only --variants $V --out $OUT/$name/issue_$L \
            > $OUT/$name/issue_$L.log 2>&1)
        echo "host issue $name $L rc=$? $(grep -h '^| ' $OUT/$name/issue_$L.md | tail -n +3 | tr -d '\n')"
      done
    fi
  done
done
if [ -n "${BREAKDOWN-1}" ]; then
  for L in ${CFG//,/ }; do
    timeout 150 deepspeed --num_gpus 1 --master_port 29705 tools/host_overhead.py --layer $L \
        --breakdown --variants ${BD_VARIANTS:-$V} --out $OUT/host_$L > $OUT/host_$L.log 2>&1
    echo "breakdown $L rc=$? $(( $(date +%s) - t0 ))s"
  done
fi
# fwd+bwd ms per variant and run, last
for f in $OUT/*/bench_moe_layer_*_1rank.json; do
  python3 - "$f" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
run = sys.argv[1].split("/")[-2]
print(run, " ".join(f"{r['config']}/{r['variant']}={r['fwd_bwd_ms']:.2f}" for r in rows))
EOF
done
# A call returns at most 8 files: everything above also as one archive (its name sorts first)
tar czf /tmp/host_ab.tgz -C $OUT . && mv /tmp/host_ab.tgz $OUT/0_host_ab.tgz
