"""The expert MLP that ds_fp4's FP8 experts know how to run: SwiGLU (or GELU), plain torch."""

from torch import nn
from torch.nn import functional as F

ACTIVATIONS = ("swiglu", "gelu")


class SwiGLUExpert(nn.Module):
    """One expert: ``down(silu(gate(x)) * up(x))``, or ``down(gelu(up(x)))`` for ``"gelu"``.

    A plain module (bf16/fp32 math): pass it as ``expert=`` to ``deepspeed.moe.layer.MoE`` or
    ``ds_fp4.moe.FP4MoE``. ``ds_fp4.moe.fp8_experts.FP8Experts`` runs the same weights with
    FP8 GEMMs; the parameter names stay these.

    Arguments:
        hidden: model width (``x``'s last dimension).
        ffn: intermediate width.
        activation: ``"swiglu"`` (default; layers ``gate``, ``up``, ``down``) or ``"gelu"``
            (layers ``up``, ``down``; exact erf GELU).
        bias: whether the Linear layers have biases (default False).
        device, dtype: for the parameters, as for ``nn.Linear``.
    """

    def __init__(self, hidden, ffn, activation="swiglu", bias=False, device=None, dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
        for name, value in (("hidden", hidden), ("ffn", ffn)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        self.hidden, self.ffn, self.activation = hidden, ffn, activation
        kw = {"bias": bias, "device": device, "dtype": dtype}
        if activation == "swiglu":
            self.gate = nn.Linear(hidden, ffn, **kw)
        self.up = nn.Linear(hidden, ffn, **kw)
        self.down = nn.Linear(ffn, hidden, **kw)

    @staticmethod
    def _linear(layer, x):
        # Run in x's dtype, so fp32 master weights serve a bf16 activation path.
        bias = layer.bias.to(x.dtype) if layer.bias is not None else None
        return F.linear(x, layer.weight.to(x.dtype), bias)

    def forward(self, x):
        """``x [..., hidden]`` -> ``[..., hidden]`` in ``x``'s dtype."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x must be [..., {self.hidden}]; got {tuple(x.shape)}")
        if self.activation == "swiglu":
            h = F.silu(self._linear(self.gate, x)) * self._linear(self.up, x)
        else:
            h = F.gelu(self._linear(self.up, x))
        return self._linear(self.down, h)

    def extra_repr(self):
        return f"hidden={self.hidden}, ffn={self.ffn}, activation={self.activation!r}"
