"""``--find-max-batch``: the largest micro batch of each recipe that fits one GPU (issue 14).

Each trial builds a fresh engine and trains ``TRIAL_STEPS`` steps; ``memory`` holds the
search (doubling, then bisecting) and the release between trials."""

import argparse
import copy
import json
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator

from . import memory
from .checks import RunError
from .cli import MAX_SEARCH_BATCH, TRIAL_STEPS
from .engine import build_engine
from .launch import local_device
from .recipes import finish_config, recipe_section
from .steps import train_step



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
