"""Autograd-aware collectives that move activations into and out of tensor parallel regions.

Each public function is an autograd Function whose backward is the adjoint collective of its
forward (identity <-> all-reduce, split <-> all-gather, reduce-scatter <-> all-gather). Two
split axes are used:

- last dim ("tensor parallel region"): hidden features split over the tp ranks, [s, b, h/tp];
- first dim ("sequence parallel region"): the sequence split over the tp ranks, [s/tp, b, h].

Every function takes an optional `group`; None means the global tensor model parallel group
(through group_fallbacks.get_tensor_model_parallel_group_if_none). With a group of size 1 every
collective is the identity, so size 1 runs the same code.
"""

from typing import List, Optional

import torch

from megatron.core import group_fallbacks, parallel_state
from megatron.core.tensor_parallel.function_apply import apply_function
from megatron.core.tensor_parallel.utils import (
    all_gather_into_tensor,
    reduce_scatter_tensor,
    split_tensor_along_last_dim,
)
from megatron.core.utils import divide


def _resolve(group):
    # Fall back to the global tensor model parallel group when the caller passes none.
    return group_fallbacks.get_tensor_model_parallel_group_if_none(group)


# --------------------------------------------------------------------------------------------
# Plain (non-autograd) collectives
# --------------------------------------------------------------------------------------------


def _reduce(input_: torch.Tensor, group) -> torch.Tensor:
    """All-reduce (sum) `input_` over `group`, in place when `input_` is contiguous."""
    if group.size() == 1:
        return input_
    input_ = input_.contiguous()
    torch.distributed.all_reduce(input_, group=group)
    return input_


def _split_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of `input_` along the last dimension ([..., h] -> [..., h/tp])."""
    world_size = group.size()
    if world_size == 1:
        return input_
    input_list = split_tensor_along_last_dim(input_, world_size)
    return input_list[group.rank()].contiguous()


def _split_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of `input_` along the first dimension ([s, ...] -> [s/tp, ...])."""
    world_size = group.size()
    if world_size == 1:
        return input_
    dim_size = input_.size()[0]
    if dim_size % world_size != 0:
        raise ValueError(
            f"first dimension of the tensor ({dim_size}) is not divisible by the tensor parallel "
            f"size ({world_size}); with sequence_parallel the sequence length must be divisible"
        )
    local_dim_size = dim_size // world_size
    dim_offset = group.rank() * local_dim_size
    return input_[dim_offset : dim_offset + local_dim_size].contiguous()


def _gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the last dimension ([..., h/tp] -> [..., h])."""
    world_size = group.size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    all_gather_into_tensor(output, input_.contiguous(), group=group)
    # [tp * s, ..., h/tp] -> tp chunks along dim 0, concatenated along the last dim.
    tensor_list = output.chunk(world_size, dim=0)
    return torch.cat(tensor_list, dim=-1).contiguous()


def _reduce_scatter_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group and keep this rank's last-dim chunk ([..., h] -> [..., h/tp])."""
    world_size = group.size()
    if world_size == 1:
        return input_
    target_shape = list(input_.size())
    target_shape[-1] = target_shape[-1] // world_size
    input_ = input_.reshape(-1, input_.shape[-1])  # [n, h]
    split_tensors = torch.split(
        input_, split_size_or_sections=input_.shape[-1] // world_size, dim=1
    )
    concat_tensor = torch.cat(split_tensors, dim=0)  # [tp * n, h/tp]
    output = _reduce_scatter_along_first_dim(concat_tensor, group).reshape(target_shape)
    return output


def _gather_along_first_dim(
    input_: torch.Tensor, group, output_split_sizes: Optional[List[int]] = None
):
    """All-gather along the first dimension ([s/tp, ...] -> [s, ...]).

    Args:
        output_split_sizes: first-dim size of each rank's chunk when they differ (None: equal).
    """
    world_size = group.size()
    if world_size == 1:
        return input_
    dim_size = list(input_.size())
    if output_split_sizes is None:
        output, handle = _start_gather_along_first_dim(input_, group)
        handle.wait()
        return output
    # Uneven chunks: gather zero-padded chunks of the largest size, then drop the padding.
    max_size = max(output_split_sizes)
    padded = input_.new_zeros([max_size] + dim_size[1:])
    padded[: dim_size[0]] = input_
    gathered = torch.empty(
        [max_size * world_size] + dim_size[1:], dtype=input_.dtype, device=input_.device
    )
    all_gather_into_tensor(gathered, padded, group=group)
    chunks = gathered.split(max_size, dim=0)
    return torch.cat([c[:n] for c, n in zip(chunks, output_split_sizes)], dim=0)


