"""Global gradient norm, clipping and zero counting across the model-parallel group.

The norm of a model split over tensor and pipeline ranks is the norm of the concatenation of all
distinct gradients: each rank sums the `norm_type`-th powers of the norms of its own gradients and
the sums are all-reduced over the model-parallel group. Gradients that exist on several ranks are
counted once: the caller passes only the gradients of params that are not TP duplicates
(`param_is_not_tensor_parallel_duplicate`: TP-split params, or any param on TP rank 0) and not the
tied output-layer copy of the word embedding on the last pipeline stage (`param.shared`).

Gradients of fully sharded (FSDP2) parameters are DTensors: each rank holds a dim-0 shard, so
their partial sums are first all-reduced over the data-parallel groups they are sharded over,
then added to the rest before the model-parallel reduction.
"""

import math
from typing import List, Optional, Union

import torch

from .. import tensor_parallel
from ..distributed.sharded_tensors import local_tensor, shard_groups
from ..utils import get_current_device


def _split_sharded(grads: List[torch.Tensor]):
    """(plain grads, {shard groups: [local shards]}) of a list of grads (DTensors grouped)."""
    plain, sharded = [], {}
    for grad in grads:
        groups = tuple(shard_groups(grad))
        if groups:
            sharded.setdefault(groups, []).append(local_tensor(grad))
        else:
            plain.append(grad)
    return plain, sharded


def _sum_pow_norms(grads: List[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    total = torch.zeros(1, dtype=torch.float, device=device)
    grads = [g.detach() for g in grads if g.numel() > 0]
    grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
    # One multi-tensor kernel per device (host-resident main grads of optimizer_cpu_offload
    # beside device ones) for all per-tensor norms instead of a Python loop over params.
    for group in _by_device(grads):
        norms = torch._foreach_norm(group, norm_type)
        total += torch.stack(norms).to(device).pow(norm_type).sum()
    return total


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the last stage's copy of a tied embedding (its gradient equals the first's)."""
    return not getattr(param, 'shared', False)


def _by_device(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """`tensors` grouped by device, in first-seen order (one group on a single device)."""
    groups = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return list(groups.values())


def get_grad_norm_fp32(
    grads_for_norm: Union[List[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    model_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
) -> float:
    """The global norm of `grads_for_norm` over all ranks of `model_parallel_group`.

    Args:
        grads_for_norm: this rank's gradients, already filtered of duplicates.
        norm_type: p of the p-norm; `inf` for the max norm.
        model_parallel_group: group to reduce over (None: the default/world group).

    Returns:
        The total norm as a Python float.
    """
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    device = get_current_device()

    plain, sharded = _split_sharded(grads_for_norm)

    if norm_type == math.inf:
        total_norm = torch.zeros(1, dtype=torch.float, device=device)
        for groups, shards in list(sharded.items()) + [((), plain)]:
            local = max([g.detach().abs().max().item() for g in shards if g.numel() > 0] or [0.0])
            part = torch.tensor([float(local)], dtype=torch.float, device=device)
            for group in groups:
                torch.distributed.all_reduce(part, op=torch.distributed.ReduceOp.MAX, group=group)
            total_norm = torch.maximum(total_norm, part)
        torch.distributed.all_reduce(
            total_norm, op=torch.distributed.ReduceOp.MAX, group=model_parallel_group
        )
        return total_norm[0].item()

    total_norm = _sum_pow_norms(plain, norm_type, device)
    for groups, shards in sharded.items():
        part = _sum_pow_norms(shards, norm_type, device)
        for group in groups:
            torch.distributed.all_reduce(part, op=torch.distributed.ReduceOp.SUM, group=group)
        total_norm += part
    torch.distributed.all_reduce(
        total_norm, op=torch.distributed.ReduceOp.SUM, group=model_parallel_group
    )
    return total_norm[0].item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    max_norm: Union[int, float],
    total_norm: float,
):
    """Scale the `.grad` of `parameters` in place by max_norm / total_norm if that is < 1.

    Args:
        parameters: (main) parameters whose `.grad` (fp32) are clipped.
        max_norm: the clipping threshold.
        total_norm: the global norm from `get_grad_norm_fp32`.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [local_tensor(p.grad.detach()) for p in parameters if p.grad is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for group in _by_device(grads):
            torch._foreach_mul_(group, clip_coeff)


def count_zeros_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    model_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
) -> float:
    """Number of zero gradient entries over the model-parallel group (duplicates counted once).

    Args:
        parameters: (main) parameters whose `.grad` are counted.
        model_parallel_group: group to reduce over (None: the default/world group).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    device = get_current_device()
    total_num_zeros = torch.zeros(1, dtype=torch.float, device=device)
    sharded_zeros = {}
    for param in parameters:
        if param.grad is None:
            continue
        if param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(
            param
        ):
            groups = tuple(shard_groups(param.grad))
            grad = local_tensor(param.grad.detach())
            zeros = (grad.numel() - torch.count_nonzero(grad)).to(device).float()
            if groups:
                sharded_zeros[groups] = sharded_zeros.get(groups, 0.0) + zeros
            else:
                total_num_zeros += zeros
    for groups, zeros in sharded_zeros.items():
        part = torch.zeros(1, dtype=torch.float, device=device) + zeros
        for group in groups:
            torch.distributed.all_reduce(part, op=torch.distributed.ReduceOp.SUM, group=group)
        total_num_zeros += part
    torch.distributed.all_reduce(
        total_num_zeros, op=torch.distributed.ReduceOp.SUM, group=model_parallel_group
    )
    return total_num_zeros[0].item()
