"""The model: a decoder-only byte-level transformer whose MLPs are DeepSpeed MoE layers.

``deepspeed.moe.layer.MoE`` with SwiGLU experts, expert parallel over the ranks; the
weights are drawn so that the model is the same function for every expert-parallel size.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import TopKGate
from torch import nn

from .data import VOCAB, mix_seed


class _SwiGLU(nn.Module):
    """Stand-in for ``ds_fp4.moe.expert.SwiGLUExpert`` (same parameter names and math)."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def make_expert(hidden, ffn):
    """A SwiGLU expert: ds_fp4's own when it is importable (FP8 experts take only that)."""
    try:
        from ds_fp4.moe.expert import SwiGLUExpert
    except ImportError:
        return _SwiGLU(hidden, ffn)
    return SwiGLUExpert(hidden, ffn)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``[B, T, hidden]`` -> ``[B, T, hidden]``."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class Block(nn.Module):
    """Pre-norm attention then MoE MLP; ``forward(x)`` returns ``(x, the gate's aux loss)``."""

    def __init__(self, args, ep_size):
        super().__init__()
        self.ln1 = nn.LayerNorm(args.hidden)
        self.attn = CausalSelfAttention(args.hidden, args.heads)
        self.ln2 = nn.LayerNorm(args.hidden)
        self.moe = MoE(hidden_size=args.hidden, expert=make_expert(args.hidden, args.ffn),
                       num_experts=args.experts, ep_size=ep_size, k=args.top_k,
                       capacity_factor=args.capacity_factor,
                       eval_capacity_factor=args.capacity_factor, min_capacity=4)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        y, l_aux, _ = self.moe(self.ln2(x))
        return x + y, l_aux


class ByteMoELM(nn.Module):
    """Decoder-only byte-level transformer whose MLPs are DeepSpeed MoE layers.

    ``forward(tokens int64 [B, T], targets int64 [B, T])`` returns ``(lm_loss, aux_loss)``,
    fp32 scalars: next-byte cross entropy (nats) and the gates' summed load-balancing loss.
    """

    def __init__(self, args, ep_size):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, args.hidden)
        self.pos = nn.Embedding(args.seq_len, args.hidden)
        self.blocks = nn.ModuleList(Block(args, ep_size) for _ in range(args.layers))
        self.ln_f = nn.LayerNorm(args.hidden)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux.float()
        logits = self.ln_f(x) @ self.embed.weight.t()  # tied input/output embedding
        lm = F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))
        return lm, aux


def init_weights(model, seed, ep_rank, layers):
    """Initialize so that the model is the same function for every EP size.

    DeepSpeed's ``Experts`` deep-copies one expert module, so all local experts start equal;
    each expert is instead drawn from its own generator keyed by its global index.
    """
    std, out_std = 0.02, 0.02 / math.sqrt(2 * layers)  # GPT-2 style scaled residual outputs
    g = torch.Generator().manual_seed(mix_seed(seed, -1))
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight), nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and ".deepspeed_experts." not in name:
            s = out_std if name.endswith("proj") else std
            module.weight.data.copy_(torch.randn(module.weight.shape, generator=g) * s)
    for li, block in enumerate(model.blocks):
        local = block.moe.deepspeed_moe.experts.deepspeed_experts
        for j, expert in enumerate(local):
            ge = torch.Generator().manual_seed(mix_seed(seed, li, ep_rank * len(local) + j))
            for pname, param in sorted(expert.named_parameters()):
                s = out_std if pname.startswith("down") else std
                param.data.copy_(torch.randn(param.shape, generator=ge) * s)


@contextlib.contextmanager
def gates_without_noise(model):
    """Within, every top-2 gate of ``model`` routes each token to its two best experts.

    DeepSpeed's top-2 gate picks the second expert with Gumbel noise
    (``top2_2nd_expert_sampling``) in eval mode too, so an evaluation would depend on the
    random state; training keeps DeepSpeed's noise.
    """
    gates = [m for m in model.modules() if isinstance(m, TopKGate)]
    saved = [g.top2_2nd_expert_sampling for g in gates]
    for g in gates:
        g.top2_2nd_expert_sampling = False
    try:
        yield
    finally:
        for g, value in zip(gates, saved):
            g.top2_2nd_expert_sampling = value


def count_params(model):
    """``(total, expert)`` parameter counts of this rank's model."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".deepspeed_experts." in n)
    return total, expert


def layer_name(moe):
    """The MoE layer's class, marked "(off)" for an FP4MoE whose config disables it, and
    "+ FP8Experts" when its experts run FP8 GEMMs (known after the first forward)."""
    cfg = getattr(moe, "fp4_config", None)
    name = type(moe).__name__ + (" (off)" if cfg is not None and not cfg.enabled else "")
    experts = type(moe.deepspeed_moe.experts).__name__
    return name + (f" + {experts}" if experts == "FP8Experts" else "")
