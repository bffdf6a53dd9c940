"""The main job's engine: distributed setup, the model (legacy MoE or a Hugging Face model
through AutoEP), its optimizer and schedule, handed to ``ds_fp4.initialize``."""

import argparse
import math
import os

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from . import hf_model
from .checks import RunError
from .cli import resolve_sizes
from .launch import quiet_deepspeed, single_process_env
from .model import ByteMoELM, count_params, init_weights, layer_name
from .recipes import base_config


def setup(args):
    """Distributed init, sizes and the base ds_config; returns the base config."""
    single_process_env()
    quiet_deepspeed()
    acc = get_accelerator()
    if acc.device_name() != "cpu":  # one device per local rank, before anything touches one
        acc.set_device(args.local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # CPU ranks would oversubscribe the cores
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    cfg = base_config(args)
    if args.moe == "legacy" and (cfg.get("expert_parallel") or {}).get("enabled"):
        raise RunError("the ds_config enables expert_parallel (AutoEP), which replaces a "
                       "Hugging Face model's MoE blocks; pass --moe autoep to train one, or "
                       "drop the section for the legacy model")
    if args.micro_batch is None:
        args.micro_batch = cfg.get("train_micro_batch_size_per_gpu")
    resolve_sizes(args, get_accelerator().device_name() != "cpu")
    world = tdist.get_world_size()
    args.ep_size = args.ep_size or world
    if world % args.ep_size or args.experts % args.ep_size:
        raise RunError(f"--ep-size {args.ep_size} must divide the world size ({world}) and "
                       f"--experts ({args.experts})")
    return cfg


def lr_lambda(args):
    """Linear warmup, then cosine decay to 10% of the peak at ``--schedule-steps``."""
    def f(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.schedule_steps - args.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


# DeepSpeed's default ZeRO reduce_bucket_size, in elements (0.19.8; zero/config.py)
ZERO_REDUCE_BUCKET = 500_000_000


def sized_reduce_bucket(cfg, model):
    """``cfg`` with ZeRO 1/2's ``reduce_bucket_size`` no larger than the model's gradients.

    ZeRO 1/2 allocate a gradient bucket of ``reduce_bucket_size`` elements at every
    backward (``stage_1_and_2.py`` ``setup_buckets``), whatever the model's size: at the
    default 5e8, 954 MB in bf16, live at every recipe's peak (``bench/results/memory_h200``:
    36% of the main job's default GPU model's bf16 peak, whose 59M parameters need 113 MB).
    A bucket that holds every gradient reduces them in one call, as the default did for a
    model this small. A size the config sets is kept."""
    zero = cfg.get("zero_optimization") or {}
    if zero.get("stage", 0) not in (1, 2) or "reduce_bucket_size" in zero:
        return cfg
    grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if grads >= ZERO_REDUCE_BUCKET:
        return cfg
    return {**cfg, "zero_optimization": {**zero, "reduce_bucket_size": grads}}


def _initialize_fn(section):
    """``ds_fp4.initialize``, or DeepSpeed's own when ds_fp4 is absent and not asked for."""
    try:
        from ds_fp4 import initialize
        return initialize
    except ImportError as err:
        if section.get("enabled", True):
            raise RuntimeError(f"the ds_config enables fp4_moe but ds_fp4.initialize cannot be "
                               f"imported ({err}); set \"fp4_moe\": {{\"enabled\": false}} to "
                               f"train DeepSpeed's own MoE") from err
        return deepspeed.initialize


def build_engine(args, cfg, ep_size):
    """Build the model and hand it to ``ds_fp4.initialize``; returns ``(engine, model)``."""
    if args.moe == "autoep":
        model = hf_model.build_hf_model(args, seed=args.seed)  # fp32, the same on every rank
        cfg = hf_model.with_autoep(cfg, ep_size)   # AutoEP shards the experts over EP ranks
        # callables: AutoEP replaces the expert weights inside initialize, after a ready-made
        # optimizer would have taken them (ZeRO 1/2 then refuse it)
        optimizer, scheduler = hf_model.optimizer_factories(args, lr_lambda(args))
        optimizer = None if "optimizer" in cfg else optimizer
        scheduler = None if "optimizer" in cfg or "scheduler" in cfg else scheduler
        params = model.parameters()
    else:
        torch.manual_seed(args.seed)
        model = ByteMoELM(args, ep_size)
        init_weights(model, args.seed, tdist.get_rank() % ep_size, args.layers)
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        optimizer = scheduler = None
        if "optimizer" not in cfg:
            optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95),
                                          weight_decay=0.01)
            if "scheduler" not in cfg:
                scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    cfg = sized_reduce_bucket(cfg, model)
    ds_args = argparse.Namespace(**vars(args))
    ds_args.deepspeed_config = None  # the config travels as a dict (batch keys filled in)
    initialize = _initialize_fn(cfg.get("fp4_moe", {}))
    engine, _, _, _ = initialize(args=ds_args, model=model, model_parameters=params,
                                 optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    return engine, model


def moe_layer_name(args, model):
    """The class of the model's first MoE layer, as the table's "layer" column shows it."""
    if args.moe == "autoep":
        return hf_model.layer_name(hf_model.moe_layers(model)[0])
    return layer_name(model.blocks[0].moe)


def param_counts(args, model):
    """``(total, expert)`` parameters of this rank's model (experts: this rank's shard)."""
    return hf_model.count_params(model) if args.moe == "autoep" else count_params(model)
