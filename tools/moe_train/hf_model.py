"""The ``--moe autoep`` model: a small Hugging Face Qwen3-MoE trained through DeepSpeed's AutoEP.

Built from a ``transformers.Qwen3MoeConfig`` with random weights (nothing is downloaded),
byte-level (vocabulary 256, the same data as the legacy model) and sized by the same
command-line arguments as ``model.ByteMoELM``. ``deepspeed.initialize`` with the
``expert_parallel`` section of ``autoep_section`` replaces each block's MoE MLP
(``model.layers.N.mlp``) by DeepSpeed's ``AutoEPMoELayer`` (dropless, grouped experts);
``ds_fp4.initialize`` then turns those into ``FP4AutoEPMoELayer`` when the ds_config has an
``fp4_moe`` section.

The weights are drawn before AutoEP shards the experts, from one seed on every rank, so the
model is the same function for every expert-parallel size. Parameter names are those of
``Qwen3MoeForCausalLM`` before AutoEP and AutoEP's after (``...mlp.experts.w1``).
"""

import copy
import functools

import torch
import torch.nn.functional as F

from .data import VOCAB

# The transformers release DeepSpeed 0.19.8's AutoEP was checked with (5.24.0 fails inside
# AutoEP); setup.cfg's `hf` extra pins it.
TRANSFORMERS_VERSION = "5.17.0"
PRESET = "qwen3_moe"


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"--moe autoep needs transformers=={TRANSFORMERS_VERSION}: "
                          f"`pip install 'ds_fp4[hf]'` or `pip install "
                          f"transformers=={TRANSFORMERS_VERSION}` ({err})") from err
    if transformers.__version__ != TRANSFORMERS_VERSION:
        import logging
        logging.getLogger(__name__).warning(
            "--moe autoep was checked with transformers %s; this is %s (5.24.0 is known to "
            "fail inside AutoEP)", TRANSFORMERS_VERSION, transformers.__version__)
    return transformers


def qwen3_moe_config(args):
    """A ``Qwen3MoeConfig`` from the run's sizes.

    Arguments (attributes of ``args``): ``layers``, ``hidden``, ``heads`` (``hidden %
    heads == 0``; full multi-head attention, head size ``hidden / heads``), ``experts``,
    ``ffn`` (each expert's hidden size), ``top_k``, ``seq_len``. Every block's MLP is a MoE
    (no dense layers), input and output embeddings are tied as in ``ByteMoELM``, and the
    router's load-balancing loss is returned (``output_router_logits``).
    """
    transformers = _transformers()
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads,
        head_dim=args.hidden // args.heads, intermediate_size=args.ffn,
        moe_intermediate_size=args.ffn, num_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=args.seq_len,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        output_router_logits=True, tie_word_embeddings=True, use_cache=False)


@functools.lru_cache(maxsize=None)  # one class, so that isinstance and pickling work
def _lm_class():
    transformers = _transformers()

    class ByteQwen3MoeLM(transformers.Qwen3MoeForCausalLM):
        """``Qwen3MoeForCausalLM`` with ``ByteMoELM``'s training interface.

        ``forward(tokens int64 [B, T], targets int64 [B, T])`` returns ``(lm_loss,
        aux_loss)``, fp32 scalars: next-byte cross entropy (nats) and the routers'
        load-balancing loss (transformers' ``load_balancing_loss_func`` over all layers).
        A subclass, not a wrapper, so that module names stay the model's own
        (``model.layers.N.mlp``: what AutoEP's preset matches).
        """

        def forward(self, tokens, targets):
            out = super().forward(input_ids=tokens, output_router_logits=True, use_cache=False)
            lm = F.cross_entropy(out.logits.float().view(-1, VOCAB), targets.reshape(-1))
            aux = out.aux_loss
            aux = lm.new_zeros(()) if aux is None else aux.float()
            return lm, aux

    return ByteQwen3MoeLM


def build_hf_model(args, seed):
    """The model (fp32, random weights drawn from ``seed``; DeepSpeed casts it for bf16).

    Raises:
        ValueError naming the argument when ``--hidden`` is not a multiple of ``--heads``.
    """
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    cfg = qwen3_moe_config(args)
    torch.manual_seed(seed)
    return _lm_class()(cfg)


def autoep_section(ep_size, **overrides):
    """The ds_config ``expert_parallel`` section that gives the model's MoE blocks to AutoEP
    (``comm_backend: comm``: the all-to-all path that fp4_moe replaces), with AutoEP's
    Triton combine on CUDA (``fused_combine``)."""
    section = {"enabled": True, "autoep_size": ep_size, "preset_model": PRESET,
               "comm_backend": "comm", "combine_impl": fused_combine()}
    section.update(overrides)
    return section


def fused_combine():
    """``combine_impl`` for this process: AutoEP's Triton ``fused_weighted_sum`` where the
    layers run on CUDA with Triton (0.77-0.82x the default combine's layer time in bf16 on
    an H200, ``bench/results/autoep_fused_h200``), else AutoEP's default."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cuda":
        return "auto"
    from deepspeed.ops.triton_ops import autoep_fused_token_ops
    return "fused_weighted_sum" if autoep_fused_token_ops.is_available() else "auto"


def with_autoep(cfg, ep_size):
    """A copy of ds_config ``cfg`` with ``autoep_section(ep_size)`` (the config's own
    ``expert_parallel`` keys win, except ``enabled`` and ``autoep_size``)."""
    cfg = copy.deepcopy(cfg)
    own = cfg.get("expert_parallel") or {}
    cfg["expert_parallel"] = autoep_section(ep_size, **{
        k: v for k, v in own.items() if k not in ("enabled", "autoep_size")})
    return cfg


def optimizer_factories(args, lr_lambda):
    """``(optimizer, lr_scheduler)`` callables for ``deepspeed.initialize``.

    AutoEP replaces the expert weights inside ``deepspeed.initialize``, after a client
    optimizer would have been built; DeepSpeed then puts the new weights into the client's
    param groups, which ZeRO 1/2 refuse ("None of the param groups are marked as MoE"). A
    callable is called by the engine with the parameters after the replacement, where the
    expert weights carry ``allreduce=False`` and are split into their own MoE group.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    def optimizer(params):
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(params), "name": "parameters"})
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    return optimizer, scheduler


def moe_layers(model):
    """Each block's MoE MLP (after ``deepspeed.initialize``: AutoEP's or ds_fp4's layer)."""
    return [layer.mlp for layer in model.model.layers]


def layer_name(layer):
    """The MoE layer's class, marked "(off)" for an FP4 layer whose config disables it."""
    cfg = getattr(layer, "fp4_config", None)
    return type(layer).__name__ + (" (off)" if cfg is not None and not cfg.enabled else "")


def count_params(model):
    """``(total, expert)`` parameter counts of this rank's model (after AutoEP sharded it)."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, expert
