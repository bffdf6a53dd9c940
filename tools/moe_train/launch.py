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


def unlink_shm_buffer(shm_dir="/dev/shm"):
    """Remove this rank's shared-memory all-reduce buffer: DeepSpeed's CPU ``shm_comm``
    names it after the master address, port and rank and does not unlink it at exit, so each
    CPU run left 67 MB per rank in RAM-backed ``/dev/shm`` (297 such files had filled 20 GB of
    a 23 GB machine). The other ranks keep their mappings; only the name goes."""
    addr, port, rank = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if None in (addr, port, rank):
        return
    for path in Path(shm_dir).glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}"):
        try:
            path.unlink()
        except OSError:   # gone already
            pass


def quiet_deepspeed():
    """DeepSpeed's logger at WARNING unless ``DS_FP4_TRAIN_VERBOSE=1``."""
    import logging
    from deepspeed.utils import logger
    if os.environ.get("DS_FP4_TRAIN_VERBOSE", "0") != "1":
        logger.setLevel(logging.WARNING)


def local_device():
    """This rank's ``torch.device``: the accelerator's current device, or the CPU."""
    acc = get_accelerator()
    return torch.device(acc.current_device_name() if acc.device_name() != "cpu" else "cpu")
