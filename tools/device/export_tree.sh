#!/usr/bin/env bash
# Here (not on the device): the committed tree as .clean/, for a device call with
# carry [".clean"] and a command that starts with `cd .clean && ...`. Leaves out
# bench/results (tens of MB the device never reads: the working tree plus carry must stay
# under the device's 64 MiB), adds the DeepSpeed wheels (.whl/, from
# ../shared/device/prep-wheels.sh) and COMMIT, which device_versions records.
#   usage: bash tools/device/export_tree.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .whl ] || { echo "no .whl/: run ../shared/device/prep-wheels.sh first" >&2; exit 1; }
grep -qx '/.clean/' .git/info/exclude 2>/dev/null || echo '/.clean/' >> .git/info/exclude
rm -rf .clean && mkdir .clean
git archive HEAD | tar -x -C .clean --exclude=bench/results
cp -r .whl .clean/
git rev-parse --short HEAD > .clean/COMMIT
[ -z "$(git status --short --untracked-files=no)" ] || echo "note: uncommitted changes are not in .clean" >&2
du -sh .clean
