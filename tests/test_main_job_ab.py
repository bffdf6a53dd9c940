"""tools/main_job_ab.py: the table of the main job's runs under ds_config variants."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import main_job_ab  # noqa: E402


def _run(root, name, step_ms, tokens, peak):
    folder = root / name
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(
        [{"step_time_ms": step_ms, "tokens_per_s_per_gpu": tokens, "peak_mem_mb": peak}]))


def test_medians_and_ratios_against_bf16_of_the_config_or_the_example(tmp_path):
    _run(tmp_path, "gpu__example__bf16__r1", 90.0, 100.0, 1800)
    _run(tmp_path, "gpu__example__bf16__r2", 110.0, 80.0, 1800)
    _run(tmp_path, "gpu__example__fp4__r1", 100.0, 90.0, 1400)
    _run(tmp_path, "gpu__checked__bf16__r1", 180.0, 50.0, 1800)
    _run(tmp_path, "gpu__checked__fp4__r1", 150.0, 60.0, 1400)
    _run(tmp_path, "gpu__graphs__fp4__r1", 60.0, 180.0, 1700)   # graphs: no bf16 run
    rows = {(r["config"], r["recipe"]): r
            for r in main_job_ab.medians(main_job_ab.collect(tmp_path))}
    assert rows[("example", "bf16")]["step_ms"] == 100.0          # median of the two rounds
    assert rows[("example", "bf16")]["tokens_per_s"] == 90.0
    assert rows[("example", "fp4")]["tokens_vs_bf16"] == 1.0
    assert rows[("checked", "fp4")]["tokens_vs_bf16"] == 60.0 / 50.0   # its own config's bf16
    assert rows[("graphs", "fp4")]["tokens_vs_bf16"] == 2.0            # the example's bf16
    assert "| gpu | graphs | fp4 | 60.0 (60.0) | 180 | 2.000x | 1,700 |" in \
        main_job_ab.table(list(rows.values()))


def test_runs_of_several_calls_pool_with_renamed_configs(tmp_path):
    first, second = tmp_path / "call1", tmp_path / "call2"
    first.mkdir()
    second.mkdir()
    _run(first, "gpu__example__bf16__r1", 90.0, 100.0, 1800)
    _run(first, "gpu__example__fp4__r1", 120.0, 75.0, 1400)    # "example" meant eager then
    _run(first, "gpu__graphs__fp4__r1", 80.0, 110.0, 1460)
    _run(second, "gpu__example__bf16__r1", 70.0, 130.0, 1800)
    _run(second, "gpu__example__fp4__r1", 60.0, 150.0, 1460)   # and graphs now
    runs = main_job_ab.collect(f"{first}@example=eager,graphs=auto",
                               f"{second}@example=auto", bf16_from="auto")
    rows = {(r["config"], r["recipe"]): r for r in main_job_ab.medians(runs)}
    assert set(rows) == {("auto", "bf16"), ("eager", "fp4"), ("auto", "fp4")}
    assert rows[("auto", "bf16")]["step_ms_rounds"] == [90.0, 70.0]   # both calls' bf16
    assert rows[("auto", "fp4")]["step_ms_rounds"] == [80.0, 60.0]
    assert rows[("auto", "fp4")]["tokens_vs_bf16"] == 130.0 / 115.0
    assert rows[("eager", "fp4")]["tokens_vs_bf16"] == 75.0 / 115.0   # the pooled bf16
