"""DeepSpeed's gate Linear in float32 math, run on bf16 tensor cores from the bf16 input.

DeepSpeed's ``TopKGate`` casts its input to float32 and computes ``logits = x @ wg^T`` in
float32: on CUDA an SGEMM on CUDA cores (torch leaves TF32 off for matmuls), two more in
the backward, and float32 copies (the input up, its gradient down). On one H200 at hidden
7168, 32 experts, 8192 tokens those took ~0.7 ms of the fp4 layer's 13.5 ms forward+backward
(``bench/results/layer_standing_h200_session23``: the f32 GEMMs 0.41 ms, the float32 copies
~0.3 ms).

The same float32 math runs on bf16 tensor cores. A float32 number is the exact sum of three
bfloat16 numbers (its significand's top, middle and last 8 bits: ``ops.split_bf16``, on CUDA
one launch per layout), the product of two bfloat16 numbers is exact in float32, and the
tensor cores add in float32. So, with
w = w0 + w1 + w2 and the logits' gradient g = g0 + g1 + g2::

    logits = sum_i x @ w_i^T        one GEMM x [T, K] @ [w0; w1; w2]^T, float32 out, summed
    d w    = sum_i g_i^T @ x        one GEMM [g0 g1 g2]^T @ x, float32 out, summed
    d x    = sum_{i+j<=2} g_i @ w_j one GEMM over the six pairs, bf16 out (rounded once, as
                                    DeepSpeed's float32 result is when cast back)

A bf16 weight (a bf16 model's gate: DeepSpeed casts it up per call) is its own top part,
w1 = w2 = 0: the logits are one GEMM ``x @ w^T`` and d x's products the three ``g_i @ w``
(``[g0 g1 g2] @ [w; w; w]``), which leaves out two split launches, the weight's float32
copy and two thirds of the forward GEMM (``bench/results/host_cuts_h200``).

These are DeepSpeed's float32 results up to the order of the additions (``d x`` leaves out
the three products below float32's last bit) and the tensor cores' float32 accumulation,
which aligns products with truncation inside each MMA: on the H200 the logits' error was
3-6x an SGEMM's (2.7e-6 against 8e-7 at K = 512), within 2**-20 of the sum of magnitudes
(``tests/test_gate_linear.py``), where bf16 logits would be off by 2**-9. Used by
``FP4MOELayer`` on CUDA for a bf16 input (``applies``); anything else keeps DeepSpeed's gate
as it is.
"""

import functools

import torch
from deepspeed.moe import sharded_moe

from ds_fp4.ops.split_bf16 import split_bf16

__all__ = ["applies", "gate"]


# The parts' layouts (``ops.split_bf16`` patterns; part i: significand bits 8i to 8i + 7):
# the weight's parts stacked, and the factors of d x's six products i + j <= 2, g_i and w_j
GATE_PARTS = (0, 1, 2)
GRAD_FACTORS = (0, 0, 1, 0, 1, 2)
WEIGHT_FACTORS = (0, 1, 0, 2, 1, 0)


def _weight_parts(w):
    """``[E, K]`` -> its nonzero parts stacked, bf16: ``w`` itself for a bf16 weight, else
    ``[w0; w1; w2]`` ``[3E, K]``."""
    return w if w.dtype == torch.bfloat16 else split_bf16(w.float(), GATE_PARTS, 0)


def _grad_factors(g, w):
    """d x's products as one GEMM's factors: ``(parts of g [T, 3E], a [T, n E], b [n E,
    K])`` with ``d x = a @ b``: for a bf16 weight ``a`` is the parts and ``b`` ``[w; w; w]``,
    else the six products' factors. bf16."""
    if w.dtype == torch.bfloat16:
        parts = split_bf16(g, GATE_PARTS, 1)
        # cat, not repeat: torch's repeat is ~10 ops of host time (0.16 ms on the H200's host)
        return parts, parts, torch.cat((w,) * len(GATE_PARTS))
    both = split_bf16(g, GATE_PARTS + GRAD_FACTORS, 1)   # one launch for both layouts
    n = len(GATE_PARTS) * g.shape[1]
    return both[:, :n], both[:, n:], split_bf16(w.float(), WEIGHT_FACTORS, 0)


def _mm_f32(a, b):
    """bf16 ``a @ b`` with float32 output (float32 accumulation)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())   # the products are exact, the sums float32


def _sum_parts(p, n, dim):
    """The sum of the three parts that ``p`` holds side by side along ``dim`` (3 x n)."""
    return p.unflatten(dim, (3, n)).sum(dim)


class _GateLinear(torch.autograd.Function):
    """``float32(x) @ w^T`` for bf16 ``x [T, K]`` and ``w [E, K]`` (any float dtype)."""

    @staticmethod
    def forward(ctx, x, w):
        e = w.shape[0]
        # w's gradient reads x: a copy, as DeepSpeed's gate keeps one (its float32 upcast),
        # for the caller may change its input in place after the forward
        ctx.save_for_backward(x.clone() if ctx.needs_input_grad[1] else None, w)
        parts = _weight_parts(w)
        logits = _mm_f32(x, parts.t())
        return logits if parts is w else _sum_parts(logits, e, 1)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        parts, a, b = _grad_factors(g.float().contiguous(), w)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(a, b)
        if ctx.needs_input_grad[1]:
            dw = _sum_parts(_mm_f32(parts.t(), x), w.shape[0], 0).to(w.dtype)
        return dx, dw


@functools.lru_cache(maxsize=None)
def _out_dtype_mm(device_type: str) -> bool:
    """Whether this torch has bf16 ``mm`` with float32 output on ``device_type``."""
    if device_type != "cuda":
        return True   # ``_mm_f32`` computes it in float32 there
    try:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _on(tokens) -> bool:
    """Where the split GEMMs replace DeepSpeed's: CUDA (its float32 GEMMs run on CUDA
    cores; on a CPU DeepSpeed's are as exact and no slower). Tests widen it."""
    return tokens.is_cuda


def applies(gate, tokens) -> bool:
    """Whether ``gate(tokens, ...)`` may run as ``gate_linear.gate``: DeepSpeed's own
    ``TopKGate.forward`` (not a subclass's), a bf16 input outside autocast (which would
    make DeepSpeed's Linear bf16), no input jitter, no gate timer."""
    return (type(gate).forward is sharded_moe.TopKGate.forward and tokens.dtype == torch.bfloat16
            and _on(tokens) and not torch.is_autocast_enabled(tokens.device.type)
            and not (gate.noisy_gate_policy == "Jitter" and gate.training)
            and not gate.wall_clock_breakdown and _out_dtype_mm(tokens.device.type))


def gate(gate, tokens, used_token):
    """``gate(tokens, used_token, sparse_routes=True)`` for a gate that ``applies``:
    the logits from ``_GateLinear``, then DeepSpeed's gating function for the gate's k,
    called through the module (where the layer's row scan and graphs dispatch it)."""
    logits = _GateLinear.apply(tokens, gate.wg.weight)
    cf = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    if gate.k == 1:
        return sharded_moe.top1gating(logits, cf, gate.min_capacity, used_token,
                                      gate.noisy_gate_policy if gate.training else None,
                                      gate.drop_tokens, gate.use_rts, gate.ep_group, True, False)
    if gate.k == 2:
        return sharded_moe.top2gating(logits, cf, gate.min_capacity, gate.drop_tokens,
                                      gate.ep_group, gate.top2_2nd_expert_sampling, True)
    return sharded_moe.topkgating(logits, gate.k, cf, gate.min_capacity, gate.drop_tokens,
                                  gate.ep_group, sparse_routes=True)