def _reduce_scatter_along_first_dim(
    input_: torch.Tensor, group, input_split_sizes: Optional[List[int]] = None
) -> torch.Tensor:
    """Sum over the group and keep this rank's first-dim chunk ([s, ...] -> [s/tp, ...]).

    Args:
        input_split_sizes: first-dim size of each rank's chunk when they differ (None: equal).
    """
    world_size = group.size()
    if world_size == 1:
        return input_
    if input_split_sizes is None:
        output, handle = _start_reduce_scatter_along_first_dim(input_, group)
        handle.wait()
        return output
    # Uneven chunks: all-reduce then keep this rank's slice.
    reduced = _reduce(input_.clone(), group)
    offset = sum(input_split_sizes[: group.rank()])
    return reduced[offset : offset + input_split_sizes[group.rank()]].contiguous()


def _start_gather_along_first_dim(input_: torch.Tensor, group):
    """Start an asynchronous equal-chunk all-gather along the first dimension.

    Returns (output [s, ...], handle): wait on the handle (None at size 1, where output is
    `input_`) before reading output. Lets the caller compute while the collective runs.
    """
    world_size = group.size()
    if world_size == 1:
        return input_, None
    dim_size = list(input_.size())
    dim_size[0] = dim_size[0] * world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    handle = all_gather_into_tensor(output, input_.contiguous(), group=group, async_op=True)
    return output, handle


def _start_reduce_scatter_along_first_dim(input_: torch.Tensor, group):
    """Start an asynchronous equal-chunk reduce-scatter along the first dimension.

    Returns (output [s/tp, ...], handle): wait on the handle (None at size 1, where output is
    `input_`) before reading output, and do not modify `input_` until then.
    """
    world_size = group.size()
    if world_size == 1:
        return input_, None
    dim_size = list(input_.size())
    if dim_size[0] % world_size != 0:
        raise ValueError(
            f"first dimension of the tensor ({dim_size[0]}) is not divisible by the tensor "
            f"parallel size ({world_size})"
        )
    dim_size[0] = dim_size[0] // world_size
    output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
    handle = reduce_scatter_tensor(output, input_.contiguous(), group=group, async_op=True)
    return output, handle


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------


def _group_of(ctx):
    # The group the forward was given; None (or a ctx without one, as when a library user calls
    # `backward(None, grad)` directly, the way Megatron's unit tests do) means the default group.
    return _resolve(getattr(ctx, 'group', None))


