"""The run's wall clock for --exit-duration-in-mins, shared by the training loop and evaluation.

The start time is taken when this module is first imported (with megatron.training.training) and
replaced by pretrain() with the earliest start over all ranks; `_exit_flag` makes every rank take
the same exit decision.
"""

import time

import torch

from megatron.core.utils import get_current_device

_TRAIN_START_TIME = time.time()


def get_train_start_time() -> float:
    """Start of the run (seconds since the epoch) that --exit-duration-in-mins counts from."""
    return _TRAIN_START_TIME


def set_train_start_time(value: float) -> None:
    """Replace the start time (pretrain(): the earliest start over all ranks)."""
    global _TRAIN_START_TIME
    _TRAIN_START_TIME = value


def _exit_flag(value):
    """All-reduce a local bool so every rank takes the same exit decision."""
    flag = torch.tensor([int(value)], dtype=torch.int, device=get_current_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
