"""Mistakes in a run's command line and files, caught before the first step, and runs that
must stop (a diverged loss).

Every check raises ``RunError`` with a message that names the flag, the path or value and
the fix. ``tools/train_moe.py`` prints it as ``train_moe.py: error: <message>`` and exits
with ``exit_code`` (2 for a mistake, as argparse does; 1 for a run that had to stop).
"""

import argparse
import math
import os
import re
from pathlib import Path

import torch.distributed as tdist


class RunError(ValueError):
    """A mistake in the run's arguments or files, or a run that must stop.

    Arguments:
        message: what is wrong, naming the flag and the fix.
        on_every_rank: every rank raises the same error (so rank 0 alone prints it);
            False for errors that one rank may meet alone (each failing rank prints).
    """

    exit_code = 2

    def __init__(self, message, on_every_rank=True):
        super().__init__(message)
        self.on_every_rank = on_every_rank


class Diverged(RunError):
    """The loss stayed non-finite for too many steps in a row."""

    exit_code = 1


# ---- argument types and combinations ---------------------------------------------------

def whole_number(minimum, what):
    """An argparse ``type``: an int of at least ``minimum``; ``what`` says what it counts."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be a whole number >= {minimum} ({what}); got {text!r}")
        return value
    return parse


def check_flags(args):
    """Flags that only make sense together (argparse checks each one alone)."""
    if args.load_tag and not args.load:
        raise RunError(f"--load-tag {args.load_tag} needs --load (the checkpoint folder that "
                       f"holds the tag)")
    if args.save_interval and not args.save:
        raise RunError(f"--save-interval {args.save_interval} needs --save (the folder to "
                       f"write the checkpoints to)")
    if args.run_name is not None:
        if args.compare:
            raise RunError(f"--run-name {args.run_name} labels one run; --compare runs "
                           f"several, each named after its recipe: drop one of the two")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.run_name):
            raise RunError(f"--run-name {args.run_name!r} names the run's files: use letters, "
                           f"digits, '_', '.' or '-'")
    if args.moe == "autoep" and args.capacity_factor is not None:
        raise RunError(f"--capacity-factor {args.capacity_factor} does not apply to --moe "
                       f"autoep: AutoEP's layer is dropless (every routed token reaches its "
                       f"expert); drop --capacity-factor or use --moe legacy")
    if getattr(args, "find_max_batch", False):
        for flag, value in (("--save", args.save), ("--load", args.load),
                            ("--eval-only", args.eval_only)):
            if value:
                raise RunError(f"--find-max-batch trains a fresh engine for a few steps per "
                               f"trial and keeps nothing, so {flag} does not apply; drop it")
    if getattr(args, "profile", False) and not args.out:
        raise RunError("--profile writes <out>/profile_<recipe>.txt; add --out FOLDER")
    if getattr(args, "profile", False) and args.steps < 4:
        raise RunError(f"--profile profiles the fourth step; --steps {args.steps} has none: "
                       f"pass --steps 4 or more")
    if getattr(args, "memory_breakdown", False) and not args.out:
        raise RunError("--memory-breakdown writes <out>/memory_<recipe>.json; add --out FOLDER")
    if args.eval_only and args.save:
        raise RunError(f"--eval-only trains nothing, so --save {args.save} would write the "
                       f"weights it loaded; drop --save")


def check_output_dir(flag, path):
    """``path`` is a folder, or can be made one: its nearest existing parent is a writable
    folder. Nothing is created here, so a refused run leaves no trace."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise RunError(f"{flag} {path}: this is a file, not a folder; pass a folder (it is "
                       f"created when missing)")
    existing = next(q for q in (p, *p.parents) if q.exists())
    if not existing.is_dir():
        raise RunError(f"{flag} {path}: {existing} is a file, so no folder can be made "
                       f"there; pass another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunError(f"{flag} {path}: {existing} is not writable; pass a folder you can "
                       f"write to")


# ---- every rank stops together -------------------------------------------------------

