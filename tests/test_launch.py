"""tools/moe_train/launch.py: the rank's shared-memory buffer is removed at exit."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from moe_train.launch import unlink_shm_buffer  # noqa: E402

PREFIX = "deepspeed_allreduce_buffer_0_127.0.0.1_"


def _files(folder, names):
    for name in names:
        (folder / name).write_bytes(b"x")


def test_only_this_ranks_buffer_of_this_port_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("RANK", "1")
    kept = [PREFIX + "29999_0", PREFIX + "29998_1", PREFIX + "29999_11", "other_29999_1"]
    _files(tmp_path, kept + [PREFIX + "29999_1"])
    unlink_shm_buffer(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT", "RANK"])
def test_nothing_goes_outside_a_launched_rank(tmp_path, monkeypatch, missing):
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29999"), ("RANK", "0")):
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(missing)
    _files(tmp_path, [PREFIX + "29999_0"])
    unlink_shm_buffer(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [PREFIX + "29999_0"]
