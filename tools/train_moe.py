"""Train a small byte-level MoE language model with DeepSpeed, in bf16, FP8 or FP4 recipes.

The main job of ds_fp4 (issue 6). A decoder-only transformer whose MLPs are DeepSpeed MoE
layers (``deepspeed.moe.layer.MoE`` with SwiGLU experts, expert parallel over the ranks) is
handed to ``ds_fp4.initialize``, which reads the ``fp4_moe`` section of the ds_config and
turns the layers into FP4MoE. Run it the DeepSpeed way::

    deepspeed --num_gpus 2 tools/train_moe.py --deepspeed_config ds_config_examples/fp4_moe.json

On a CPU-only machine set ``DS_ACCELERATOR=cpu OMP_NUM_THREADS=1``; the same command then
spawns 2 CPU ranks (gloo). Data: the Python standard library's own ``.py`` sources as bytes
(``sysconfig.get_paths()["stdlib"]``), about 1 file in 20 held out by a hash of its path, or
``--data PATH`` (a text file or a folder). Batches and random numbers are a function of
(seed, step, rank) only, so two recipes see the same data in the same order and a run
resumed with ``--load`` continues the loss curve of the run that saved it.

``--compare bf16,fp8,fp4`` runs the recipes one after another and writes a PNG with the loss
curves and bars of memory and all-to-all bytes, plus each recipe's relative loss deviation
from bf16. Everything printed at the end is also written under ``--out``.
"""

import argparse
import copy
import csv
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: make `import ds_fp4` work
    sys.path.insert(0, str(REPO))

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402

VOCAB = 256  # byte-level tokens
AUX_LOSS_COEF = 0.01
HELDOUT_EVERY = 20  # one file in 20 (by CRC32 of its relative path) is held out
# Per-recipe ds_config examples whose fp4_moe section --compare uses.
RECIPE_FILES = {"bf16": "bf16_moe.json", "fp8": "fp8_moe.json", "fp4": "fp4_moe.json"}
A2A_KINDS = ("dispatch_fwd", "combine_fwd", "combine_bwd", "dispatch_bwd")

# Model and run sizes by device kind; every one can be overridden on the command line.
DEFAULTS = {
    "cpu": dict(layers=2, hidden=128, heads=4, experts=8, ffn=256, seq_len=128, micro_batch=8,
                steps=200, lr=3e-3, eval_interval=50, eval_batches=4),
    "gpu": dict(layers=8, hidden=512, heads=8, experts=8, ffn=512, seq_len=512, micro_batch=32,
                steps=2000, lr=1e-3, eval_interval=250, eval_batches=8),
}


# --------------------------------------------------------------------------- arguments

def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    p.add_argument("--data", default=None,
                   help="text file or folder (all files under it); default: the stdlib sources")
    p.add_argument("--steps", type=int, help="optimizer steps (default: 200 CPU, 2000 GPU)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int, help="model width; a multiple of 128 for FP8 wires")
    p.add_argument("--heads", type=int)
    p.add_argument("--experts", type=int, help="experts per MoE layer (total over EP ranks)")
    p.add_argument("--ffn", type=int, help="expert hidden size")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--ep-size", type=int, help="expert-parallel size (default: world size)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int,
                   help="sequences per rank per micro step (default: the ds_config's "
                        "train_micro_batch_size_per_gpu, else 8 CPU / 32 GPU)")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int, help="warmup steps (default: steps/10, at most 200)")
    p.add_argument("--eval-interval", type=int)
    p.add_argument("--eval-batches", type=int, help="held-out micro batches per rank")
    p.add_argument("--recipe", default=None,
                   help="replace the ds_config's fp4_moe section with a recipe's: "
                        f"{', '.join(RECIPE_FILES)} or a ds_config path")
    p.add_argument("--compare", default=None,
                   help="comma-separated recipes run one after another, e.g. bf16,fp8,fp4")
    p.add_argument("--out", default=None, help="folder for CSV/JSON metrics (and the PNG)")
    p.add_argument("--save", default=None, help="DeepSpeed checkpoint folder to write")
    p.add_argument("--save-interval", type=int, default=0, help="also save every N steps")
    p.add_argument("--load", default=None, help="DeepSpeed checkpoint folder to resume from")
    p.add_argument("--load-tag", default=None,
                   help="checkpoint tag in --load (e.g. step500; default: its 'latest')")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    deepspeed.add_config_arguments(p)
    return p