def agreed(check, *args):
    """``check(*args)`` on every rank; if it raised ``RunError`` on any rank, raise it on all.

    A rank that stops alone leaves its peers waiting in a collective until a timeout, so
    startup checks end in one all-gather: every rank then raises the first rank's message.
    """
    error = None
    try:
        result = check(*args)
    except RunError as err:
        error, result = err, None
    messages = [None] * tdist.get_world_size()
    tdist.all_gather_object(messages, None if error is None else str(error))
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        raise RunError(first) from error
    return result


# ---- a diverged run -------------------------------------------------------------------

def grad_overflow_checked(engine):
    """Whether ``engine`` skips optimizer steps whose gradients are not finite: fp16 always
    does (loss scaling); bf16 on ZeRO 1/2 only with ``check_grad_overflow`` (DeepSpeed's
    default true), which its ZeRO optimizer holds as an attribute."""
    if not engine.bfloat16_enabled():
        return True
    return getattr(engine.optimizer, "check_grad_overflow", True)


def global_grad_norm(engine):
    """The last step's global gradient norm as a float, or None when DeepSpeed computed none."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


class DivergenceGuard:
    """Stops a run whose loss is non-finite (NaN/Inf) for ``limit`` steps in a row, or whose
    gradients were not finite in a step DeepSpeed applied (``check_grad_norm``).

    The losses it sees are averaged over ranks, so every rank stops at the same step.
    Steps DeepSpeed's fp16 loss scaler skips have a finite loss and do not count.

    Arguments:
        limit: non-finite steps in a row that stop the run; 0 never stops it.
        lr: the peak learning rate (named in the message).
        skips_bad_steps: whether DeepSpeed skips a step whose gradients are not finite
            (``grad_overflow_checked``).
    """

    def __init__(self, limit, lr, skips_bad_steps=True):
        self.limit, self.lr = limit, lr
        self.skips_bad_steps = skips_bad_steps
        self.streak = []   # (step, loss) of the current run of non-finite steps

    def check_grad_norm(self, norm, step):
        """Take one step's global gradient norm (DeepSpeed's, None when not computed).

        With DeepSpeed's bf16 overflow check off (``"bf16": {"check_grad_overflow": false}``,
        the example ds_configs: it costs ~8 small GPU ops per parameter a step) a step whose
        gradients are not finite is applied, not skipped, and leaves weights that are not
        finite either. Stop at once, before a checkpoint could save them: raises
        ``Diverged``. With the check on, DeepSpeed skips such a step (norm inf) and so
        does this. A limit of 0 never stops, as for the loss."""
        if not self.limit or self.skips_bad_steps or norm is None or math.isfinite(norm):
            return
        raise Diverged(
            f"the gradients were not finite at step {step} (global norm {norm}). DeepSpeed's "
            f"bf16 overflow check is off in the ds_config (\"bf16\": {{\"check_grad_overflow\": "
            f"false}}), so the step was applied and the weights are no longer finite: the run "
            f"stops here, before saving them. Resume from the last checkpoint (--load) with a "
            f"lower --lr (now {self.lr:g}), or set check_grad_overflow to true to have "
            f"DeepSpeed skip such steps instead (slower: a check per parameter every step)")

    def check(self, record):
        """Take one step's metrics row; raises ``Diverged`` at the limit."""
        lm, aux = record["lm_loss"], record["aux_loss"]
        if math.isfinite(lm) and math.isfinite(aux):
            self.streak = []
            return
        self.streak.append((record["step"], lm if not math.isfinite(lm) else aux))
        if self.limit and len(self.streak) >= self.limit:
            (first, _), (last, _) = self.streak[0], self.streak[-1]
            values = ", ".join(f"{v}" for _, v in self.streak[:5])
            raise Diverged(
                f"the loss was not finite for {len(self.streak)} steps in a row (steps "
                f"{first} to {last}: {values}): the run diverged and stops at step {last}. "
                f"Lower --lr (now {self.lr:g}) or lengthen --warmup; --max-nonfinite-steps "
                f"sets how many such steps in a row are tolerated (0: never stop)")
