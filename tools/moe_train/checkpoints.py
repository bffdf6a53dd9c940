"""Checkpoints of the main job: DeepSpeed's own, tagged ``step<N>``, checked before use.

Nothing a user saved is lost: before the first step, ``--load`` must name a tag (``--load-tag``
or the folder's ``latest``) whose files are complete, and ``--save`` must not hold a
checkpoint the run would replace (a tag it is going to write, or a ``latest`` later than its
last step). Failures while DeepSpeed loads a checkpoint name the folder and the tag.
"""

import re
import zipfile
from pathlib import Path

import torch

from .checks import RunError

LATEST = "latest"   # DeepSpeed's file naming the newest tag of a folder


def tag_of(step):
    """The tag of the checkpoint written after ``step`` steps."""
    return f"step{step}"


def step_of(tag):
    """The step of a ``step<N>`` tag, or None for a tag of another form."""
    match = re.fullmatch(r"step(\d+)", tag or "")
    return int(match.group(1)) if match else None


def latest_tag(folder):
    """The tag that ``folder/latest`` names, or None without that file."""
    path = Path(folder) / LATEST
    return path.read_text().strip() if path.is_file() else None


def _tags(folder):
    """The checkpoint folders under ``folder``, oldest step first, as a phrase."""
    tags = sorted((p.name for p in Path(folder).iterdir() if p.is_dir()),
                  key=lambda t: (step_of(t) is None, step_of(t) or 0, t))
    return f"the tags there: {', '.join(tags)}" if tags else "it holds no checkpoint"


def _model_states(tag_dir):
    """The file of the non-expert weights and the client state in a tag folder, or None."""
    files = [f for f in sorted(Path(tag_dir).glob("*model_states.pt"))
             if not f.name.startswith("layer_")]   # layer_<l>_expert_<e>_...: expert shards
    return files[0] if files else None


def _check_complete(tag_dir, where):
    """Every ``.pt`` file of the tag is a whole torch zip archive: a file cut short (a run
    stopped while saving, a full disk) has lost the archive's directory at its end, which
    ``torch.load`` reports as a bare OSError on one rank only."""
    for f in sorted(Path(tag_dir).glob("*.pt")):
        try:
            zipfile.ZipFile(f).close()
        except (zipfile.BadZipFile, OSError) as err:
            raise RunError(f"{where}: {f} is not a complete checkpoint file ({err}; cut "
                           f"short by a run that stopped while saving?); load another tag "
                           f"with --load-tag, or save this one again") from None


def check_load(folder, tag=None):
    """The checkpoint ``--load folder [--load-tag tag]`` resumes from, checked.

    Returns:
        ``(tag, step)``: the tag (``latest``'s when ``tag`` is None) and the step saved in
        its client state.
    Raises:
        RunError naming the folder, the tag and the fix.
    """
    root = Path(folder)
    if not root.is_dir():
        raise RunError(f"--load {folder}: no such folder; pass the --save folder of an "
                       f"earlier run")
    if tag is None:
        tag = latest_tag(root)
        if tag is None:
            raise RunError(f"--load {folder}: no '{LATEST}' file there, so no tag to resume "
                           f"from; pass --load-tag ({_tags(root)})")
        named = f"its '{LATEST}' file names {tag!r}"
    else:
        named = f"--load-tag {tag}"
    where = f"--load {folder} ({named})"
    if not (root / tag).is_dir():
        raise RunError(f"{where}: {root / tag} does not exist; {_tags(root)}")
    states = _model_states(root / tag)
    if states is None:
        raise RunError(f"{where}: {root / tag} holds no *model_states.pt file; it is not a "
                       f"DeepSpeed checkpoint ({_tags(root)})")
    _check_complete(root / tag, where)
    client = torch.load(states, map_location="cpu", mmap=True, weights_only=False)
    if "step" not in client:
        raise RunError(f"{where}: {states} has no 'step' in its client state; it was not "
                       f"written by tools/train_moe.py --save")
    return tag, int(client["step"])


