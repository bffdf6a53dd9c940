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

``--moe autoep`` trains a small Hugging Face Qwen3-MoE instead (``moe_train.hf_model``: random
weights, the same sizes and data) whose MoE blocks DeepSpeed's AutoEP replaces by its
dropless layer, turned into ``FP4AutoEPMoELayer`` by the same ``fp4_moe`` section.

``--compare bf16,fp8,fp4`` runs the recipes one after another and writes a PNG with the loss
curves and bars of memory and all-to-all bytes, plus each recipe's relative loss deviation
from bf16. Everything printed at the end is also written under ``--out``.

Mistakes are caught before the first step (``moe_train.checks``, ``moe_train.checkpoints``):
bad flags, an ``--out``/``--save`` that is a file, a ``--load`` tag that is missing or cut
short, a resumed step at or past ``--steps``, a ``--save`` that would replace a checkpoint.
They print ``train_moe.py: error: ...`` and exit with status 2; a run whose loss stays
non-finite (``--max-nonfinite-steps``) stops with status 1, its metrics written.
"""

import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

# Run by path (the deepspeed launcher runs `python -u tools/train_moe.py`): make the
# moe_train package beside this file importable whatever the working directory and however
# Python was started (e.g. -P or PYTHONSAFEPATH leave the script's folder off sys.path).
# Importing moe_train also puts the checkout on sys.path, so that `import ds_fp4` works.
TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402

from moe_train import checkpoints, hf_model, memory, memory_history  # noqa: E402
from moe_train.checks import (DivergenceGuard, RunError, agreed, check_flags,  # noqa: E402
                              check_output_dir, whole_number)
from moe_train.data import (check_lengths, eval_batches, load_corpus, mix_seed,  # noqa: E402
                            train_batch)
from moe_train.launch import local_device, quiet_deepspeed, single_process_env  # noqa: E402
from moe_train.metrics import (AllToAllCounter, MemoryMeter, RunResult,  # noqa: E402
                               measure_kept_for_backward, mean_over_ranks, summarize,
                               write_curves, write_outputs)
from moe_train.model import (ByteMoELM, count_params, gates_without_noise,  # noqa: E402
                             init_weights, layer_name)
from moe_train.recipes import (RECIPE_FILES, base_config, finish_config,  # noqa: E402
                               recipe_section, run_name)
from moe_train.report import add_deviations, format_table, plot_compare  # noqa: E402

AUX_LOSS_COEF = 0.01
# --find-max-batch: steps a trial runs (the FP8 experts' CUDA graphs are captured on the
# second and replayed from the third, so their pools count) and the largest batch tried
TRIAL_STEPS = 3
MAX_SEARCH_BATCH = 4096
CAPACITY_FACTOR = 1.25   # --moe legacy's --capacity-factor when not given
EVAL_SEED = -2   # mixed with --seed for the random numbers of an evaluation (-1: the init)

# Model and run sizes by device kind; every one can be overridden on the command line.
DEFAULTS = {
    "cpu": dict(layers=2, hidden=128, heads=4, experts=8, ffn=256, seq_len=128, micro_batch=8,
                steps=200, lr=3e-3, eval_interval=50, eval_batches=4),
    "gpu": dict(layers=8, hidden=512, heads=8, experts=8, ffn=512, seq_len=512, micro_batch=32,
                steps=2000, lr=1e-3, eval_interval=250, eval_batches=8),
}


# --------------------------------------------------------------------------- arguments

def build_parser():
    """The command line: run sizes, recipes, outputs, checkpoints and DeepSpeed's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    p.add_argument("--data", default=None,
                   help="text file or folder (all files under it); default: the stdlib sources")
    p.add_argument("--steps", type=whole_number(1, "optimizer steps"),
                   help="optimizer steps (default: 200 CPU, 2000 GPU)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int, help="model width; a multiple of 128 for FP8 wires")
    p.add_argument("--heads", type=int)
    p.add_argument("--experts", type=int, help="experts per MoE layer (total over EP ranks)")
    p.add_argument("--ffn", type=int, help="expert hidden size")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=None,
                   help=f"DeepSpeed's token capacity per expert (default {CAPACITY_FACTOR}); "
                        "--moe legacy only: AutoEP is dropless")
    p.add_argument("--moe", choices=("legacy", "autoep"), default="legacy",
                   help="legacy: DeepSpeed's deepspeed.moe.layer.MoE in a byte-level GPT; "
                        "autoep: a Hugging Face Qwen3-MoE (random weights, transformers) whose "
                        "MoE blocks DeepSpeed's AutoEP replaces (dropless, grouped experts)")
    p.add_argument("--ep-size", type=int, help="expert-parallel size (default: world size)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--micro-batch", type=int,
                   help="sequences per rank per micro step (default: the ds_config's "
                        "train_micro_batch_size_per_gpu, else 8 CPU / 32 GPU)")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int, help="warmup steps (default: steps/10, at most 200)")
    p.add_argument("--eval-interval",
                   type=whole_number(0, "steps between evaluations; 0: at the end only"))
    p.add_argument("--eval-batches", type=whole_number(1, "held-out micro batches per rank"),
                   help="held-out micro batches per rank")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the --load checkpoint (or the initial weights) on the "
                        "held-out text and train nothing")
    p.add_argument("--max-nonfinite-steps", type=whole_number(0, "0: never stop"), default=3,
                   help="stop (exit status 1) after this many steps in a row with a NaN/Inf "
                        "loss; 0: never stop")
    p.add_argument("--recipe", default=None,
                   help="replace the ds_config's fp4_moe section with a recipe's: "
                        f"{', '.join(RECIPE_FILES)} or a ds_config path")
    p.add_argument("--compare", default=None,
                   help="comma-separated recipes run one after another, e.g. bf16,fp8,fp4")
    p.add_argument("--out", default=None, help="folder for CSV/JSON metrics (and the PNG)")
    p.add_argument("--save", default=None, help="DeepSpeed checkpoint folder to write")
    p.add_argument("--save-interval",
                   type=whole_number(0, "steps between checkpoints; 0: at the end only"),
                   default=0, help="also save every N steps")
    p.add_argument("--load", default=None, help="DeepSpeed checkpoint folder to resume from")
    p.add_argument("--load-tag", default=None,
                   help="checkpoint tag in --load (e.g. step500; default: its 'latest')")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--find-max-batch", action="store_true",
                   help="train nothing: find, for each recipe (--recipe or --compare), the "
                        "largest --micro-batch that trains without running out of GPU "
                        f"memory (doubling, then bisecting; {TRIAL_STEPS} steps a trial, at "
                        f"most {MAX_SEARCH_BATCH}); one GPU")
    p.add_argument("--memory-breakdown", action="store_true",
                   help="GPU: record the allocator's history of the profiled step and write "
                        "what is live at each phase's peak, by allocating code, to "
                        "<out>/memory_<recipe>.json (needs --out)")
    p.add_argument("--max-batch-memory-gb", type=float, default=None,
                   help="with --find-max-batch: cap this process's GPU memory at this many "
                        "GB (torch.cuda.set_per_process_memory_fraction) for the search")
    deepspeed.add_config_arguments(p)
    return p


