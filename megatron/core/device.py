"""The one device policy of the package: where compute and tensors go.

A leaf module (it imports nothing from megatron), so that parallel_state, the straggler detector
and utils can all use it without importing each other. `megatron.core.utils` re-exports these
names, where Megatron's code finds them.
"""

from typing import Optional

import torch


def uses_cuda(backend: Optional[str] = None) -> bool:
    """The one device rule of the package: compute runs on CUDA iff a CUDA device exists and the
    torch.distributed backend is not gloo.

    gloo means CPU everywhere, also on a host that has GPUs: model, activations, collectives,
    timers, RNG and memory reports all stay on the CPU, so a gloo run on a GPU host behaves like
    one on a CPU host (gloo cannot run every collective on CUDA tensors). NCCL (or no process
    group at all) on a CUDA host means the current CUDA device.

    Args:
        backend: the backend to decide for (e.g. `--distributed-backend` before the process
            group exists). None: the default process group's backend, or none when
            torch.distributed is not initialized.
    """
    if not torch.cuda.is_available():
        return False
    if backend is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        backend = torch.distributed.get_backend()
    return backend != "gloo"


def get_current_device() -> torch.device:
    """The device tensors are created on, by the rule of `uses_cuda`: the current CUDA device,
    or the CPU."""
    if uses_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_current_device_type() -> str:
    """'cuda' or 'cpu', matching `get_current_device()`."""
    return get_current_device().type
