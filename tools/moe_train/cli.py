"""The main job's command line (``tools/train_moe.py``): its flags and the sizes by device kind."""

import argparse
import os

import deepspeed

from .checks import RunError, whole_number
from .recipes import RECIPE_FILES

CAPACITY_FACTOR = 1.25   # --moe legacy's --capacity-factor when not given
# --find-max-batch (moe_train.max_batch): steps a trial runs (the FP8 experts' CUDA graphs,
# when on, are captured on the second and replayed from the third, so their pools count)
# and the largest batch tried
TRIAL_STEPS = 3
MAX_SEARCH_BATCH = 4096

# Model and run sizes by device kind; every one can be overridden on the command line.
DEFAULTS = {
    "cpu": dict(layers=2, hidden=128, heads=4, experts=8, ffn=256, seq_len=128, micro_batch=8,
                steps=200, lr=3e-3, eval_interval=50, eval_batches=4),
    "gpu": dict(layers=8, hidden=512, heads=8, experts=8, ffn=512, seq_len=512, micro_batch=32,
                steps=2000, lr=1e-3, eval_interval=250, eval_batches=8),
}


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
    p.add_argument("--schedule-steps", type=whole_number(1, "steps of the LR schedule"),
                   help="the LR schedule's length in steps (default: --steps). A branch of a "
                        "longer run resumes from its checkpoint (--load), passes that run's "
                        "--steps here and stops at its own --steps, on the same schedule")
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
    p.add_argument("--lr", type=float,
                   help="peak learning rate (default 3e-3 CPU, 1e-3 GPU); given with --load, "
                        "it replaces the checkpoint's from the next step on")
    p.add_argument("--warmup", type=int, help="warmup steps (default: the schedule's steps/10, at most 200)")
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
    p.add_argument("--run-name", default=None,
                   help="the run's label in its summary and tables (default: the recipe's); "
                        "e.g. a bf16 twin with another --lr, measured against bf16")
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
    p.add_argument("--profile", action="store_true",
                   help="profile the fourth step (torch.profiler, host and GPU) and write its "
                        "ops by host and by GPU time to <out>/profile_<recipe>.txt (needs --out)")
    p.add_argument("--max-batch-memory-gb", type=float, default=None,
                   help="with --find-max-batch: cap this process's GPU memory at this many "
                        "GB (torch.cuda.set_per_process_memory_fraction) for the search")
    deepspeed.add_config_arguments(p)
    return p


def resolve_sizes(args, on_gpu):
    """Fill every size and schedule flag left unset from the CPU or GPU defaults (and note
    whether ``--lr`` was given: with ``--load`` it then replaces the checkpoint's)."""
    args.lr_given = args.lr is not None   # before the default fills it
    for key, value in DEFAULTS["gpu" if on_gpu else "cpu"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.schedule_steps = args.schedule_steps or args.steps
    if args.schedule_steps < args.steps:
        raise RunError(f"--schedule-steps {args.schedule_steps} ends the LR schedule before "
                       f"--steps {args.steps}; pass --schedule-steps >= --steps, or drop it")
    if args.warmup is None:
        args.warmup = min(200, max(1, args.schedule_steps // 10))
    if args.capacity_factor is None and args.moe == "legacy":
        args.capacity_factor = CAPACITY_FACTOR   # AutoEP's stays None: it drops no token
    if args.hidden % args.heads:
        raise RunError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return args
