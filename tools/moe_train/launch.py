"""A rank's process: environment without the deepspeed launcher, logging, its device."""

import os
from pathlib import Path

import torch
from deepspeed.accelerator import get_accelerator


def single_process_env():
    """Let ``python tools/<script>.py`` run as one rank without a launcher."""
    if "RANK" in os.environ:
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def unlink_shm_buffers(addr, port, rank="*", shm_dir="/dev/shm"):
    """Remove the shared-memory all-reduce buffers DeepSpeed's CPU ``shm_comm`` made for
    ``rank`` (``"*"``: every rank) of the process group on ``addr:port``. DeepSpeed names them
    after those three and does not unlink them at exit: each left 67 MB in RAM-backed
    ``/dev/shm`` (297 such files had filled 20 GB of a 23 GB machine). Ranks that mapped a
    buffer keep their mapping; only the name goes."""
    for path in Path(shm_dir).glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}"):
        try:
            path.unlink()
        except OSError:   # gone already
            pass


def unlink_shm_buffer(shm_dir="/dev/shm"):
    """``unlink_shm_buffers`` for this launched rank (``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``); nothing outside a launched rank."""
    addr, port, rank = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if None not in (addr, port, rank):
        unlink_shm_buffers(addr, port, rank, shm_dir)


def quiet_deepspeed():
    """DeepSpeed's logger at WARNING unless ``DS_FP4_TRAIN_VERBOSE=1``."""
    import logging
    from deepspeed.utils import logger
    if os.environ.get("DS_FP4_TRAIN_VERBOSE", "0") != "1":
        logger.setLevel(logging.WARNING)


def init_one_process(backend=None):
    """A tool's rank, launched or not (then rank 0 of 1): its environment, DeepSpeed's logs
    quiet, its device (``LOCAL_RANK``) on an accelerator, and the process group up, unless
    it already is. ``backend``: the group's; default the accelerator's (NCCL on a GPU, gloo
    without one, as the tests run)."""
    import deepspeed
    single_process_env()
    quiet_deepspeed()
    acc = get_accelerator()
    if acc.device_name() != "cpu":
        acc.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend or acc.communication_backend_name())


def local_device():
    """This rank's ``torch.device``: the accelerator's current device, or the CPU."""
    acc = get_accelerator()
    return torch.device(acc.current_device_name() if acc.device_name() != "cpu" else "cpu")
