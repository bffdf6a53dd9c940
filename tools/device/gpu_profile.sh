#!/usr/bin/env bash
# One device call (1 GPU): GPU time by kernel per step of the AutoEP layers (bf16 and the
# recipe) and of the legacy recipe, tools/profile_layer.py; results under $OUT.
# usage (device, repo root, .whl carried): bash tools/device/gpu_profile.sh
set -u
source tools/device/device_env.sh || exit 1
timeout ${T_PROFILE:-200} python3 tools/profile_layer.py --config ${CONFIG:-dsv3-e32-top2} \
    --variants ${VARIANTS:-autoep-bf16,autoep-fp4,autoep-fp4-fp8experts} --out $OUT/profile_layer \
    > $OUT/profile.log 2>&1
echo "profile rc=$?"; grep -E "^\| " $OUT/profile.log | head -${LINES_SHOWN:-90}
