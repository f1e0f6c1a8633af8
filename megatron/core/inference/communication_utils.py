"""Collectives of inference, on explicit process groups (None = the global groups of
parallel_state).

- Pipeline stages hand activations on with blocking point-to-point sends / receives (each stage
  needs the previous one's output before it can run).
- What the last stage sampled is broadcast to every stage (and, first, from tensor-parallel rank
  0 to the other TP ranks; last, with expert parallelism, from the first replica of the
  expert-parallel group to the others), so every rank keeps the same request state without
  relying on identical random number generators or bitwise identical logits.
"""

from typing import Optional, Sequence

import torch

from megatron.core import group_fallbacks
from megatron.core.utils import get_current_device


def _pp_group(pp_group):
    return group_fallbacks.get_pipeline_model_parallel_group_if_none(pp_group)


def _global_rank(group, group_rank: int) -> int:
    return torch.distributed.get_process_group_ranks(group)[group_rank]


def is_pipeline_first_stage(pp_group=None) -> bool:
    """Whether this rank holds the first stage of `pp_group`."""
    return _pp_group(pp_group).rank() == 0


def is_pipeline_last_stage(pp_group=None) -> bool:
    """Whether this rank holds the last stage of `pp_group`."""
    group = _pp_group(pp_group)
    return group.rank() == group.size() - 1


def recv_from_prev_pipeline_rank_(recv_buffer: Optional[torch.Tensor] = None, pp_group=None):
    """Receive into `recv_buffer` from the previous stage (no-op on the first stage)."""
    group = _pp_group(pp_group)
    if group.rank() == 0:
        return
    assert recv_buffer is not None
    torch.distributed.recv(recv_buffer, src=_global_rank(group, group.rank() - 1))


def send_to_next_pipeline_rank(tensor: Optional[torch.Tensor] = None, pp_group=None):
    """Send `tensor` to the next stage (no-op on the last stage)."""
    group = _pp_group(pp_group)
    if group.rank() == group.size() - 1:
        return
    assert tensor is not None
    torch.distributed.send(tensor.contiguous(), dst=_global_rank(group, group.rank() + 1))


def broadcast_from_last_pipeline_stage(
    size: Sequence[int], dtype: torch.dtype, tensor: Optional[torch.Tensor] = None, pp_group=None
) -> torch.Tensor:
    """Broadcast `tensor` (given on the last stage) to every stage of `pp_group`; the other
    stages allocate `size` x `dtype` to receive it."""
    group = _pp_group(pp_group)
    if group.size() == 1:
        return tensor
    last = group.size() - 1
    if group.rank() == last:
        assert tensor is not None and tensor.is_contiguous()
    else:
        tensor = torch.empty(size, dtype=dtype, device=get_current_device())
    torch.distributed.broadcast(tensor, _global_rank(group, last), group=group)
    return tensor


def broadcast_from_tensor_parallel_rank0(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Overwrite `tensor` (same shape and dtype on every TP rank) with TP rank 0's copy."""
    group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
    if group.size() > 1:
        torch.distributed.broadcast(tensor, _global_rank(group, 0), group=group)
    return tensor


def broadcast_from_expert_parallel_rank0(tensor: torch.Tensor, ep_group=None) -> torch.Tensor:
    """Overwrite `tensor` (same shape and dtype on every rank of `ep_group`) with the copy of the
    group's first rank.

    The model replicas of an expert-parallel group run every forward together (their tokens meet
    in the experts' dispatch), so they must book the same tokens: each computed its own samples
    from the same logits, but its experts saw the rows in another order, so a last-bit difference
    could flip a near-tie and make the replicas schedule different steps (a hang in the next
    dispatch). The first replica's result is every replica's."""
    group = group_fallbacks.get_expert_model_parallel_group_if_none(ep_group)
    if group.size() > 1:
        torch.distributed.broadcast(tensor, _global_rank(group, 0), group=group)
    return tensor


def share_last_stage_result(
    size: Sequence[int],
    dtype: torch.dtype,
    tensor=None,
    tp_group=None,
    pp_group=None,
    ep_group=None,
) -> torch.Tensor:
    """A result computed on the last stage (e.g. sampled tokens), made identical on every rank of
    the model replica: TP rank 0's copy goes to the other TP ranks of the last stage, then to
    every stage; with expert parallelism, then the first replica's copy to the other replicas of
    the expert-parallel group."""
    if is_pipeline_last_stage(pp_group):
        tensor = broadcast_from_tensor_parallel_rank0(tensor.contiguous(), tp_group)
    tensor = broadcast_from_last_pipeline_stage(size, dtype, tensor, pp_group)
    return broadcast_from_expert_parallel_rank0(tensor, ep_group)
