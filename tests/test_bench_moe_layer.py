"""tools/bench_moe_layer.py on CPU (tiny sizes, one rank): the AutoEP rows run beside the
legacy ones, their errors are against AutoEP's own layer and their bytes follow the formats."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent


def test_autoep_rows(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tools" / "bench_moe_layer.py"), "--out", str(tmp_path),
           "--variants", "deepspeed-bf16,autoep-bf16,autoep-fp4", "--warmup", "0",
           "--iters", "1"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    (out,) = tmp_path.glob("bench_moe_layer_*_1rank.json")
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    base, fp4 = rows["autoep-bf16"], rows["autoep-fp4"]
    # one rank sends nothing: only the MXFP4 cache of the experts' input changes anything,
    # i.e. the weight gradients that read it; errors are against AutoEP's own layer
    assert base["rel_err_dw"] == 0.0 and fp4["rel_err_out"] == 0.0
    assert 0 < fp4["rel_err_dw"] < 0.3
    assert fp4["experts"] == "AutoEP GroupedExperts"
    ratio = fp4["a2a_bytes"]["dispatch_fwd"] / base["a2a_bytes"]["dispatch_fwd"]
    assert ratio == pytest.approx(17 / 64)          # MXFP4 rows: 17 bytes per 32 elements
    assert "| tiny | autoep-fp4 |" in (out.with_suffix(".md")).read_text()
