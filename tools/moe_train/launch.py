"""A rank's process: environment without the deepspeed launcher, logging, its device."""

import os

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
