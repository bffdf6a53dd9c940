#!/usr/bin/env bash
# One device call (1 GPU) for issue 14: what is live at each phase's peak, per recipe, each
# recipe its own process (the allocator's history of the profiled step, --memory-breakdown),
# on issue 14's model and on the main job's default GPU model; then tokens/s and peaks of
# separate runs beside --compare in one process; with MAX_BATCH_GB=N the largest micro batch
# of bf16 and fp4 under an N GB cap (--find-max-batch); then GPU tests given by TESTS.
# usage (device, repo root, .whl carried): bash tools/device/gpu_memory.sh
set -u
source tools/device/device_env.sh || exit 1
work=$OUT/mem; mkdir -p $work
device_versions > $work/env.txt 2>&1
BIG="--layers 4 --hidden 2048 --heads 16 --experts 16 --ffn 1024 --seq-len 1024 --micro-batch 8"
CFG=ds_config_examples/fp4_moe.json
t0=$(date +%s)
for r in bf16 fp8 fp4; do   # breakdowns: concurrent processes (peaks are per process)
  timeout 200 python3 tools/train_moe.py --deepspeed_config $CFG --recipe $r $BIG --steps 6 \
      --eval-batches 1 --no-progress --memory-breakdown --out $work/big_$r > $work/big_$r.log 2>&1 &
  timeout 200 python3 tools/train_moe.py --deepspeed_config $CFG --recipe $r --steps 6 \
      --eval-batches 1 --no-progress --memory-breakdown --out $work/dflt_$r > $work/dflt_$r.log 2>&1 &
done; wait
echo "breakdowns $(( $(date +%s) - t0 ))s"
for r in bf16 fp8 fp4; do   # timing: one at a time
  timeout 120 python3 tools/train_moe.py --deepspeed_config $CFG --recipe $r $BIG --steps 40 \
      --eval-batches 1 --no-progress --out $work/time_$r > $work/time_$r.log 2>&1
  echo "time $r rc=$?"
done
timeout 150 python3 tools/train_moe.py --deepspeed_config $CFG --compare bf16,fp8,fp4 $BIG \
    --steps 40 --eval-batches 1 --no-progress --out $work/compare > $work/compare.log 2>&1
echo "compare rc=$? $(( $(date +%s) - t0 ))s"
python3 - $work <<'PY'
import glob, json, os, sys
w = sys.argv[1]
for f in sorted(glob.glob(f"{w}/*/memory_*.json")):
    r = json.load(open(f)); name = f.split("/")[-2]
    ph = " ".join(f"{k}={v['mb']:.0f}" for k, v in r["phases"].items())
    print(f"{name}: base {r['base_mb']:.0f} peak {r['peak']['mb']:.0f} MB | {ph}")
    for o, i, mb, n in r["peak"]["sites"][:6]:
        print(f"   {mb:8.1f} MB x{n:<4d} {o[:60]:60s} {i[:50]}")
for f in sorted(glob.glob(f"{w}/time_*/summary.json")) + [f"{w}/compare/summary.json"]:
    for s in (json.load(open(f)) if os.path.exists(f) else []):
        print(f.split("/")[-2], s["recipe"], f"tok/s {s['tokens_per_s_per_gpu']:,.0f}",
              f"peak {s['peak_mem_mb']:,.0f}", f"kept {s['kept_for_backward_mb']}",
              " ".join(f"{p}={s.get(f'peak_mem_{p}_mb')}" for p in ("forward", "backward", "step")))
PY
if [ -n "${MAX_BATCH_GB:-}" ]; then   # issue 14: what the saved memory buys
  timeout ${T_MAXB:-200} python3 tools/train_moe.py --deepspeed_config $CFG --compare bf16,fp4 \
      $BIG --find-max-batch --max-batch-memory-gb $MAX_BATCH_GB --no-progress \
      --out $work/max_batch > $work/max_batch.log 2>&1
  echo "max batch rc=$? $(( $(date +%s) - t0 ))s"; cat $work/max_batch/max_batch.md 2>/dev/null
fi
tar czf $OUT/mem.tgz -C $work . && rm -rf $work
if [ -n "${TESTS:-}" ]; then
  timeout ${T_TESTS:-150} python3 -m pytest -q -p no:cacheprovider $TESTS > $OUT/tests.log 2>&1
  echo "tests rc=$? $(tail -1 $OUT/tests.log)"; grep -E "^(FAILED|ERROR)" $OUT/tests.log | head
fi
