"""One optimizer step of the main job, and the held-out evaluation."""

import torch
import torch.distributed as tdist

from . import memory
from .data import eval_batches, mix_seed, train_batch
from .metrics import measure_kept_for_backward, mean_over_ranks
from .model import gates_without_noise

AUX_LOSS_COEF = 0.01
EVAL_SEED = -2   # mixed with --seed for the random numbers of an evaluation (-1: the init)


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
