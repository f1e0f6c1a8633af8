"""Catch a signal (SIGTERM by default) and let every rank learn that some rank received it.

`--exit-signal-handler` installs one `DistributedSignalHandler` for the whole run
(`global_vars.get_signal_handler()`). The handler itself only records the signal; the training loop
polls `signals_received()` once per iteration. That call all-gathers the per-rank flag, so all
ranks see the same list and agree to save a checkpoint and leave at the same iteration, even when
the scheduler (SLURM, torchrun, a user's `kill`) delivered the signal to only some of them.
"""

import signal
from typing import List, Optional

import torch

from megatron.core.utils import uses_cuda


def get_world_size() -> int:
    """World size of the default process group, or 1 when torch.distributed is not initialized."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def get_device(local_rank: Optional[int] = None) -> torch.device:
    """The device a collective on the default group needs (the rule of `uses_cuda`)."""
    if not uses_cuda():
        return torch.device("cpu")
    if local_rank is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", local_rank)


def all_gather_item(
    item, dtype: torch.dtype, group=None, async_op: bool = False, local_rank=None
) -> List:
    """All-gather one Python scalar from every rank of `group` (default: the world).

    Args:
        item: a bool / int / float scalar.
        dtype: tensor dtype used for the exchange.
        group: process group; None means the default (world) group.
        async_op: must be False; kept for Megatron signature parity.
        local_rank: CUDA device index to use with NCCL; None means the current device.

    Returns:
        List with one Python scalar per rank of the group, in group-rank order. Without an
        initialized process group, `[item]`.
    """
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [item]
    assert not async_op, "all_gather_item needs the gathered values now; async_op is not supported"
    device = get_device(local_rank)
    group_size = group.size() if group is not None else get_world_size()
    tensor = torch.tensor([item], device=device, dtype=dtype)
    output_tensors = [
        torch.zeros(1, dtype=tensor.dtype, device=tensor.device) for _ in range(group_size)
    ]
    torch.distributed.all_gather(output_tensors, tensor, group)
    return [elem.item() for elem in output_tensors]


class DistributedSignalHandler:
    """Context manager that records the arrival of `sig` instead of letting it kill the process.

    Usage::

        with DistributedSignalHandler(signal.SIGTERM) as handler:
            for iteration in ...:
                train_step(...)
                if any(handler.signals_received()):   # a collective: every rank must call it
                    save_checkpoint(...)
                    break

    `global_vars` enters one handler for the whole run (`DistributedSignalHandler().__enter__()`)
    when `--exit-signal-handler` is given and releases nothing: the process exits after saving.

    Args:
        sig: the signal to intercept (default SIGTERM, what SLURM and torchrun send first).
    """

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self._signal_received = False
        self.released = True
        self.original_handler = None

    def signals_received(self) -> List[int]:
        """Whether each rank has received the signal (one int 0/1 per rank; a collective call)."""
        return all_gather_item(int(self._signal_received), dtype=torch.int32)

    def __enter__(self) -> "DistributedSignalHandler":
        self._signal_received = False
        self.released = False
        self.original_handler = signal.getsignal(self.sig)

        def handler(signum, frame):
            # Only set a flag: the training loop saves at the next iteration boundary, where
            # every rank is outside collectives and the model/optimizer state is consistent.
            self._signal_received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, exc_type, exc_value, tb):
        self.release()

    def release(self) -> bool:
        """Restore the signal's previous handler. Returns False if it was already released."""
        if self.released:
            return False
        signal.signal(self.sig, self.original_handler)
        self.released = True
        return True