def resolve_sizes(args, on_gpu):
    """Fill every size flag left unset from the CPU or GPU defaults."""
    for key, value in DEFAULTS["gpu" if on_gpu else "cpu"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.warmup is None:
        args.warmup = min(200, max(1, args.steps // 10))
    if args.capacity_factor is None and args.moe == "legacy":
        args.capacity_factor = CAPACITY_FACTOR   # AutoEP's stays None: it drops no token
    if args.hidden % args.heads:
        raise RunError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return args


# --------------------------------------------------------------------------- setup

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


# --------------------------------------------------------------------------- training

def evaluate(engine, heldout, args, device):
    """Mean next-byte loss (nats) over the fixed held-out windows, averaged over ranks.

    A function of the weights alone: the gates route without noise and any other random
    numbers (DeepSpeed's top-1 random token selection) come from a fixed seed, so a loaded
    checkpoint evaluates to the loss its own run printed. The training RNG is left as it was.
    """
    engine.eval()
    total, n = 0.0, 0
    cuda = [device] if device.type == "cuda" else []
    with torch.no_grad(), gates_without_noise(engine.module), torch.random.fork_rng(cuda):
        torch.manual_seed(mix_seed(args.seed, EVAL_SEED))
        for x, y in eval_batches(heldout, args.seq_len, args.micro_batch, args.eval_batches,
                                 tdist.get_rank(), tdist.get_world_size()):
            lm, _ = engine(x.to(device), y.to(device))
            total, n = total + lm.item(), n + 1
    engine.train()
    return mean_over_ranks([total / n], device)[0]


def train_step(engine, counter, train, args, step, device, probe=False, phases=None):
    """One optimizer step over ``gradient_accumulation_steps`` micro batches.

    ``phases``: a ``memory.PhasePeaks`` that measures each phase's peak (the profiled
    step), or None.

    Returns:
        ``(lm_loss, aux_loss, kept_mb)``: losses averaged over micro batches (this rank);
        ``kept_mb`` is the forward's memory kept for backward when ``probe`` else None.
    """
    rank, lm_sum, aux_sum, kept = tdist.get_rank(), 0.0, 0.0, None
    gas = engine.gradient_accumulation_steps()
    phases = phases or memory.no_phases()
    for micro in range(gas):
        torch.manual_seed(mix_seed(args.seed, step, micro, rank))  # gate noise: per step, resumable
        x, y = train_batch(train, args.seq_len, args.micro_batch, args.seed, step, micro, rank)
        x, y = x.to(device), y.to(device)
        counter.phase = "fwd"
        with phases.phase("forward"):
            if probe and micro == 0:
                (lm, aux), kept = measure_kept_for_backward(lambda: engine(x, y))
            else:
                lm, aux = engine(x, y)
        counter.phase = "bwd"
        with phases.phase("backward"):
            engine.backward(lm + AUX_LOSS_COEF * aux)
        counter.phase = None
        with phases.phase("step"):
            engine.step()
        lm_sum, aux_sum = lm_sum + lm.item(), aux_sum + aux.item()
    return lm_sum / gas, aux_sum / gas, kept


def _monitor(engine, events):
    """Hand ``[(tag, value, step)]`` to DeepSpeed's monitors (TensorBoard, CSV...) when enabled."""
    if getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
        engine.monitor.write_events(events)


def _resume(engine, args):
    """Load ``args.load`` and return the step to continue from (0 without ``--load``)."""
    return checkpoints.load(engine, args.load, args.load_tag) if args.load else 0


def _windows(start, steps):
    """Steps at which the memory peak is read and reset: after the first 100 and before the last 100."""
    early_end = min(start + 100, steps)
    return early_end, max(early_end, steps - 100)


def run_recipe(args, cfg, recipe, train, heldout, save_dir):
    """Train one recipe for ``args.steps`` steps (or only evaluate, ``--eval-only``).

    Returns:
        a RunResult (summary on every rank). If anything fails on the way, the metrics of
        the steps done so far are written under ``--out`` before the error goes on.
    """
    device = local_device()
    engine, model = build_engine(args, cfg, args.ep_size)
    result = RunResult(recipe, moe_layer_name(args, model), cfg.get("fp4_moe", {}))
    try:
        start = _resume(engine, args)
        mem = MemoryMeter()
        if args.eval_only:
            peak = mem.peak_mb()
            peaks, kept_mb, last = {"first100": peak, "last100": peak}, None, start
            phases = memory.PhasePeaks(meter=mem)   # nothing measured: every phase None
        else:
            phases = memory.PhasePeaks(meter=mem)
            peaks, kept_mb = _train(engine, args, result, train, heldout, save_dir, start, mem,
                                    device, phases)
            last = args.steps
        result.layer = moe_layer_name(args, model)   # now with the experts the forward chose
        result.evals.append((last, evaluate(engine, heldout, args, device)))
        _monitor(engine, [("Eval/heldout_loss", result.evals[-1][1], last)])
        if save_dir and not args.eval_only:
            checkpoints.save(engine, save_dir, args.steps, recipe)
        if cfg.get("comms_logger", {}).get("enabled"):
            deepspeed.comm.log_summary()
            deepspeed.comm.comms_logger.reset_data()   # the next recipe's summary is its own
        result.summary = summarize(result, args, param_counts(args, model), mem, peaks, kept_mb,
                                   phases.summary())
    except BaseException:
        if args.out and tdist.get_rank() == 0:
            write_curves(result, args.out)   # the steps this run did are not lost with it
        raise
    finally:
        # optimizer state and every parameter's memory freed before a --compare run
        # builds the next engine; the objects go with this frame (memory.release())
        memory.discard(engine, model)
    return result


def _train(engine, args, result, train, heldout, save_dir, start, mem, device, phases):
    """Steps ``start`` to ``args.steps``, each recorded in ``result.steps``; the probe step
    also measures the peak of each of its phases into ``phases``.

    Returns:
        ``(peaks, kept_mb)``: ``{"first100", "last100"}`` peak memory in MB and the
        forward's memory kept for backward (MB) measured on the probe step.
    """
    from tqdm import tqdm
    tokens = args.micro_batch * args.seq_len * engine.gradient_accumulation_steps()
    peaks, kept_mb = {}, None
    early_end, late_start = _windows(start, args.steps)
    guard = DivergenceGuard(args.max_nonfinite_steps, args.lr)
    mem.reset()
    bar = tqdm(range(start, args.steps), desc=result.recipe,
               disable=tdist.get_rank() != 0 or args.no_progress, dynamic_ncols=True,
               file=sys.stdout, mininterval=0.5 if sys.stdout.isatty() else 30)  # logs: a line per 30 s
    with AllToAllCounter() as counter:
        for step in bar:
            if step in (early_end, late_start):  # read and restart the window's peak
                p = mem.peak_mb()
                if step == early_end:
                    peaks["first100"] = p
                mem.reset()
            # the third step: the first runs everything eagerly and the second captures the
            # experts' CUDA graphs (expert_graphs), whose buffers are not kept activations
            probe = step == min(start + 2, args.steps - 1)
            with _history(args, result.recipe, phases, probe):
                rec, kept = _timed_step(engine, counter, train, args, step, device, probe,
                                        tokens, phases if probe else None)
            kept_mb = kept if kept is not None else kept_mb
            result.steps.append(rec)
            guard.check(rec)
            bar.set_postfix(loss=f"{rec['lm_loss']:.4f}", tok_s=f"{rec['tokens_per_s_per_gpu']:,.0f}",
                            step_ms=f"{rec['step_time_s'] * 1e3:.0f}", refresh=False)
            _monitor(engine, [(f"Train/{k}", rec[k], step + 1)
                              for k in ("lm_loss", "aux_loss", "tokens_per_s_per_gpu", "step_time_s")])
            _eval_and_save(engine, result, args, heldout, save_dir, step + 1, device)
    bar.close()
    peaks["last100"] = mem.peak_mb()
    peaks.setdefault("first100", peaks["last100"])
    return peaks, kept_mb


def _history(args, recipe, phases, probe):
    """``--memory-breakdown``: the probe step's allocation history, replayed into
    ``<out>/memory_<recipe>.json`` (what is live at each phase's peak, by allocating code)."""
    if not (probe and args.memory_breakdown):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def recording():
        with memory_history.recorded(os.path.join(args.out, f"memory_{recipe}.json")) as mark:
            phases.marker = mark
            try:
                yield
            finally:
                phases.marker = None
    return recording()


def _timed_step(engine, counter, train, args, step, device, probe, tokens, phases=None):
    """``train_step`` timed and its all-to-alls counted.

    Returns:
        ``(record, kept_mb)``: the step's row of the metrics CSV (losses averaged over
        ranks) and ``train_step``'s ``kept_mb``.
    """
    counter.begin()
    t0 = time.perf_counter()
    lm, aux, kept = train_step(engine, counter, train, args, step, device, probe, phases)
    get_accelerator().synchronize()
    dt = time.perf_counter() - t0
    lm, aux = mean_over_ranks([lm, aux], device)
    rec = {"step": step + 1, "lm_loss": lm, "aux_loss": aux, "lr": engine.get_lr()[0],
           "step_time_s": dt, "tokens": tokens, "tokens_per_s_per_gpu": tokens / dt,
           "probe": probe,
           **counter.take()}
    return rec, kept


def _eval_and_save(engine, result, args, heldout, save_dir, done, device):
    """The held-out evaluation and checkpoint due after ``done`` steps (the last step's come later)."""
    if args.eval_interval and done % args.eval_interval == 0 and done < args.steps:
        result.evals.append((done, evaluate(engine, heldout, args, device)))
        _monitor(engine, [("Eval/heldout_loss", result.evals[-1][1], done)])
        if args.out and tdist.get_rank() == 0:
            write_curves(result, args.out)
    if save_dir and args.save_interval and done % args.save_interval == 0 and done < args.steps:
        checkpoints.save(engine, save_dir, done, result.recipe)

# --------------------------------------------------------------------------- --find-max-batch

def check_find_max_batch(args, world):
    """``--find-max-batch`` needs one GPU; ``--max-batch-memory-gb`` needs the search and
    must fit the GPU. Returns the memory fraction to cap at (None: the whole GPU)."""
    if args.max_batch_memory_gb is not None and not args.find_max_batch:
        raise RunError(f"--max-batch-memory-gb {args.max_batch_memory_gb:g} caps memory for "
                       f"--find-max-batch only; add --find-max-batch or drop it")
    if not args.find_max_batch:
        return None
    if get_accelerator().device_name() == "cpu":
        raise RunError("--find-max-batch needs a GPU: on CPU a batch too large does not fail "
                       "with an out-of-memory error, the machine swaps or the kernel kills "
                       "the process. Run it on a GPU (--max-batch-memory-gb caps the memory "
                       "searched there)")
    if world != 1:
        raise RunError(f"--find-max-batch runs on one GPU (this run has {world} ranks): a rank "
                       f"that runs out of memory alone would leave the others waiting in an "
                       f"all-to-all. Launch it with --num_gpus 1")
    if args.max_batch_memory_gb is None:
        return None
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = args.max_batch_memory_gb * 2**30 / total
    if not 0 < fraction <= 1:
        raise RunError(f"--max-batch-memory-gb {args.max_batch_memory_gb:g}: this GPU has "
                       f"{total / 2**30:.1f} GB; pass a value above 0 and at most that")
    return fraction


def _trial(args, cfg, train, batch, peaks):
    """Build a fresh engine with micro batch ``batch`` and train ``TRIAL_STEPS`` steps;
    records the peak allocated MB in ``peaks[batch]``. Raises what the run raised."""
    run_args = copy.copy(args)
    run_args.micro_batch = batch
    cfg = finish_config(cfg, run_args)
    engine, model = build_engine(run_args, cfg, args.ep_size)
    try:
        counter = argparse.Namespace(phase=None)   # no all-to-all is counted
        for step in range(TRIAL_STEPS):
            train_step(engine, counter, train, run_args, step, local_device())
        get_accelerator().synchronize()
        peaks[batch] = get_accelerator().max_memory_allocated() / 2**20
    finally:
        memory.discard(engine, model)


def find_max_batches(args, base_cfg, runs, train, fraction):
    """The largest micro batch of each recipe (``--find-max-batch``): printed as a table,
    with each recipe's ratio to bf16, and written to ``--out``/max_batch.json.

    Returns:
        ``[{"recipe", "max_micro_batch", "at_limit", "peak_mem_mb", "trials"}]``.
    """
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction)
    found = []
    for recipe, name, _, _ in runs:
        cfg = copy.deepcopy(base_cfg)
        if recipe is not None:
            cfg["fp4_moe"] = recipe_section(recipe)
        peaks = {}
        fits = memory.fits_without_oom(lambda b: _trial(args, cfg, train, b, peaks),
                                       memory.release)
        memory.release()
        batch, trials = memory.largest_fitting(fits, MAX_SEARCH_BATCH)
        found.append({"recipe": name, "max_micro_batch": batch,
                      "at_limit": batch == MAX_SEARCH_BATCH, "peak_mem_mb": peaks.get(batch),
                      "trials": trials})
        print(f"{name}: largest micro batch {batch} ({len(trials)} trials)", flush=True)
    table = memory.max_batch_table(found, args, fraction)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "max_batch.json").write_text(json.dumps(found, indent=2) + "\n")
        (out / "max_batch.md").write_text(table + "\n")
    print("\n" + table, flush=True)
    return found


# --------------------------------------------------------------------------- main

def _runs(args):
    """``[(recipe or None, run name, run args, save folder or None)]``: the ds_config's recipe,
    or each of ``--compare`` with its own ``--load``/``--save`` subfolder."""
    recipes = [r.strip() for r in args.compare.split(",")] if args.compare else [None]
    runs = []
    for recipe in recipes:
        run_args, name = copy.copy(args), run_name(args, recipe)
        if recipe is not None:
            run_args.load = args.load and str(Path(args.load) / name)
        save_dir = args.save and (str(Path(args.save) / name) if recipe else args.save)
        runs.append((recipe, name, run_args, save_dir))
    return runs


def preflight(args, runs):
    """Every path of the run, checked before the first step (``RunError`` names the fix).

    Resolves each run's ``--load`` tag (``run_args.load_tag``): what is checked here is
    what is loaded.
    """
    if args.out:
        check_output_dir("--out", args.out)
    for _, _, run_args, save_dir in runs:
        start = 0
        if run_args.load:
            run_args.load_tag, start = checkpoints.check_load(run_args.load, run_args.load_tag)
            if start >= args.steps and not args.eval_only:
                raise RunError(
                    f"--load {run_args.load}: its checkpoint {run_args.load_tag} is at step "
                    f"{start}, at or past --steps {args.steps}, so there is nothing to train. "
                    f"Pass --steps above {start} to train on, or --eval-only to evaluate it")
        if save_dir:
            check_output_dir("--save", save_dir)
            checkpoints.check_save(save_dir, start, args.steps, args.save_interval)


def main(argv=None):
    """Run the recipe of the ds_config (or each of ``--compare``); returns their RunResults
    (with ``--find-max-batch``: ``find_max_batches``' list).

    Raises:
        RunError (``moe_train.checks``) for a mistake found before the first step or a run
        that diverged; ``cli`` prints it.
    """
    args = build_parser().parse_args(argv)
    check_flags(args)
    base_cfg = setup(args)
    fraction = check_find_max_batch(args, tdist.get_world_size())
    if args.memory_breakdown and get_accelerator().device_name() == "cpu":
        raise RunError("--memory-breakdown reads the GPU allocator's history; on CPU there "
                       "is none. Run it on a GPU, or drop the flag")
    rank = tdist.get_rank()
    if args.compare and not args.out:
        args.out = "runs/train_moe"
    runs = _runs(args)
    agreed(preflight, args, runs)
    train, heldout, desc = agreed(load_corpus, args.data)
    check_lengths(train, heldout, args.seq_len, args.data)
    if rank == 0:
        print(f"data: {desc}\nmodel: {args.layers} layers, hidden {args.hidden}, {args.experts} "
              f"experts top-{args.top_k}, ffn {args.ffn}, seq {args.seq_len}, micro batch "
              f"{args.micro_batch}; world {tdist.get_world_size()}, ep {args.ep_size}; "
              f"runs {', '.join(name for _, name, _, _ in runs)}", flush=True)
    if args.find_max_batch:
        return find_max_batches(args, base_cfg, runs, train, fraction)
    results = []
    memory.release()   # each recipe's peak counts from its own start
    for recipe, name, run_args, save_dir in runs:
        cfg = finish_config(base_cfg, args)
        if recipe is not None:  # --compare: the same run with another fp4_moe section
            cfg["fp4_moe"] = recipe_section(recipe)
        results.append(run_recipe(run_args, cfg, name, train, heldout, save_dir))
        if args.out and rank == 0:
            write_curves(results[-1], args.out)   # a later recipe's failure keeps this one's
        memory.release()   # the next recipe starts from what this one freed
    _report(args, results)
    tdist.barrier()
    return results


def _report(args, results):
    """The end-of-run table (printed by rank 0) and the files under ``--out``."""
    base = add_deviations([r.summary for r in results])
    table = format_table([r.summary for r in results], base)
    if tdist.get_rank() != 0:
        return
    if args.out:
        write_outputs(results, args.out, table)
        if args.compare:
            plot_compare(results, Path(args.out) / "compare.png", base)
        print(f"metrics written to {args.out}/")
    if args.eval_only:
        for r in results:
            step, loss = r.evals[-1]
            print(f"{r.recipe}: held-out loss {loss:.6f} at step {step}")
    print("\n" + table, flush=True)


def _rank():
    return tdist.get_rank() if tdist.is_initialized() else int(os.environ.get("RANK", 0))


def cli(argv=None):
    """``main`` for the command line: a ``RunError`` is printed as ``train_moe.py: error:
    <message>`` (by rank 0 alone when every rank raised it) and gives its exit status."""
    try:
        main(argv)
    except RunError as err:
        if not err.on_every_rank or _rank() == 0:
            print(f"train_moe.py: error: {err}", file=sys.stderr, flush=True)
        _leave_process_group()
        return err.exit_code
    return 0


def _leave_process_group():
    """Tear the process group down before exiting with an error status: left to the
    interpreter's exit, gloo's threads can abort the process ("terminate called without an
    active exception", status -6), and the launcher then reports that instead."""
    if tdist.is_available() and tdist.is_initialized():
        try:
            tdist.destroy_process_group()
        except Exception:  # exiting anyway; the status that matters is the caller's
            pass


# ---- fp4_moe.monitor_exactness: exactness counts as DeepSpeed monitor events -----------
# Self-contained: wraps _monitor (looked up when called) instead of editing the loop.

EXACTNESS_TAGS = {"inexact_groups": "Train/fp4_inexact_groups",
                  "nan_groups": "Train/fp4_nan_groups", "groups": "Train/fp4_converted_groups"}


def _with_exactness(write):
    """``_monitor`` plus, where FP4MoE layers count (``fp4_moe.monitor_exactness``), the
    groups their MXFP4 -> FP8 conversions converted outside the exactness bound, NaN and in
    all since the previous event, summed over layers and ranks, with each step's Train/
    events. Every write resets the counts, so an Eval/ write drops what evaluation converted.
    Costs one sync and one small all-reduce per step, only with the key on."""
    def monitor(engine, events):
        if getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
            events = list(events) + _exactness_events(engine, events)
        write(engine, events)
    return monitor


def _exactness_events(engine, events):
    try:
        from ds_fp4.moe import exactness_stats
    except ImportError:
        return []
    stats = exactness_stats(engine.module, reset=True)   # the same layers on every rank
    steps = [step for tag, _, step in events if tag.startswith("Train/")]
    if not stats or not steps:
        return []
    from moe_train.launch import local_device
    from moe_train.metrics import mean_over_ranks
    sums = [sum(layer[key] for layer in stats.values()) for key in EXACTNESS_TAGS]
    world = tdist.get_world_size()
    totals = [round(v * world) for v in mean_over_ranks(sums, local_device())]
    return [(tag, total, steps[0]) for tag, total in zip(EXACTNESS_TAGS.values(), totals)]


_monitor = _with_exactness(_monitor)


if __name__ == "__main__":
    sys.exit(cli())
