"""The layer a user would pick instead: a dropless bf16 MoE on ``torch._grouped_mm``.

Softmax top-k router (float32 logits from the same gate weights as DeepSpeed's
``TopKGate``), tokens sorted by expert into segments padded to 16 rows (on the device, no
host sync), gate/up and down as two grouped GEMMs with SwiGLU between, and a gate-weighted
``index_add`` combine. One rank only (no all-to-all): the baseline of the one-GPU rows of
``tools/bench_moe_layer.py``; with expert parallelism DeepSpeed's AutoEP is that layer.
"""

import torch
from torch import nn
from torch.nn import functional as F

_ALIGN = 16   # rows per segment that torch._grouped_mm's bf16 kernels want


class GroupedBF16MoE(nn.Module):
    """Dropless top-k MoE with SwiGLU experts on ``torch._grouped_mm`` (bf16).

    Arguments:
        gate_weight: ``[E, H]`` router weight (copied).
        w1: ``[E, 2F, H]`` each expert's gate and up weights stacked (copied).
        w2: ``[E, H, F]`` each expert's down weight (copied).
        k: experts per token.
    ``forward(x [..., H])`` returns ``(y [..., H], 0.0, tokens per expert [E])`` like
    DeepSpeed's ``MoE``.
    """

    def __init__(self, gate_weight, w1, w2, k):
        super().__init__()
        self.wg = nn.Parameter(gate_weight.detach().float().clone())
        self.w1 = nn.Parameter(w1.detach().clone())
        self.w2 = nn.Parameter(w2.detach().clone())
        self.k = k

    @classmethod
    def from_deepspeed(cls, moe):
        """The same router and expert weights as a ``deepspeed.moe.layer.MoE`` of SwiGLU
        experts (``gate``, ``up``, ``down`` Linears without bias), one rank."""
        inner = moe.deepspeed_moe
        experts = list(inner.experts.deepspeed_experts)
        w1 = torch.stack([torch.cat((e.gate.weight, e.up.weight)) for e in experts])
        w2 = torch.stack([e.down.weight for e in experts])
        return cls(inner.gate.wg.weight, w1, w2, inner.gate.k)

    def forward(self, x):
        shape, hidden = x.shape, x.shape[-1]
        tokens = x.reshape(-1, hidden)
        n_exp = self.w1.shape[0]
        probs = torch.softmax(tokens.float() @ self.wg.t(), dim=-1)
        top_w, top_e = probs.topk(self.k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        flat_e = top_e.flatten()
        order = flat_e.argsort(stable=True)
        counts = torch.bincount(flat_e, minlength=n_exp)
        padded = (counts + _ALIGN - 1) // _ALIGN * _ALIGN
        ends = padded.cumsum(0)
        starts = ends - padded
        first = counts.cumsum(0) - counts          # each expert's first route in `order`
        sorted_e = flat_e[order]
        pos = starts[sorted_e] + torch.arange(order.numel(), device=x.device) - first[sorted_e]
        rows = order.numel() + n_exp * (_ALIGN - 1)  # an upper bound: no host sync
        src = tokens[order // self.k]
        xp = src.new_zeros(rows, hidden).index_copy(0, pos, src)
        offs = ends.to(torch.int32)
        z = torch._grouped_mm(xp, self.w1.transpose(-2, -1), offs=offs)
        gate, up = z.chunk(2, dim=-1)
        h = (F.silu(gate.float()) * up.float()).to(z.dtype)
        yp = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)
        y = yp[pos] * top_w.flatten()[order, None].to(yp.dtype)
        out = torch.zeros_like(tokens).index_add(0, order // self.k, y)
        return out.reshape(shape), 0.0, counts