def _with_group_grad(ctx, grads: tuple):
    # One gradient per forward input: an explicit `group` argument adds a None after the
    # tensor's gradient. Without one the result is r0.8's (a bare tensor for one input).
    if getattr(ctx, 'group', None) is None:
        return grads[0] if len(grads) == 1 else grads
    return (grads[0], None) + grads[1:]


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the tp group."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return input_

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        group = _group_of(ctx)
        if group.size() == 1:
            return _with_group_grad(ctx, (grad_output,))
        # Clone: the incoming gradient may be a tensor the caller still holds.
        return _with_group_grad(ctx, (_reduce(grad_output.clone(), group),))


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-reduce over the tp group (in place). Backward: identity."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _reduce(input_, _resolve(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _reduce(input_, _resolve(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _with_group_grad(ctx, (grad_output,))


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's last-dim chunk. Backward: all-gather along the last dim."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _split_along_last_dim(input_, _resolve(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _split_along_last_dim(input_, _resolve(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _with_group_grad(ctx, (_gather_along_last_dim(grad_output, _group_of(ctx)),))


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: keep this rank's last-dim chunk."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _gather_along_last_dim(input_, _resolve(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _gather_along_last_dim(input_, _resolve(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _with_group_grad(ctx, (_split_along_last_dim(grad_output, _group_of(ctx)),))


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's first-dim chunk. Backward: all-gather along the first dim."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _split_along_first_dim(input_, _resolve(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _split_along_first_dim(input_, _resolve(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _with_group_grad(ctx, (_gather_along_first_dim(grad_output, _group_of(ctx)),))


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the first dim.

    Backward: reduce-scatter along the first dim when the consumer of the gathered tensor is in
    a tensor parallel region (each rank holds a partial gradient), else keep this rank's chunk.
    """

    @staticmethod
    def symbolic(
        graph, input_, group=None, tensor_parallel_output_grad=True, output_split_sizes=None
    ):
        return _gather_along_first_dim(input_, _resolve(group), output_split_sizes)

    @staticmethod
    def forward(ctx, input_, group=None, tensor_parallel_output_grad=True, output_split_sizes=None):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.output_split_sizes = output_split_sizes
        return _gather_along_first_dim(input_, _resolve(group), output_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        group = _group_of(ctx)
        split_sizes = getattr(ctx, 'output_split_sizes', None)
        if getattr(ctx, 'tensor_parallel_output_grad', True):
            grad = _reduce_scatter_along_first_dim(grad_output, group, split_sizes)
        elif split_sizes is not None:
            offset = sum(split_sizes[: group.rank()])
            grad = grad_output[offset : offset + split_sizes[group.rank()]].contiguous()
        else:
            grad = _split_along_first_dim(grad_output, group)
        return _with_group_grad(ctx, (grad, None, None))


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter along the first dim. Backward: all-gather along the first dim."""

    @staticmethod
    def symbolic(graph, input_, group=None, input_split_sizes=None):
        return _reduce_scatter_along_first_dim(input_, _resolve(group), input_split_sizes)

    @staticmethod
    def forward(ctx, input_, group=None, input_split_sizes=None):
        ctx.group = group
        ctx.input_split_sizes = input_split_sizes
        return _reduce_scatter_along_first_dim(input_, _resolve(group), input_split_sizes)

    @staticmethod
    def backward(ctx, grad_output):
        split_sizes = getattr(ctx, 'input_split_sizes', None)
        grad = _gather_along_first_dim(grad_output, _group_of(ctx), split_sizes)
        return _with_group_grad(ctx, (grad, None))


class _AllGatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: reduce-scatter along the last dim."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _gather_along_last_dim(input_, _resolve(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _gather_along_last_dim(input_, _resolve(group))

    @staticmethod
    def backward(ctx, grad_output):
        grad = _reduce_scatter_along_last_dim(grad_output, _group_of(ctx))
        return _with_group_grad(ctx, (grad,))


