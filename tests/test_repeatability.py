"""tools/repeatability.py: a layer step's tensors compared run against run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import repeatability  # noqa: E402


def test_differences_name_the_tensors_that_changed_and_by_how_much():
    a = {"output": torch.tensor([1.0, float("nan"), 3.0]), "grad w": torch.ones(4)}
    b = {"output": torch.tensor([1.0, float("nan"), 3.5]), "grad w": torch.ones(4)}
    assert repeatability.differences(a, b) == {
        "output": {"elements": 1, "of": 3, "max_abs": 0.5}}
    assert repeatability.differences(a, a) == {}          # NaN in the same place is the same


def test_the_cpu_layer_steps_repeat_bit_for_bit(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tools" / "repeatability.py"), "--layer", "tiny",
           "--variants", "deepspeed-bf16,fp4", "--reps", "2", "--out", str(tmp_path)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((tmp_path / "repeatability.json").read_text())
    assert got["device"] == "cpu"
    for variant in ("deepspeed-bf16", "fp4"):
        report = got["report"][variant]
        assert report["repeats"] == [{}], report
        grads = [n for n in report["compared"] if n.startswith("grad ")]
        assert "output" in report["compared"] and "input grad" in report["compared"]
        assert len(grads) >= 3, report["compared"]           # the gate's and the experts'
    assert "| fp4 | 2 | none: the same bytes (" in (tmp_path / "repeatability.md").read_text()
