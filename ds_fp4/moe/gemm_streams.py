"""Issue independent GPU calls (the experts' per-expert GEMMs) on several CUDA streams.

Hopper's ``scaled_mm`` has no grouped blockwise GEMM, so ``FP8Experts`` issues one GEMM per
local expert. With few tokens per expert (e.g. 32 experts x 640 slots at hidden 7168) one
GEMM fills the GPU for little more than one wave of tiles; GEMMs on ``n`` streams overlap
one's tail with the next's start: 32 such GEMMs of each kind took 7.16 ms of GPU time on one
stream and 6.03 ms on two (``bench/results/expert_gemms_e32_h200``).

The calls are issued from this thread (issuing them from 4 host threads, tried first, made
the layer 1.6x slower, most likely from GIL handoffs), stream by stream: calls ``i, i+n, ...`` on side stream ``i``. The results
are the same bytes as one stream: each call writes only its own output. Memory stays safe
under the caching allocator: outputs are allocated by the caller on its own stream before
the calls, every side stream first waits for the caller's stream (so a block the caller
freed is not rewritten early), and the caller's stream then waits for every side stream.
"""

import threading

import torch

__all__ = ["issue", "MAX_STREAMS"]

MAX_STREAMS = 16
_lock = threading.Lock()
_streams = {}      # (device index, i) -> torch.cuda.Stream


def _side_stream(device, i):
    key = (device, i)
    with _lock:
        if key not in _streams:
            _streams[key] = torch.cuda.Stream(device)
        return _streams[key]


def _run(stream, calls):
    with torch.cuda.stream(stream):
        return [call() for call in calls]


def issue(calls, streams, device):
    """``[call() for call in calls]``, spread over ``streams`` CUDA streams.

    Arguments:
        calls: argument-less callables that each enqueue GPU work on the current stream and
            return its result (writing only their own outputs).
        streams: how many CUDA streams to use; 1 (or fewer than 2 calls, or a stream being
            captured into a CUDA graph) runs the calls on the current stream, in order.
        device: the CUDA device index the calls run on.
    Returns:
        the calls' results, in the calls' order; the current stream waits for all of them.
    """
    streams = min(int(streams), MAX_STREAMS, len(calls))
    if streams < 2 or torch.cuda.is_current_stream_capturing():
        return [call() for call in calls]
    main = torch.cuda.current_stream(device)
    sides = [_side_stream(device, i) for i in range(streams)]
    out = [None] * len(calls)
    for side in sides:
        side.wait_stream(main)
    try:
        for i, side in enumerate(sides):
            out[i::streams] = _run(side, calls[i::streams])
    finally:
        for side in sides:
            main.wait_stream(side)
    return out