class _ReduceScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: reduce-scatter along the last dim. Backward: all-gather along the last dim."""

    @staticmethod
    def symbolic(graph, input_, group=None):
        return _reduce_scatter_along_last_dim(input_, _resolve(group))

    @staticmethod
    def forward(ctx, input_, group=None):
        ctx.group = group
        return _reduce_scatter_along_last_dim(input_, _resolve(group))

    @staticmethod
    def backward(ctx, grad_output):
        return _with_group_grad(ctx, (_gather_along_last_dim(grad_output, _group_of(ctx)),))


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all along the first dim. Backward: the reverse all-to-all."""

    @staticmethod
    def symbolic(graph, group, input_, output_split_sizes, input_split_sizes):
        return _AllToAll.forward(None, group, input_, output_split_sizes, input_split_sizes)

    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        if ctx is not None:  # None when called from `symbolic`
            ctx.group = group
            ctx.output_split_sizes = output_split_sizes
            ctx.input_split_sizes = input_split_sizes
        world_size = group.size()
        if world_size == 1:
            return input_
        input_ = input_.contiguous()
        if output_split_sizes is None:
            output = torch.empty_like(input_)
        else:
            output = input_.new_empty(size=[sum(output_split_sizes)] + list(input_.size()[1:]))
        torch.distributed.all_to_all_single(
            output,
            input_,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
        )
        return output

    @staticmethod
    def backward(ctx, *grad_output):
        return (
            None,
            _AllToAll.apply(ctx.group, *grad_output, ctx.input_split_sizes, ctx.output_split_sizes),
            None,
            None,
        )


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Enter a tp region: forward identity, backward all-reduce of the gradient.

    On a group of one rank both directions are the identity: the input itself is returned and
    no autograd node is recorded (two of these per layer and per step otherwise)."""
    group = _resolve(group)
    if group.size() == 1:
        return input_
    return apply_function(_CopyToModelParallelRegion, input_, group)


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """Leave a tp region: forward all-reduce (sum, in place), backward identity (on a group of
    one rank: the input itself, no autograd node)."""
    group = _resolve(group)
    if group.size() == 1:
        return input_
    return apply_function(_ReduceFromModelParallelRegion, input_, group)


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Split the last dim: forward keeps this rank's [..., h/tp] chunk, backward all-gathers."""
    return apply_function(_ScatterToModelParallelRegion, input_, _resolve(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    """Gather the last dim: forward all-gathers [..., h/tp] -> [..., h], backward splits."""
    return apply_function(_GatherFromModelParallelRegion, input_, _resolve(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    """Split the first dim: forward keeps [s/tp, ...], backward all-gathers along dim 0."""
    return apply_function(_ScatterToSequenceParallelRegion, input_, _resolve(group))


def gather_from_sequence_parallel_region(
    input_, tensor_parallel_output_grad=True, output_split_sizes=None, group=None
):
    """Gather the first dim: forward all-gathers [s/tp, ...] -> [s, ...].

    Backward reduce-scatters along dim 0 if `tensor_parallel_output_grad` (the gathered tensor
    feeds a tensor parallel computation, so each rank holds a partial gradient), else splits.
    """
    return apply_function(
        _GatherFromSequenceParallelRegion,
        input_,
        _resolve(group),
        tensor_parallel_output_grad,
        output_split_sizes,
    )


def reduce_scatter_to_sequence_parallel_region(input_, input_split_sizes=None, group=None):
    """Leave a tp region into a sequence parallel one: forward reduce-scatters along dim 0
    ([s, ...] partial sums -> [s/tp, ...]), backward all-gathers along dim 0."""
    return apply_function(
        _ReduceScatterToSequenceParallelRegion, input_, _resolve(group), input_split_sizes
    )


def all_gather_last_dim_from_tensor_parallel_region(input_, group=None):
    """Forward all-gathers along the last dim, backward reduce-scatters along the last dim."""
    return apply_function(_AllGatherFromTensorParallelRegion, input_, _resolve(group))


def reduce_scatter_last_dim_to_tensor_parallel_region(input_, group=None):
    """Forward reduce-scatters along the last dim, backward all-gathers along the last dim."""
    return apply_function(_ReduceScatterToTensorParallelRegion, input_, _resolve(group))


def gather_from_sequence_parallel_region_to_moe(input_, output_split_sizes=None):
    """gather_from_sequence_parallel_region over the tensor + expert parallel group (MoE)."""
    group = parallel_state.get_tensor_and_expert_parallel_group()
    return apply_function(
        _GatherFromSequenceParallelRegion, input_, group, True, output_split_sizes
    )


def reduce_scatter_to_sequence_parallel_region_from_moe(input_, input_split_sizes=None):
    """reduce_scatter_to_sequence_parallel_region over the tensor + expert parallel group (MoE)."""
    group = parallel_state.get_tensor_and_expert_parallel_group()
    return apply_function(_ReduceScatterToSequenceParallelRegion, input_, group, input_split_sizes)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes_=None):
    """All-to-all along the first dim over `group` (backward: the reverse all-to-all)."""
    return apply_function(_AllToAll, group, input_, output_split_sizes_, input_split_sizes_)


def all_to_all_sp2hp(input_, group=None):
    """Sequence-split to hidden-split: [s/tp * b, h] -> [s * b, h/tp] with one all-to-all."""
    group = _resolve(group)
    world_size = group.size()
    input_ = input_.reshape(-1, input_.shape[-1])  # [s/tp * b, h]
    split_tensors = torch.split(
        input_, split_size_or_sections=divide(input_.shape[-1], world_size), dim=1
    )
    concat_tensor = torch.cat(split_tensors, dim=0)  # [tp * s/tp * b, h/tp]
    return all_to_all(group, concat_tensor)  # [s * b, h/tp]


def all_to_all_hp2sp(input_, group=None):
    """Hidden-split to sequence-split: [s * b, h/tp] -> [s/tp * b, h] with one all-to-all."""
    group = _resolve(group)
    world_size = group.size()
    input_ = input_.reshape(-1, input_.shape[-1])  # [s * b, h/tp]
    input_exchanged = all_to_all(group, input_)  # [tp * s/tp * b, h/tp]
    input_reshaped = input_exchanged.reshape(-1, input_exchanged.shape[-1])
    split_tensors = torch.split(
        input_reshaped, split_size_or_sections=divide(input_reshaped.shape[0], world_size), dim=0
    )
    return torch.cat(split_tensors, dim=-1)  # [s/tp * b, h]