def resolve_sizes(args, on_gpu):
    """Fill every size flag left unset from the CPU or GPU defaults."""
    for key, value in DEFAULTS["gpu" if on_gpu else "cpu"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.warmup is None:
        args.warmup = min(200, max(1, args.steps // 10))
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return args


# --------------------------------------------------------------------------- data

def _corpus_files(path, stdlib):
    """Sorted ``(relative name, path)`` of the text files under ``path`` (or ``path`` itself).

    Skips caches, VCS folders, installed packages and files with a NUL byte in their first
    4 KiB (binaries); the stdlib default takes only its ``.py`` sources.
    """
    root = Path(path)
    if root.is_file():
        return [(root.name, root)]
    if not root.is_dir():
        raise ValueError(f"--data {path!r}: no such file or folder")
    skip = {"__pycache__", ".git", ".hg", ".svn", "site-packages", "node_modules"}
    found = []
    for f in root.rglob("*.py" if stdlib else "*"):
        if f.is_file() and not skip.intersection(f.relative_to(root).parts):
            with open(f, "rb") as fh:
                if b"\0" not in fh.read(4096):
                    found.append((str(f.relative_to(root)), f))
    return sorted(found)


def load_corpus(path=None):
    """Byte tokens of a corpus, split into train and held-out parts by file.

    Arguments:
        path: a text file or a folder; ``None`` for the stdlib's ``.py`` sources.

    Returns:
        ``(train, heldout, description)``: uint8 tensors of the concatenated files (each
        file followed by a NUL byte). A single file is split 95/5 by position instead.
    """
    stdlib = path is None
    path = path or sysconfig.get_paths()["stdlib"]
    files = _corpus_files(path, stdlib)
    if not files:
        raise ValueError(f"--data {path!r} holds no files")
    train, held = bytearray(), bytearray()
    for name, f in files:
        blob = f.read_bytes() + b"\0"
        (held if zlib.crc32(name.encode()) % HELDOUT_EVERY == 0 else train).extend(blob)
    if len(files) == 1:
        cut = len(train) * (HELDOUT_EVERY - 1) // HELDOUT_EVERY
        train, held = train[:cut], train[cut:]
    if not held:  # a small folder whose every file hashed to train
        cut = len(train) * (HELDOUT_EVERY - 1) // HELDOUT_EVERY
        train, held = train[:cut], train[cut:]
    desc = f"{path} ({len(files)} files, {len(train) / 1e6:.1f} MB train, {len(held) / 1e6:.2f} MB held out)"
    as_tensor = lambda b: torch.frombuffer(b, dtype=torch.uint8).clone()  # noqa: E731
    return as_tensor(train), as_tensor(held), desc


def _mix(*ints):
    """A 63-bit seed from a few integers, the same in every process and Python version."""
    return zlib.crc32(repr(ints).encode()) * 0x9E3779B1 % (1 << 63)


def train_batch(data, seq_len, batch, seed, step, micro, rank):
    """Random windows of ``data`` chosen by ``(seed, step, micro, rank)`` only.

    Returns:
        ``(inputs, targets)``: int64 ``[batch, seq_len]``, targets shifted by one byte.
    """
    if len(data) <= seq_len + 1:
        raise ValueError(f"the training text ({len(data)} bytes) is shorter than --seq-len {seq_len}")
    g = torch.Generator().manual_seed(_mix(seed, step, micro, rank))
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def eval_batches(data, seq_len, batch, n_batches, rank, world):
    """This rank's share of a fixed set of evenly spaced held-out windows."""
    total = n_batches * batch * world
    if len(data) <= seq_len + 1:
        raise ValueError(f"the held-out text ({len(data)} bytes) is shorter than --seq-len {seq_len}")
    starts = torch.linspace(0, len(data) - seq_len - 1, total).long()[rank::world]
    for i in range(n_batches):
        rows = torch.stack([data[s:s + seq_len + 1] for s in starts[i * batch:(i + 1) * batch].tolist()])
        yield rows[:, :-1].long(), rows[:, 1:].long()


# --------------------------------------------------------------------------- model

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
    g = torch.Generator().manual_seed(_mix(seed, -1))
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight), nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and ".deepspeed_experts." not in name:
            s = out_std if name.endswith("proj") else std
            module.weight.data.copy_(torch.randn(module.weight.shape, generator=g) * s)
    for li, block in enumerate(model.blocks):
        local = block.moe.deepspeed_moe.experts.deepspeed_experts
        for j, expert in enumerate(local):
            ge = torch.Generator().manual_seed(_mix(seed, li, ep_rank * len(local) + j))
            for pname, param in sorted(expert.named_parameters()):
                s = out_std if pname.startswith("down") else std
                param.data.copy_(torch.randn(param.shape, generator=ge) * s)


def count_params(model):
    """``(total, expert)`` parameter counts of this rank's model."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".deepspeed_experts." in n)
    return total, expert


# --------------------------------------------------------------------------- measurements

def _layer_comm_stats():
    """FP4MoE's own per-collective byte counters, or None without ds_fp4's layer."""
    try:
        from ds_fp4.moe.alltoall import comm_stats
    except ImportError:
        return None
    return comm_stats


class AllToAllCounter:
    """Bytes each rank hands to ``all_to_all_single``, labelled dispatch/combine, fwd/bwd.

    FP4MoE names its collectives (``fp4_dispatch_fwd``, ...) and counts them in
    ``ds_fp4.moe.alltoall.comm_stats``; those counts are used when present. DeepSpeed's own
    layer names nothing, so this also wraps ``torch.distributed.all_to_all_single`` (which
    ``deepspeed.comm`` calls) and labels calls by order: in the forward pass every MoE layer
    sends dispatch then combine, and autograd runs each layer's backward in reverse
    (combine's gradient, then dispatch's). ``phase`` is set by the training loop; calls made
    while it is None are not counted.
    """

    def __init__(self):
        self.phase = None
        self._sent = {"fwd": [], "bwd": []}
        self._orig = None

    def __enter__(self):
        self._orig = tdist.all_to_all_single

        def counted(output, input, *a, **kw):
            if self.phase in self._sent:
                self._sent[self.phase].append(input.numel() * input.element_size())
            return self._orig(output, input, *a, **kw)

        tdist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        tdist.all_to_all_single = self._orig

    def begin(self):
        """Forget everything counted so far (e.g. by an evaluation)."""
        self._sent = {"fwd": [], "bwd": []}
        stats = _layer_comm_stats()
        if stats is not None:
            stats.reset()

    def take(self):
        """Bytes sent since ``begin()``: ``{kind: bytes}`` for ``A2A_KINDS``, plus ``calls``."""
        fwd, bwd = self._sent["fwd"], self._sent["bwd"]
        out = {"dispatch_fwd": sum(fwd[0::2]), "combine_fwd": sum(fwd[1::2]),
               "combine_bwd": sum(bwd[0::2]), "dispatch_bwd": sum(bwd[1::2]),
               "calls": len(fwd) + len(bwd)}
        stats = _layer_comm_stats()
        named = {k: stats.bytes.get(f"fp4_{k}", 0) for k in A2A_KINDS} if stats else {}
        if sum(named.values()):
            # Bytes of all-to-alls that are not FP4MoE's (0 unless something else sends).
            out["other"] = sum(fwd) + sum(bwd) - sum(named.values())
            out.update(named)
        self.begin()
        return out


class MemoryMeter:
    """Peak memory in windows of a run: allocated bytes on GPUs, process RSS on CPU."""

    def __init__(self):
        self.acc = get_accelerator()
        self.kind = "allocated" if self.acc.device_name() != "cpu" else "RSS"
        self.overall = 0

    def reset(self):
        self.acc.reset_peak_memory_stats()

    def peak_mb(self):
        peak = self.acc.max_memory_allocated() / 2**20
        self.overall = max(self.overall, peak)
        return peak


def measure_kept_for_backward(forward):
    """Memory that a forward pass leaves allocated for its backward (activations, caches).

    Arguments:
        forward: a callable running one forward pass and returning the loss tensor(s).

    Returns:
        ``(result of forward, MB)``. On GPUs the growth of allocated memory; on CPU the net
        bytes allocated by tensors created during ``forward`` (torch profiler, CPU memory).
    """
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        acc.synchronize()
        before = acc.memory_allocated()
        result = forward()
        acc.synchronize()
        return result, (acc.memory_allocated() - before) / 2**20
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = forward()
    net = sum(e.self_cpu_memory_usage for e in prof.events())
    return result, net / 2**20


# --------------------------------------------------------------------------- config and engine

def read_json(path):
    with open(path) as f:
        return json.load(f)


def recipe_section(recipe):
    """The ``fp4_moe`` section of a recipe name (``bf16``, ``fp8``, ``fp4``) or ds_config path."""
    path = REPO / "ds_config_examples" / RECIPE_FILES[recipe] if recipe in RECIPE_FILES else Path(recipe)
    if not path.is_file():
        raise ValueError(f"recipe {recipe!r}: {path} does not exist; use one of "
                         f"{', '.join(RECIPE_FILES)} or the path of a ds_config with an fp4_moe section")
    cfg = read_json(path)
    # A ds_config without the section runs DeepSpeed's own layer.
    return copy.deepcopy(cfg.get("fp4_moe", {"enabled": False}))


def base_config(args):
    """The ds_config of this run: ``--deepspeed_config``, else the FP4 recipe's example."""
    path = args.deepspeed_config or REPO / "ds_config_examples" / RECIPE_FILES["fp4"]
    cfg = read_json(path)
    if args.recipe:
        cfg["fp4_moe"] = recipe_section(args.recipe)
    return cfg


def finish_config(cfg, args):
    """Set the batch keys DeepSpeed needs from the run's sizes (the config's own win)."""
    cfg = copy.deepcopy(cfg)
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.pop("train_batch_size", None)  # DeepSpeed derives it from the two above
    cfg.setdefault("steps_per_print", 10**9)  # the progress bar reports instead
    return cfg


def lr_lambda(args):
    """Linear warmup, then cosine decay to 10% of the peak."""
    def f(step):
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


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
    torch.manual_seed(args.seed)
    model = ByteMoELM(args, ep_size)
    init_weights(model, args.seed, tdist.get_rank() % ep_size, args.layers)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    optimizer = scheduler = None
    if "optimizer" not in cfg:
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
        if "scheduler" not in cfg:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    ds_args = argparse.Namespace(**vars(args))
    ds_args.deepspeed_config = None  # the config travels as a dict (batch keys filled in)
    initialize = _initialize_fn(cfg.get("fp4_moe", {}))
    engine, _, _, _ = initialize(args=ds_args, model=model, model_parameters=groups,
                                 optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    return engine, model


# --------------------------------------------------------------------------- training

@dataclass
class RunResult:
    """What one recipe's run produced (rank 0's view; losses are averaged over ranks)."""
    recipe: str
    layer: str
    fp4_moe: dict
    steps: list = field(default_factory=list)    # one dict per optimizer step
    evals: list = field(default_factory=list)    # (step, held-out loss)
    summary: dict = field(default_factory=dict)


def _mean_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    tdist.all_reduce(t)
    return (t / tdist.get_world_size()).tolist()


def evaluate(engine, heldout, args, device):
    """Mean next-byte loss (nats) over the fixed held-out windows, averaged over ranks."""
    engine.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(heldout, args.seq_len, args.micro_batch, args.eval_batches,
                                 tdist.get_rank(), tdist.get_world_size()):
            lm, _ = engine(x.to(device), y.to(device))
            total, n = total + lm.item(), n + 1
    engine.train()
    return _mean_over_ranks([total / n], device)[0]


def train_step(engine, counter, train, args, step, device, probe=False):
    """One optimizer step over ``gradient_accumulation_steps`` micro batches.

    Returns:
        ``(lm_loss, aux_loss, kept_mb)``: losses averaged over micro batches (this rank);
        ``kept_mb`` is the forward's memory kept for backward when ``probe`` else None.
    """
    rank, lm_sum, aux_sum, kept = tdist.get_rank(), 0.0, 0.0, None
    gas = engine.gradient_accumulation_steps()
    for micro in range(gas):
        torch.manual_seed(_mix(args.seed, step, micro, rank))  # gate noise: per step, resumable
        x, y = train_batch(train, args.seq_len, args.micro_batch, args.seed, step, micro, rank)
        x, y = x.to(device), y.to(device)
        counter.phase = "fwd"
        if probe and micro == 0:
            (lm, aux), kept = measure_kept_for_backward(lambda: engine(x, y))
        else:
            lm, aux = engine(x, y)
        counter.phase = "bwd"
        engine.backward(lm + AUX_LOSS_COEF * aux)
        counter.phase = None
        engine.step()
        lm_sum, aux_sum = lm_sum + lm.item(), aux_sum + aux.item()
    return lm_sum / gas, aux_sum / gas, kept


def _monitor(engine, events):
    if getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
        engine.monitor.write_events(events)


def _resume(engine, args):
    """Load ``args.load`` and return the step to continue from (0 without ``--load``)."""
    if not args.load:
        return 0
    path, client = engine.load_checkpoint(args.load, tag=args.load_tag)
    if path is None:
        raise ValueError(f"--load {args.load}: no DeepSpeed checkpoint found there "
                         f"(expected a 'latest' file or --load-tag naming a folder written by --save)")
    return int(client["step"])


def _save(engine, save_dir, step, recipe):
    engine.save_checkpoint(save_dir, tag=f"step{step}", client_state={"step": step, "recipe": recipe})


def layer_name(moe):
    """The MoE layer's class, marked "(off)" for an FP4MoE whose config disables it."""
    cfg = getattr(moe, "fp4_config", None)
    return type(moe).__name__ + (" (off)" if cfg is not None and not cfg.enabled else "")


def _windows(start, steps):
    """Steps at which the memory peak is read and reset: after the first 100 and before the last 100."""
    early_end = min(start + 100, steps)
    return early_end, max(early_end, steps - 100)


def run_recipe(args, cfg, recipe, train, heldout, save_dir):
    """Train one recipe for ``args.steps`` steps; returns a RunResult (summary on every rank)."""
    from tqdm import tqdm
    acc, rank = get_accelerator(), tdist.get_rank()
    device = torch.device(acc.current_device_name() if acc.device_name() != "cpu" else "cpu")
    engine, model = build_engine(args, cfg, args.ep_size)
    start = _resume(engine, args)
    result = RunResult(recipe, layer_name(model.blocks[0].moe), cfg.get("fp4_moe", {}))
    tokens = args.micro_batch * args.seq_len * engine.gradient_accumulation_steps()
    mem, peaks, kept_mb = MemoryMeter(), {}, None
    early_end, late_start = _windows(start, args.steps)
    mem.reset()
    bar = tqdm(range(start, args.steps), desc=recipe, disable=rank != 0 or args.no_progress,
               dynamic_ncols=True, file=sys.stdout,
               mininterval=0.5 if sys.stdout.isatty() else 30)  # logs get a line per 30 s
    with AllToAllCounter() as counter:
        for step in bar:
            if step in (early_end, late_start):  # read and restart the window's peak
                p = mem.peak_mb()
                if step == early_end:
                    peaks["first100"] = p
                mem.reset()
            probe = step == min(start + 1, args.steps - 1)
            counter.begin()
            t0 = time.perf_counter()
            lm, aux, kept = train_step(engine, counter, train, args, step, device, probe)
            acc.synchronize()
            dt = time.perf_counter() - t0
            kept_mb = kept if kept is not None else kept_mb
            lm, aux = _mean_over_ranks([lm, aux], device)
            rec = {"step": step + 1, "lm_loss": lm, "aux_loss": aux, "lr": engine.get_lr()[0],
                   "step_time_s": dt, "tokens": tokens, "tokens_per_s_per_gpu": tokens / dt,
                   "probe": probe,
                   **counter.take()}
            result.steps.append(rec)
            bar.set_postfix(loss=f"{lm:.4f}", tok_s=f"{tokens / dt:,.0f}", step_ms=f"{dt * 1e3:.0f}",
                            refresh=False)
            _monitor(engine, [(f"Train/{k}", rec[k], step + 1)
                              for k in ("lm_loss", "aux_loss", "tokens_per_s_per_gpu", "step_time_s")])
            done = step + 1
            if args.eval_interval and done % args.eval_interval == 0 and done < args.steps:
                result.evals.append((done, evaluate(engine, heldout, args, device)))
                _monitor(engine, [("Eval/heldout_loss", result.evals[-1][1], done)])
            if save_dir and args.save_interval and done % args.save_interval == 0 and done < args.steps:
                _save(engine, save_dir, done, recipe)
    bar.close()
    peaks["last100"] = mem.peak_mb()
    peaks.setdefault("first100", peaks["last100"])
    result.evals.append((args.steps, evaluate(engine, heldout, args, device)))
    _monitor(engine, [("Eval/heldout_loss", result.evals[-1][1], args.steps)])
    if save_dir:
        _save(engine, save_dir, args.steps, recipe)
    if cfg.get("comms_logger", {}).get("enabled"):
        deepspeed.comm.log_summary()
    result.summary = summarize(result, args, model, mem, peaks, kept_mb)
    engine.destroy()  # frees optimizer state before a --compare run builds the next engine
    return result


def summarize(result, args, model, mem, peaks, kept_mb):
    """The numbers of the end table for one run."""
    steps = result.steps
    timed = [r["step_time_s"] for r in steps if not r["probe"]][min(5, len(steps) // 5):]
    step_s = sorted(timed)[len(timed) // 2] if timed else float("nan")
    tail = steps[-max(1, min(50, len(steps) // 10)):] if steps else []
    total, expert = count_params(model)
    world = tdist.get_world_size()
    out = {
        "recipe": result.recipe, "layer": result.layer, "world_size": world, "ep_size": args.ep_size,
        "params": total - expert + expert * args.ep_size, "expert_params": expert * args.ep_size,
        "steps": args.steps, "steps_run": len(steps),
        "train_loss": sum(r["lm_loss"] for r in tail) / len(tail) if tail else None,
        "heldout_loss": result.evals[-1][1],
        "step_time_ms": step_s * 1e3,
        "tokens_per_s_per_gpu": steps[0]["tokens"] / step_s if steps else None,
        "memory_kind": mem.kind, "peak_mem_mb": mem.overall,
        "peak_mem_first100_mb": peaks["first100"], "peak_mem_last100_mb": peaks["last100"],
        "kept_for_backward_mb": kept_mb,
    }
    last = steps[-1] if steps else {}
    out.update({f"a2a_{k}_bytes": last.get(k) for k in A2A_KINDS})
    return out


# --------------------------------------------------------------------------- reporting

def add_deviations(summaries):
    """Relative loss deviation of each run from the bf16 run (or the first), in place."""
    base = next((s for s in summaries if s["recipe"] == "bf16"), summaries[0])
    for s in summaries:
        for key in ("train_loss", "heldout_loss"):
            ok = s[key] is not None and base[key]
            s[f"{key}_rel_dev_vs_{base['recipe']}"] = (s[key] - base[key]) / base[key] if ok else None
    return base["recipe"]


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _kib(v):
    return "-" if v is None else f"{v / 1024:,.1f}"


def format_table(summaries, base):
    """The end-of-run table (markdown), one row per recipe."""
    compare = len(summaries) > 1
    head = ["recipe", "layer", "train loss", "held-out loss"]
    head += [f"vs {base} (train / held-out)"] if compare else []
    head += ["tokens/s/GPU", "step ms", "peak mem MB (first100/last100)", "kept fwd MB",
             "dispatch KiB fwd/bwd", "combine KiB fwd/bwd"]
    rows = []
    for s in summaries:
        dt, dh = s[f"train_loss_rel_dev_vs_{base}"], s[f"heldout_loss_rel_dev_vs_{base}"]
        dev = [f"{_fmt(dt and dt * 100, '+.2f')}% / {_fmt(dh and dh * 100, '+.2f')}%"] if compare else []
        rows.append([
            s["recipe"], s["layer"], _fmt(s["train_loss"], ".4f"), _fmt(s["heldout_loss"], ".4f"),
            *dev, _fmt(s["tokens_per_s_per_gpu"], ",.0f"), _fmt(s["step_time_ms"], ".1f"),
            f"{s['peak_mem_mb']:,.0f} ({s['peak_mem_first100_mb']:,.0f}/{s['peak_mem_last100_mb']:,.0f})",
            _fmt(s["kept_for_backward_mb"], ",.1f"),
            f"{_kib(s['a2a_dispatch_fwd_bytes'])} / {_kib(s['a2a_dispatch_bwd_bytes'])}",
            f"{_kib(s['a2a_combine_fwd_bytes'])} / {_kib(s['a2a_combine_bwd_bytes'])}",
        ])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    notes = (f"Per rank and optimizer step; bytes are what each rank hands to all_to_all_single, "
             f"summed over layers. Memory: {summaries[0]['memory_kind']}"
             + (" (process-wide on CPU)." if summaries[0]["memory_kind"] == "RSS" else "."))
    return "\n".join(lines) + "\n\n" + notes


def write_outputs(results, out_dir, table):
    """metrics/eval CSV per recipe, summary.json and summary.md under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for r in results:
        with open(out / f"metrics_{r.recipe}.csv", "w", newline="") as f:
            fields = list(dict.fromkeys(k for rec in r.steps for k in rec)) or ["step"]
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(r.steps)
        with open(out / f"eval_{r.recipe}.csv", "w", newline="") as f:
            csv.writer(f).writerows([("step", "heldout_loss"), *r.evals])
    runs = [{**r.summary, "fp4_moe": r.fp4_moe, "evals": r.evals} for r in results]
    (out / "summary.json").write_text(json.dumps(runs, indent=2) + "\n")
    (out / "summary.md").write_text(table + "\n")


def _smooth(values, alpha=0.05):
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def plot_compare(results, path, base):
    """PNG: loss curves, deviation from ``base``, memory and all-to-all bytes per recipe."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    ref = next(r for r in results if r.recipe == base)
    ref_curve = dict(zip([s["step"] for s in ref.steps], _smooth([s["lm_loss"] for s in ref.steps])))
    for r in results:
        steps = [s["step"] for s in r.steps]
        curve = _smooth([s["lm_loss"] for s in r.steps])
        ax[0, 0].plot(steps, curve, label=r.recipe)
        dev = [(st, 100 * (v / ref_curve[st] - 1)) for st, v in zip(steps, curve) if st in ref_curve]
        if dev:
            ax[0, 1].plot(*zip(*dev), label=r.recipe)
        ax[0, 2].plot(*zip(*r.evals), marker="o", label=r.recipe)
    ax[0, 0].set(title="train loss (EMA 0.05)", xlabel="step", ylabel="nats/byte")
    ax[0, 1].set(title=f"train loss (EMA) relative to {base}, %", xlabel="step")
    ax[0, 1].axhline(0, color="gray", lw=0.5)
    ax[0, 2].set(title="held-out loss", xlabel="step", ylabel="nats/byte")
    names, x = [r.recipe for r in results], list(range(len(results)))
    kind = results[0].summary["memory_kind"]
    for i, (key, label) in enumerate([("peak_mem_first100_mb", "first 100 steps"),
                                      ("peak_mem_last100_mb", "last 100 steps")]):
        ax[1, 0].bar([j + 0.4 * i for j in x], [r.summary[key] for r in results], 0.4, label=label)
    ax[1, 0].set(title=f"peak memory per rank, MB ({kind})", xticks=[j + 0.2 for j in x])
    ax[1, 1].bar(x, [r.summary["kept_for_backward_mb"] or 0 for r in results], 0.5)
    ax[1, 1].set(title="forward memory kept for backward, MB per rank", xticks=x)
    for i, a2a in enumerate(A2A_KINDS):
        vals = [(r.summary[f"a2a_{a2a}_bytes"] or 0) / 2**20 for r in results]
        ax[1, 2].bar([j + 0.2 * i for j in x], vals, 0.2, label=a2a)
    ax[1, 2].set(title="all-to-all MiB per rank per step", xticks=[j + 0.3 for j in x])
    for a in ax[1]:
        a.set_xticklabels(names)
    devs = [(r.recipe, r.summary[f"heldout_loss_rel_dev_vs_{base}"]) for r in results if r.recipe != base]
    devs = ", ".join(f"{name} {_fmt(d if d is None else d * 100, '+.2f')}%" for name, d in devs)
    fig.suptitle(f"final held-out loss relative to {base}: {devs}" if devs else "")
    for a in (ax[0, 0], ax[0, 1], ax[0, 2], ax[1, 0], ax[1, 2]):
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main

def _single_process_env():
    """Let ``python tools/train_moe.py`` run as one rank without a launcher."""
    if "RANK" in os.environ:
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _quiet_deepspeed():
    import logging
    from deepspeed.utils import logger
    if os.environ.get("DS_FP4_TRAIN_VERBOSE", "0") != "1":
        logger.setLevel(logging.WARNING)


def setup(args):
    """Distributed init, sizes and the base ds_config; returns the base config."""
    _single_process_env()
    _quiet_deepspeed()
    acc = get_accelerator()
    if acc.device_name() != "cpu":  # one device per local rank, before anything touches one
        acc.set_device(args.local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:  # CPU ranks would oversubscribe the cores
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    cfg = base_config(args)
    if args.micro_batch is None:
        args.micro_batch = cfg.get("train_micro_batch_size_per_gpu")
    resolve_sizes(args, get_accelerator().device_name() != "cpu")
    world = tdist.get_world_size()
    args.ep_size = args.ep_size or world
    if world % args.ep_size or args.experts % args.ep_size:
        raise ValueError(f"--ep-size {args.ep_size} must divide the world size ({world}) and "
                         f"--experts ({args.experts})")
    return cfg


def run_name(args, recipe=None):
    """A short label: the recipe name, else the ds_config file's name without .json."""
    recipe = recipe or args.recipe or args.deepspeed_config
    if not recipe:
        return "fp4"
    if recipe in RECIPE_FILES:
        return recipe
    by_file = {f: name for name, f in RECIPE_FILES.items()}  # fp4_moe.json -> fp4
    return by_file.get(Path(recipe).name, Path(recipe).stem)


def main(argv=None):
    args = build_parser().parse_args(argv)
    base_cfg = setup(args)
    rank = tdist.get_rank()
    train, heldout, desc = load_corpus(args.data)
    recipes = [r.strip() for r in args.compare.split(",")] if args.compare else [None]
    if rank == 0:
        print(f"data: {desc}\nmodel: {args.layers} layers, hidden {args.hidden}, {args.experts} "
              f"experts top-{args.top_k}, ffn {args.ffn}, seq {args.seq_len}, micro batch "
              f"{args.micro_batch}; world {tdist.get_world_size()}, ep {args.ep_size}; "
              f"runs {', '.join(run_name(args, r) for r in recipes)}", flush=True)
    results = []
    for recipe in recipes:
        cfg = finish_config(base_cfg, args)
        run_args, name = copy.copy(args), run_name(args, recipe)
        if recipe is not None:  # --compare: the same run with another fp4_moe section
            cfg["fp4_moe"] = recipe_section(recipe)
            run_args.load = args.load and str(Path(args.load) / name)
        save_dir = args.save and (str(Path(args.save) / name) if recipe else args.save)
        results.append(run_recipe(run_args, cfg, name, train, heldout, save_dir))
        get_accelerator().empty_cache()
    base = add_deviations([r.summary for r in results])
    table = format_table([r.summary for r in results], base)
    if rank == 0:
        out = args.out or ("runs/train_moe" if args.compare else None)
        if out:
            write_outputs(results, out, table)
            if args.compare:
                plot_compare(results, Path(out) / "compare.png", base)
            print(f"metrics written to {out}/")
        print("\n" + table, flush=True)
    tdist.barrier()
    return results


if __name__ == "__main__":
    main()
