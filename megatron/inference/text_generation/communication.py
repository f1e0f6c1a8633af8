"""Collectives of text generation: pipeline point-to-point sends, broadcasts between the first and
last pipeline stages, and broadcasts of request settings from global rank 0.

Every helper works on the current device (CPU with gloo, GPU with NCCL); sends and receives are
blocking, as the generation loop needs each stage's activations before it can go on.
"""

import torch

from megatron.core import parallel_state as mpu
from megatron.core.utils import get_current_device


def recv_from_prev_pipeline_rank_(recv_buffer=None):
    """Receive into `recv_buffer` from the previous pipeline stage (no-op on the first stage)."""
    if not mpu.is_pipeline_first_stage():
        assert recv_buffer is not None
        torch.distributed.recv(recv_buffer, src=mpu.get_pipeline_model_parallel_prev_rank())


def send_to_next_pipeline_rank(tensor=None):
    """Send `tensor` to the next pipeline stage (no-op on the last stage)."""
    if not mpu.is_pipeline_last_stage():
        assert tensor is not None
        torch.distributed.send(tensor.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())


def _is_cuda_contiguous(tensor):
    return tensor.is_contiguous() and (tensor.device.type == get_current_device().type)


def broadcast_from_last_pipeline_stage(size, dtype, tensor=None):
    """Broadcast `tensor` (given on the last stage) to every stage of the pipeline group.

    Returns the tensor on every stage (allocated with `size` and `dtype` on the others).
    """
    is_last_stage = mpu.is_pipeline_last_stage()
    # With one stage there is nothing to broadcast.
    if mpu.is_pipeline_first_stage() and is_last_stage:
        return tensor
    if is_last_stage:
        assert _is_cuda_contiguous(tensor)
    else:
        tensor = torch.empty(size, dtype=dtype, device=get_current_device())
    src = mpu.get_pipeline_model_parallel_last_rank()
    group = mpu.get_pipeline_model_parallel_group()
    torch.distributed.broadcast(tensor, src, group)
    return tensor


def broadcast_from_last_to_first_pipeline_stage(size, dtype, tensor=None):
    """Broadcast `tensor` from the last stage to the first over the embedding group.

    Returns it on the first and last stages, None on the middle ones.
    """
    is_last_stage = mpu.is_pipeline_last_stage()
    is_first_stage = mpu.is_pipeline_first_stage()
    if is_first_stage and is_last_stage:
        return tensor
    if is_last_stage or is_first_stage:
        if is_last_stage:
            assert _is_cuda_contiguous(tensor)
        else:
            tensor = torch.empty(size, dtype=dtype, device=get_current_device())
        src = mpu.get_pipeline_model_parallel_last_rank()
        group = mpu.get_embedding_group()
        torch.distributed.broadcast(tensor, src, group)
    else:
        tensor = None
    return tensor


def copy_from_last_to_first_pipeline_stage(size, dtype, tensor=None):
    """Copy `tensor` of the last stage into `tensor` of the first stage, in place (a column of
    the token matrix may be a non-contiguous view: it goes through a contiguous buffer)."""
    is_last_stage = mpu.is_pipeline_last_stage()
    is_first_stage = mpu.is_pipeline_first_stage()
    if is_first_stage and is_last_stage:
        return
    if is_last_stage or is_first_stage:
        assert tensor is not None
        is_contiguous = tensor.is_contiguous()
        src = mpu.get_pipeline_model_parallel_last_rank()
        group = mpu.get_embedding_group()
        if is_contiguous:
            tensor_ = tensor
        elif is_last_stage:
            tensor_ = tensor.contiguous()
        else:
            tensor_ = torch.empty(size, dtype=dtype, device=get_current_device())
        torch.distributed.broadcast(tensor_, src, group)
        if is_first_stage and not is_contiguous:
            tensor[...] = tensor_


def broadcast_tensor(size, dtype, tensor=None, rank=0):
    """Broadcast `tensor` from global rank `rank` to every rank of the default group (the other
    ranks allocate it with `size` and `dtype`)."""
    if torch.distributed.get_rank() == rank:
        assert _is_cuda_contiguous(tensor)
    else:
        tensor = torch.empty(size, dtype=dtype, device=get_current_device())
    torch.distributed.broadcast(tensor, rank)
    return tensor


def broadcast_list(size, dtype, list_values=None, rank=0):
    """Broadcast a list of `size` numbers of `dtype` from global rank `rank`; returns a tensor."""
    tensor = None
    if torch.distributed.get_rank() == rank:
        tensor = torch.tensor(list_values, dtype=dtype, device=get_current_device())
    return broadcast_tensor(size, dtype, tensor=tensor, rank=rank)


def broadcast_int_list(size, int_list=None, rank=0):
    """Broadcast a list of ints (as int64) from global rank `rank`."""
    return broadcast_list(size, torch.int64, list_values=int_list, rank=rank)


def broadcast_float_list(size, float_list=None, rank=0):
    """Broadcast a list of floats (as float32, so ints above 2**24 lose precision) from global
    rank `rank`."""
    return broadcast_list(size, torch.float32, list_values=float_list, rank=rank)


def broadcast_int64_list(size, int_list=None, rank=0):
    """Broadcast a list of ints exactly (int64) from global rank `rank`; returns a list."""
    return broadcast_list(size, torch.int64, list_values=int_list, rank=rank).tolist()


def broadcast_float64_list(size, float_list=None, rank=0):
    """Broadcast a list of floats exactly (float64) from global rank `rank`; returns a list."""
    return broadcast_list(size, torch.float64, list_values=float_list, rank=rank).tolist()


def failed_ranks(failed):
    """All-reduce over the default group of whether each rank failed; every rank gets the list
    of the global ranks that did (empty: all succeeded). Every rank must call it."""
    flags = torch.zeros(
        torch.distributed.get_world_size(), dtype=torch.int64, device=get_current_device()
    )
    flags[torch.distributed.get_rank()] = int(bool(failed))
    torch.distributed.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]
