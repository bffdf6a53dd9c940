"""ds_fp4.moe.gemm_streams.issue: results in the calls' order, the round-robin split, and
the caller's stream left waiting on every side stream (also after an error). CPU: the CUDA
stream API is faked (recording waits); the GPU results themselves are compared bit for bit
in test_fp8_experts.py."""

import pytest
import torch

from ds_fp4.moe import gemm_streams


class _Stream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(other.name)


@pytest.fixture
def fake_streams(monkeypatch):
    main = _Stream("main")
    sides = {}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gemm_streams, "_side_stream",
                        lambda device, i: sides.setdefault(i, _Stream(f"side{i}")))
    monkeypatch.setattr(gemm_streams, "_run",
                        lambda stream, calls: [(stream.name, call()) for call in calls])
    return main, sides


@pytest.mark.parametrize("count, streams", [(7, 3), (4, 4), (5, 8), (9, 2)])
def test_results_keep_the_calls_order(fake_streams, count, streams):
    main, sides = fake_streams
    out = gemm_streams.issue([lambda i=i: i * i for i in range(count)], streams, 0)
    used = min(streams, count)
    assert [v for _, v in out] == [i * i for i in range(count)]
    assert [s for s, _ in out] == [f"side{i % used}" for i in range(count)]
    assert sorted(main.waited) == sorted(f"side{i}" for i in range(used))
    assert all(sides[i].waited == ["main"] for i in range(used))


def test_one_stream_or_one_call_runs_here(fake_streams):
    main, sides = fake_streams
    assert gemm_streams.issue([lambda: 1, lambda: 2], 1, 0) == [1, 2]
    assert gemm_streams.issue([lambda: 3], 4, 0) == [3]
    assert not sides and not main.waited


def test_capturing_runs_here(fake_streams, monkeypatch):
    main, sides = fake_streams
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gemm_streams.issue([lambda: 1, lambda: 2, lambda: 3], 2, 0) == [1, 2, 3]
    assert not sides


def test_an_error_surfaces_after_every_stream_is_joined(fake_streams):
    main, _ = fake_streams

    def boom():
        raise RuntimeError("GEMM refused")
    with pytest.raises(RuntimeError, match="GEMM refused"):
        gemm_streams.issue([lambda: 1, boom, lambda: 3, lambda: 4], 2, 0)
    assert sorted(main.waited) == ["side0", "side1"]
