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

import contextlib
import copy
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

from moe_train import checkpoints, memory, memory_history  # noqa: E402
from moe_train.checks import (DivergenceGuard, RunError, agreed, check_flags,  # noqa: E402
                              check_output_dir, global_grad_norm, grad_overflow_checked)
from moe_train.cli import build_parser  # noqa: E402
from moe_train.data import check_lengths, load_corpus  # noqa: E402
from moe_train.engine import (build_engine, moe_layer_name, param_counts,  # noqa: E402
                              setup)
from moe_train.launch import local_device, unlink_shm_buffer  # noqa: E402
from moe_train.max_batch import check_find_max_batch, find_max_batches  # noqa: E402
from moe_train.metrics import (AllToAllCounter, MemoryMeter, RunResult,  # noqa: E402
                               mean_over_ranks, summarize, write_curves, write_outputs)
from moe_train.recipes import (base_config, finish_config, recipe_section,  # noqa: E402,F401
                               run_name)
from moe_train.report import add_deviations, format_table, plot_compare  # noqa: E402
from moe_train.steps import evaluate, train_step  # noqa: E402

# --------------------------------------------------------------------------- training

def _monitor(engine, events):
    """Hand ``[(tag, value, step)]`` to DeepSpeed's monitors (TensorBoard, CSV...) when enabled."""
    if getattr(engine, "monitor", None) is not None and engine.monitor.enabled:
        engine.monitor.write_events(events)


def _resume(engine, args):
    """Load ``args.load`` and return the step to continue from (0 without ``--load``). An
    ``--lr`` given on this command line replaces the peak LR the checkpoint brought."""
    if not args.load:
        return 0
    step = checkpoints.load(engine, args.load, args.load_tag)
    if args.lr_given:
        checkpoints.set_peak_lr(engine, args.lr)
    else:   # the run goes on at the checkpoint's peak LR: its summary must say that one
        args.lr = checkpoints.peak_lr(engine) or args.lr
    return step


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
    guard = DivergenceGuard(args.max_nonfinite_steps, args.lr, grad_overflow_checked(engine))
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
            with _history(args, result.recipe, phases, probe), \
                    _profiled(args, result.recipe, step == start + 3):
                rec, kept = _timed_step(engine, counter, train, args, step, device, probe,
                                        tokens, phases if probe else None)
            kept_mb = kept if kept is not None else kept_mb
            result.steps.append(rec)
            guard.check_grad_norm(global_grad_norm(engine), rec["step"])
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


@contextlib.contextmanager
def _profiled(args, recipe, now):
    """``--profile``: the step after the probe step (whose memory measurements would
    perturb it) under torch.profiler, host and GPU; its ops by host time and by GPU time
    written to ``<out>/profile_<recipe>.txt`` (is a step host-bound, and by which ops)."""
    if not (now and args.profile):
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        yield
    if tdist.get_rank() != 0:   # one file; the ranks run the same ops
        return
    table = prof.key_averages()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{recipe}.txt"), "w") as f:
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        if cuda:
            f.write(table.table(sort_by="self_cuda_time_total", row_limit=30,
                                max_name_column_width=70))


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

# --------------------------------------------------------------------------- main

def _runs(args):
    """``[(recipe or None, run name, run args, save folder or None)]``: the ds_config's recipe,
    or each of ``--compare`` with its own ``--load``/``--save`` subfolder."""
    recipes = [r.strip() for r in args.compare.split(",")] if args.compare else [None]
    runs = []
    for recipe in recipes:
        run_args, name = copy.copy(args), args.run_name or run_name(args, recipe)
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
    finally:
        unlink_shm_buffer()
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