def tags_written(start, steps, interval):
    """The tags a run from ``start`` to ``steps`` saves every ``interval`` steps and at the end."""
    every = range(start + 1, steps + 1) if interval else ()
    return [tag_of(s) for s in every if s % interval == 0 and s < steps] + [tag_of(steps)]


def check_save(folder, start, steps, interval):
    """Refuse a ``--save folder`` that this run would make lose a checkpoint.

    Raises:
        RunError when a tag the run writes exists already there, or when the folder's
        ``latest`` names a later step than the run's last (it would move ``latest`` back).
    """
    root = Path(folder)
    if not root.is_dir():
        return
    taken = [t for t in tags_written(start, steps, interval) if (root / t).exists()]
    if taken:
        raise RunError(
            f"--save {folder}: {', '.join(taken)} already exist{'s' if len(taken) == 1 else ''} "
            f"there and this run would overwrite {'it' if len(taken) == 1 else 'them'} with "
            f"other weights. Resume that run with --load {folder} and a larger --steps, save "
            f"to another folder, or delete {root / taken[0]} first")
    latest = latest_tag(root)
    if step_of(latest) is not None and step_of(latest) > steps:
        raise RunError(
            f"--save {folder}: its '{LATEST}' is {latest}, later than this run's last step "
            f"{steps}, and saving would move '{LATEST}' back to {tag_of(steps)}. Save to "
            f"another folder, or continue that run with --load {folder} --steps above "
            f"{step_of(latest)}")


def load(engine, folder, tag):
    """``engine.load_checkpoint(folder, tag)``; returns the saved step.

    Raises:
        RunError naming the folder and tag for any failure inside DeepSpeed (files the
        checks above cannot see into, or a model of other sizes than the one saved).
    """
    try:
        path, client = engine.load_checkpoint(folder, tag=tag)
    except Exception as err:   # DeepSpeed's own errors name neither the folder nor the tag
        raise RunError(
            f"--load {folder}: loading tag {tag} failed: {type(err).__name__}: "
            f"{str(err).rstrip('.')}. Its "
            f"files may be damaged, or this run's model sizes (--layers, --hidden, --heads, "
            f"--experts, --ffn, --ep-size, ranks) differ from those of the run that saved it",
            on_every_rank=False) from err
    if path is None:
        raise RunError(f"--load {folder}: DeepSpeed found no checkpoint tagged {tag} there",
                       on_every_rank=False)
    return int(client["step"])


def _own_schedule(engine):
    """The main job's own ``LambdaLR``, or None for a ds_config ``scheduler`` section, whose
    settings are its own (with ``--load`` as without)."""
    sched = engine.lr_scheduler
    return sched if isinstance(sched, torch.optim.lr_scheduler.LambdaLR) else None


def peak_lr(engine):
    """The peak LR of the loaded schedule (the checkpoint's, unless ``set_peak_lr`` replaced
    it); None for a ds_config ``scheduler`` section."""
    sched = _own_schedule(engine)
    return sched.base_lrs[0] if sched is not None else None


def set_peak_lr(engine, lr):
    """Make ``lr`` the peak LR of the loaded schedule: the scheduler's state came with the
    checkpoint's (``base_lrs``), which would silently win over the command line's. The next
    steps run at ``lr`` times the schedule. Only the main job's own schedule."""
    sched = _own_schedule(engine)
    if sched is None:
        return
    sched.base_lrs = [lr] * len(sched.base_lrs)
    for group, factor in zip(sched.optimizer.param_groups, sched.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(sched.last_epoch)   # the rate of the next step
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]


def save(engine, folder, step, recipe):
    """A DeepSpeed checkpoint tagged ``step<N>`` whose client state lets ``--load`` resume."""
    engine.save_checkpoint(folder, tag=tag_of(step), client_state={"step": step, "recipe": recipe})
