# Sourced by the tools/device/gpu_*.sh device scripts, from the repo root with .whl carried:
# installs the DeepSpeed wheels, sets the environment the device machine needs (NVLink
# multicast off, as the device notes require), and makes $OUT.
#   usage: source tools/device/device_env.sh || exit 1
OUT=${OUT:-/tmp/ds_fp4_gpu_out}
mkdir -p "$OUT"
# Once per shell tree: a script started from one that sourced this (two device scripts run
# at once) must not reinstall the wheels under the other's feet.
if [ -z "${DS_FP4_WHEELS_DONE:-}" ]; then
  source tools/device/install-wheels.sh || return 1
  export DS_FP4_WHEELS_DONE=1
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A fresh torch-extensions cache per call: a call killed by its timeout while DeepSpeed's
# shm_comm op compiled left the build's lock behind on the (still warm) machine, and every
# later multi-rank test then waited on it (seen 2026-12-01: the gloo tests hung).
export TORCH_EXTENSIONS_DIR=$(mktemp -d /tmp/ds_fp4_torch_ext.XXXX)
# What a result file records about the run: GPU(s), driver, topology, package versions, the
# exported commit (tools/device/export_tree.sh writes COMMIT) and the date.
#   usage: device_versions > $work/env.txt 2>&1
device_versions() {
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  if [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then nvidia-smi topo -m; fi
  python3 -c "
import importlib
for name in ('torch', 'triton', 'cupy', 'deepspeed'):
    try:
        print(name, importlib.import_module(name).__version__, end=' ')
    except ImportError:
        print(name, 'absent', end=' ')
print()"
  echo "commit $(cat COMMIT 2>/dev/null || echo unknown)"
  date -u
}
