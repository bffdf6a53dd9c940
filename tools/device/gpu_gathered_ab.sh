#!/usr/bin/env bash
# One device call (1 GPU, ~9 min): session 30's gathered slots checked and measured. The GPU
# tests of every kernel they touch (the gathering quantizers, route_map, route_gate_grads,
# the FP8 experts and the layer), then the layer with the slots gathered and with the slot
# buffers, alternating in one process (ab_in_process --switch gathered_input; fwd+bwd ms,
# host issue ms and memory per setting), the decode's fused FP8 route rows likewise
# (kept_route_rows, at the first config), then the GPU time by kernel with them.
# Part "autoep" (session 31): AutoEP's layer with FP8 experts at one rank reading the
# routes' rows from the tokens and without (ab_in_process --switch autoep_gathered).
# usage (device, repo root, .whl carried), three calls (each under the 600 s limit):
#   PARTS=tests bash tools/device/gpu_gathered_ab.sh
#   PARTS=ab bash tools/device/gpu_gathered_ab.sh; PARTS=autoep bash tools/device/gpu_gathered_ab.sh
#   PARTS (default "tests ab autoep"), CONFIGS (default the three sizes), ROUNDS
#   (default 8), T_TESTS, PROFILE= (none)
set -u
source tools/device/device_env.sh > $OUT/env.txt 2>&1 || { cat $OUT/env.txt; exit 1; }
device_versions >> $OUT/env.txt 2>&1
t0=$(date +%s); CFG=${CONFIGS:-dsv3-e32-top2,dsv3-e16-top8,h4096-e16-top2}
export PYTHONPATH=$PWD/tools:$PYTHONPATH
PARTS=${PARTS:-tests ab autoep}
if [[ " $PARTS " == *" tests "* ]]; then
timeout ${T_TESTS:-420} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_cuda.py \
    tests/test_fp8_segments.py tests/test_encode_routes.py tests/test_route_grads.py \
    tests/test_route_sums.py tests/test_fp8_experts.py tests/test_moe_layer.py \
    tests/test_autoep_fp8_experts.py tests/test_routing.py > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log) $(( $(date +%s) - t0 ))s"
grep -E "^(FAILED|ERROR)" $OUT/tests.log | head -20
fi
if [[ " $PARTS " == *" autoep "* ]]; then
timeout 200 python3 tools/ab_in_process.py --switch autoep_gathered \
    --variant autoep-fp4-fp8experts-fused --configs dsv3-e32-top2,h4096-e16-top2 \
    --rounds ${ROUNDS:-8} --out $OUT/ab_autoep > $OUT/ab_autoep.log 2>&1
echo "ab autoep rc=$? $(( $(date +%s) - t0 ))s"
grep -E "^\|" $OUT/ab_autoep.md 2>/dev/null
fi
[[ " $PARTS " == *" ab "* ]] || exit 0
timeout 250 python3 tools/ab_in_process.py --switch gathered_input --configs $CFG \
    --rounds ${ROUNDS:-8} --out $OUT/ab_gathered > $OUT/ab.log 2>&1
echo "ab rc=$? $(( $(date +%s) - t0 ))s"
timeout 120 python3 tools/ab_in_process.py --switch kept_route_rows --configs ${CFG%%,*} \
    --rounds ${ROUNDS:-8} --out $OUT/ab_kept > $OUT/ab_kept.log 2>&1
echo "ab kept rc=$? $(( $(date +%s) - t0 ))s"
[ -n "${PROFILE-1}" ] && timeout 90 python3 tools/profile_layer.py --config ${CFG%%,*} \
    --variants fp4 --out $OUT/profile > $OUT/profile.log 2>&1; echo "profile rc=$?"
cat $OUT/ab_gathered.md $OUT/ab_kept.md 2>/dev/null | grep -E "^\|"
grep -E "^\| " $OUT/profile.md 2>/dev/null | head -30
