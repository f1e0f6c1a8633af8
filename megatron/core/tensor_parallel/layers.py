"""Tensor parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Notation: s sequence, b micro batch, h input features, o output features, v vocabulary,
tp tensor parallel size. Under sequence parallelism the activations outside the tensor
parallel region are split along the sequence: [s/tp, b, h].

Weight initialization, two ways:
- config.use_cpu_initialization: the full (master) weight is built on CPU with the default
  generator (same seed on every tp rank) and each rank keeps its slices, so a model built at
  TP=k holds exactly the slices of the TP=1 weights;
- otherwise each rank initializes its own partition on the current device under
  get_cuda_rng_tracker().fork() (the model-parallel RNG stream, different per tp rank).
"""

import warnings
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core import group_fallbacks, parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.comm_overlap import (
    AllGatherMatmul,
    MatmulReduceScatter,
    overlaps_all_gather,
    overlaps_reduce_scatter,
)
from megatron.core.tensor_parallel.comm_overlap_cfg import layer_overlap
from megatron.core.tensor_parallel.function_apply import apply_function
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _start_gather_along_first_dim,
    _start_reduce_scatter_along_first_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.utils import divide, get_current_device

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    'tensor_model_parallel': False,
    'partition_dim': -1,
    'partition_stride': 1,
}


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True if `param` is split across tp ranks, or this is tp rank 0 (count replicated params
    once)."""
    return (
        hasattr(param, 'tensor_model_parallel') and param.tensor_model_parallel
    ) or parallel_state.get_tensor_model_parallel_rank() == 0


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
):
    """Mark how `tensor` is split: `tensor_model_parallel`, `partition_dim`, `partition_stride`."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        assert not hasattr(tensor, attribute), f'{attribute} already set'
    setattr(tensor, 'tensor_model_parallel', is_parallel)
    setattr(tensor, 'partition_dim', dim)
    setattr(tensor, 'partition_stride', stride)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor):
    """Give `tensor` the "not split" attributes unless it already has them."""
    missing = {
        k: v for k, v in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items() if not hasattr(tensor, k)
    }
    for name, default in missing.items():
        setattr(tensor, name, default)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
):
    """Copy the split attributes of `source_tensor` onto `destination_tensor`."""
    present = [name for name in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS if hasattr(source_tensor, name)]
    for name in present:
        setattr(destination_tensor, name, getattr(source_tensor, name))


def _initialize_affine_weight_gpu(
    weight: torch.Tensor,
    init_method: Callable,
    partition_dim: int,
    stride: int = 1,
    expert_parallel: bool = False,
):
    """Initialize this rank's partition in place under the model-parallel (or expert) RNG stream."""
    set_tensor_model_parallel_attributes(
        tensor=weight, is_parallel=True, dim=partition_dim, stride=stride
    )
    if expert_parallel:
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            init_method(weight)
    else:
        with get_cuda_rng_tracker().fork():
            init_method(weight)


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
):
    """Build the full [output_size, input_size] master weight on CPU and copy this rank's slices.

    The master weight is cut along `partition_dim` into blocks of per_partition_size / stride;
    rank r takes blocks r, r + world_size, r + 2 * world_size, ... (stride > 1 interleaves, e.g.
    for a fused [gate; up] weight each rank gets its slice of both halves).

    Returns:
        The master weight if return_master_weight, else None.
    """
    set_tensor_model_parallel_attributes(
        tensor=weight, is_parallel=True, dim=partition_dim, stride=stride
    )
    # Drawn in fp32 whatever the parameter dtype, so every layout starts from the same numbers.
    full = torch.empty(output_size, input_size, dtype=torch.float, requires_grad=False)
    init_method(full)
    full = full.to(dtype=params_dtype)
    if rank is None:
        rank = parallel_state.get_tensor_model_parallel_rank()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
    blocks = full.split(divide(per_partition_size, stride), dim=partition_dim)
    mine = torch.cat(blocks[rank::world_size], dim=partition_dim)  # every world_size-th block
    with torch.no_grad():
        # Copied in: torch.cat(out=...) could resize the parameter.
        weight.data.copy_(mine)
    return full if return_master_weight else None


def _zero_bias(config: ModelParallelConfig, size: int) -> Parameter:
    """A bias Parameter [size] on the init device, zero when the config initialises weights."""
    device = None if config.use_cpu_initialization else get_current_device()
    bias = Parameter(torch.empty(size, device=device, dtype=config.params_dtype))
    if config.perform_initialization:
        with torch.no_grad():
            bias.zero_()
    return bias


#: `_partitioned_weight`'s master when no CPU master weight was drawn.
NO_MASTER = object()


def _partitioned_weight(
    config: ModelParallelConfig,
    full_shape: tuple,
    partition_dim: int,
    init_method: Callable,
    rank: int,
    world_size: int,
    stride: int = 1,
    expert_parallel: bool = False,
    keep_master: bool = False,
):
    """This rank's Parameter of a [out, in] weight split along `partition_dim`.

    With config.use_cpu_initialization the full weight is drawn on CPU and sliced
    (`_initialize_affine_weight_cpu`, the same values at every TP size); otherwise the slice is
    drawn on the device under the model-parallel (or expert-parallel) RNG stream. Without
    config.perform_initialization the slice is left uninitialised, only marked as split.

    Returns:
        (weight, master): master is the full CPU weight when drawn on CPU with keep_master,
        None when drawn on CPU without it, and NO_MASTER otherwise (no master exists).
    """
    shape = list(full_shape)
    shape[partition_dim] = divide(shape[partition_dim], world_size)
    device = None if config.use_cpu_initialization else get_current_device()
    weight = Parameter(torch.empty(*shape, device=device, dtype=config.params_dtype))
    if not config.perform_initialization:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
        return weight, NO_MASTER
    if not config.use_cpu_initialization:
        _initialize_affine_weight_gpu(
            weight, init_method, partition_dim=partition_dim, stride=stride,
            expert_parallel=expert_parallel,
        )  # fmt: skip
        return weight, NO_MASTER
    master = _initialize_affine_weight_cpu(
        weight, full_shape[0], full_shape[1], shape[partition_dim], partition_dim, init_method,
        stride=stride, return_master_weight=keep_master, params_dtype=config.params_dtype,
        rank=rank, world_size=world_size,
    )  # fmt: skip
    return weight, master


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary dimension.

    Weight [v, h] is split along dim 0: rank r holds rows [r * v/tp, (r + 1) * v/tp).
    Forward: each rank looks up the ids it owns (zeros for the others), then an all-reduce over
    the tp group sums the partial embeddings ([b, s] ids -> [b, s, h]). With
    reduce_scatter_embeddings the output is transposed to [s, b, h] and reduce-scattered along
    the sequence instead ([s/tp, b, h], sequence parallel).
    Backward: identity for the all-reduce (all-gather for the reduce-scatter); each rank's
    weight gradient only touches its own rows.

    Args:
        num_embeddings: vocabulary size v (divisible by the tp size).
        embedding_dim: hidden size h.
        init_method: weight init, called on the master weight or on the partition.
        config: ModelParallelConfig.
        reduce_scatter_embeddings: reduce-scatter (sequence parallel) instead of all-reduce.
        tp_group: tensor parallel group (default: the global one).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable,
        config: ModelParallelConfig,
        reduce_scatter_embeddings: bool = False,
        tp_group=None,
    ):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        # Fall back to the global tensor model parallel group when none is given.
        self.tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
        self.tensor_model_parallel_size = self.tp_group.size()
        if num_embeddings % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f'num_embeddings ({num_embeddings}) must be divisible by the tensor parallel size '
                f'({self.tensor_model_parallel_size}); pad the vocabulary'
            )
        (self.vocab_start_index, self.vocab_end_index) = (
            VocabUtility.vocab_range_from_global_vocab_size(
                self.num_embeddings, self.tp_group.rank(), self.tensor_model_parallel_size
            )
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.deterministic_mode = config.deterministic_mode

        self.weight, _ = _partitioned_weight(
            config,
            (self.num_embeddings, self.embedding_dim),
            0,
            init_method,
            rank=self.tp_group.rank(),
            world_size=self.tensor_model_parallel_size,
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint: the weight split over TP along the vocabulary (dim 0).

        The stored global shape is the padded vocabulary of the saving run; a run whose padding
        differs (another TP size) reads the overlap and zero-fills the rest
        (`allow_shape_mismatch`).
        """
        from megatron.core.dist_checkpointing.utils import make_tp_sharded_tensor_for_checkpoint

        key = f'{prefix}weight'
        return {
            key: make_tp_sharded_tensor_for_checkpoint(
                self.weight, key, 0, prepend_offsets=sharded_offsets, allow_shape_mismatch=True
            )
        }

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [b, s, h] embeddings ([s/tp, b, h] with
        reduce_scatter_embeddings)."""
        split = self.tensor_model_parallel_size > 1
        local_ids, foreign = input_, None
        if split:
            # Ids owned by another rank look up local row 0; their rows are zeroed below, so
            # the reduction over tp adds only the owner's row.
            foreign = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(foreign, 0)
        # Plain indexing in deterministic mode (its backward accumulates in a fixed order).
        lookup = self.weight.__getitem__ if self.deterministic_mode else self._embed
        output_parallel = lookup(local_ids)  # [b, s, h]
        if split:
            output_parallel[foreign, :] = 0.0

        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


class LinearWithFrozenWeight(torch.autograd.Function):
    """Linear layer whose weight takes no gradient; the input gradient is all-reduced over tp
    if `allreduce_dgrad`."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad and ctx.tp_group.size() > 1:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """Y = X A^T + b with the tensor parallel communication of the input folded in.

    Forward: with sequence_parallel, all-gather X along the sequence ([s/tp, b, h] -> [s, b, h])
    before the matmul.
    Backward:
      - grad X = grad Y A; with allreduce_dgrad it is all-reduced over tp, with
        sequence_parallel reduce-scattered back to [s/tp, b, h]; either collective is issued
        asynchronously and overlaps the weight-gradient matmul. With sequence_parallel X is
        all-gathered again for the weight gradient (rather than kept from the forward, to save
        memory), asynchronously, overlapping the grad X matmul;
      - grad A = grad Y^T X, or, with gradient_accumulation_fusion, added into `A.main_grad`
        (fp32) and no `A.grad` is produced;
      - with a grad_output_buffer (deferred embedding wgrad), grad Y is stored and the weight
        gradient is left to the caller.
    """

    @staticmethod
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        tp_group,
    ):
        ctx.save_for_backward(input, weight)
        # What backward needs besides the saved tensors.
        ctx.use_bias, ctx.tp_group = bias is not None, tp_group
        ctx.allreduce_dgrad, ctx.sequence_parallel = allreduce_dgrad, sequence_parallel
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.grad_output_buffer = grad_output_buffer

        if sequence_parallel:
            total_input = _gather_along_first_dim(input, tp_group)  # [s/tp, b, h] -> [s, b, h]
        else:
            total_input = input
        if bias is None:
            return torch.matmul(total_input, weight.t())
        # The bias goes into the GEMM (addmm): no separate pass over the output.
        input_2d = total_input.reshape(-1, total_input.shape[-1])  # [s * b, h]
        output = torch.addmm(bias, input_2d, weight.t())  # [s * b, o]
        return output.view(*total_input.shape[:-1], output.shape[-1])  # [s, b, o]

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        tp_group, use_bias = ctx.tp_group, ctx.use_bias
        # A deferred embedding weight gradient: grad Y is kept for the caller's own GEMM.
        wgrad_compute = ctx.grad_output_buffer is None
        if not wgrad_compute:
            ctx.grad_output_buffer.append(grad_output)

        gather_handle = None
        if ctx.sequence_parallel and wgrad_compute:
            # The input's all-gather runs while the data-gradient GEMM below computes.
            total_input, gather_handle = _start_gather_along_first_dim(input, tp_group)  # [s, b, h]
        else:
            total_input = input
        grad_input = grad_output.matmul(weight)
        if gather_handle is not None:
            gather_handle.wait()

        handle = None
        if ctx.allreduce_dgrad and tp_group.size() > 1:
            # Asynchronous all-reduce, overlapped with the weight-gradient matmul below.
            grad_input = grad_input.contiguous()
            handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)

        if ctx.sequence_parallel:
            assert not ctx.allreduce_dgrad
            # Asynchronous reduce-scatter, overlapped with the weight-gradient matmul below.
            sub_grad_input, handle = _start_reduce_scatter_along_first_dim(
                grad_input, tp_group
            )  # [s/tp, b, h]

        grad_weight = None
        if wgrad_compute:
            # [s, b, o] -> [s * b, o] and [s, b, h] -> [s * b, h]
            grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
            total_input_2d = total_input.reshape(-1, total_input.shape[-1])
            if ctx.gradient_accumulation_fusion:
                if not hasattr(weight, 'main_grad'):
                    raise RuntimeError(
                        'gradient_accumulation_fusion needs `main_grad` on the weights '
                        '(wrap the model in DistributedDataParallel)'
                    )
                main_grad = weight.main_grad
                # One GEMM accumulating in place (main_grad += dY^T X): no weight-sized temporary.
                main_grad.addmm_(
                    grad_output_2d.t().to(main_grad.dtype), total_input_2d.to(main_grad.dtype)
                )
                if hasattr(weight, 'grad_added_to_main_grad'):
                    # The DDP hook must not add this gradient again. Where another use of the
                    # weight in this graph (the tied embedding lookup, `zero_out_wgrad`) gives
                    # autograd its real gradient, which the hook adds to main_grad, return none:
                    # a weight-sized zero tensor would cost a fresh allocation and an addition.
                    # Otherwise autograd still needs a tensor for the hook to fire: uninitialized
                    # memory that the hook drops unread.
                    if not getattr(weight, 'zero_out_wgrad', False):
                        grad_weight = torch.empty(
                            weight.shape, dtype=input.dtype, device=input.device
                        )
                    weight.grad_added_to_main_grad = True
            else:
                grad_weight = grad_output_2d.t().matmul(total_input_2d)  # [o, h]
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0) if use_bias else None

        if handle is not None:
            handle.wait()
        if ctx.sequence_parallel:
            return sub_grad_input, grad_weight, grad_bias, None, None, None, None, None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    async_grad_allreduce: Optional[bool] = None,
    sequence_parallel: bool = False,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0,
    allreduce_dgrad: Optional[bool] = None,
    tp_group=None,
) -> torch.Tensor:
    """Linear layer with the tensor parallel input communication (see
    LinearWithGradAccumulationAndAsyncCommunication).

    Args:
        input: [s, b, h] (or [s/tp, b, h] with sequence_parallel).
        weight: [o, h] this rank's partition.
        bias: [o] or None.
        gradient_accumulation_fusion: accumulate the weight gradient into weight.main_grad.
        async_grad_allreduce: deprecated name of allreduce_dgrad.
        sequence_parallel: all-gather the input (forward) / reduce-scatter its gradient.
        grad_output_buffer: if given, store grad Y and skip the weight gradient.
        wgrad_deferral_limit: accepted for API compatibility.
        allreduce_dgrad: all-reduce the input gradient over tp.
        tp_group: tensor parallel group (default: the global one).
    """
    if allreduce_dgrad is None:
        allreduce_dgrad = bool(async_grad_allreduce)
    if sequence_parallel and allreduce_dgrad:
        raise ValueError('allreduce_dgrad and sequence_parallel cannot both be True')
    # Fall back to the global tensor model parallel group when none is given.
    tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
    return apply_function(
        LinearWithGradAccumulationAndAsyncCommunication,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        tp_group,
    )


linear_with_grad_accumulation_and_async_allreduce.warned = False


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    async_grad_allreduce: Optional[bool] = None,
    sequence_parallel: bool = False,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = None,
    allreduce_dgrad: Optional[bool] = None,
    tp_group=None,
) -> torch.Tensor:
    """Y = X A^T + b for a weight that takes no gradient (Megatron's signature).

    Only the weight is kept for the backward (not the input), and no weight gradient is
    computed. With sequence_parallel the input is all-gathered along the sequence first
    ([s/tp, b, h] -> [s, b, h]; backward: reduce-scatter of its gradient); otherwise the input
    gradient is all-reduced over tp when `allreduce_dgrad`.

    Args:
        input: [s, b, h] (or [s/tp, b, h] with sequence_parallel).
        weight: [o, h] this rank's partition.
        bias: [o] or None.
        gradient_accumulation_fusion: unused (no weight gradient); keeps the API of
            linear_with_grad_accumulation_and_async_allreduce.
        async_grad_allreduce: deprecated name of allreduce_dgrad.
        sequence_parallel: all-gather the input along the first dim.
        grad_output_buffer: must be None (deferred weight gradients need a weight gradient).
        wgrad_deferral_limit: unused, for API parity.
        allreduce_dgrad: all-reduce the input gradient over tp.
        tp_group: tensor parallel group (default: the global one).
    """
    if grad_output_buffer is not None:
        raise ValueError(
            'grad_output_buffer (deferred embedding weight gradients) needs a trainable weight; '
            'use linear_with_grad_accumulation_and_async_allreduce'
        )
    if allreduce_dgrad is None:
        allreduce_dgrad = bool(async_grad_allreduce)
    # Fall back to the global tensor model parallel group when none is given.
    tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(
            input, tensor_parallel_output_grad=True, group=tp_group
        )  # [s, b, h]
        allreduce_dgrad = False  # the gather's backward already reduce-scatters the gradient
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, tp_group)


class ColumnParallelLinear(torch.nn.Module):
    """Linear layer Y = XA + b with A split along its output (column) dimension.

    A = [A_1, ..., A_tp]: the weight [o, h] is split along dim 0, rank r holding [o/tp, h]
    (and the bias [o/tp]); rank r computes Y_r = X A_r + b_r, [s, b, h] -> [s, b, o/tp].
    Communication:
      - default: forward identity (copy_to_tensor_model_parallel_region), backward all-reduce
        of grad X over tp;
      - sequence_parallel: forward all-gather of X along the sequence ([s/tp, b, h] ->
        [s, b, h]), backward reduce-scatter of grad X along the sequence;
      - gather_output: the output is all-gathered along the last dim ([s, b, o]; backward split).

    Args:
        input_size: h.
        output_size: o (divisible by the tp size).
        config: ModelParallelConfig.
        init_method: weight init.
        bias: add a bias.
        gather_output: all-gather the output so every rank gets Y.
        stride: interleaving of the split (for fused weights), see _initialize_affine_weight_cpu.
        keep_master_weight_for_test: keep the CPU master weight in `self.master_weight`.
        skip_bias_add: return the bias instead of adding it (for fusion with the next op).
        skip_weight_param_allocation: no weight parameter; forward takes `weight`.
        embedding_activation_buffer / grad_output_buffer: deferred output-layer wgrad
            (defer_embedding_wgrad_compute): inputs and output gradients are stored there.
        is_expert: an MoE expert layer (expert RNG stream, no tp communication when tp/ep > 1).
        tp_comm_buffer_name: the layer's name in Transformer Engine's userbuffers configuration
            (`qkv`, `proj`, `fc1`, `fc2`), which may choose its --tp-comm-overlap pipelines.
        disable_grad_reduce: skip the all-reduce of grad X (the caller reduces it).
        tp_group: tensor parallel group (default: the global one).
    """

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias=True,
        gather_output=False,
        stride=1,
        keep_master_weight_for_test=False,
        skip_bias_add=False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[List[torch.Tensor]] = None,
        grad_output_buffer: Optional[List[torch.Tensor]] = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str = None,
        disable_grad_reduce: bool = False,
        tp_group=None,
    ):
        super().__init__()
        self.config, self.input_size, self.output_size = config, input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        # Expert layers: their weights are split over the expert group, not all-reduced.
        self.is_expert, self.expert_parallel = is_expert, config.expert_model_parallel_size > 1
        # Deferred embedding weight gradient (defer_embedding_wgrad_compute) buffers.
        self.embedding_activation_buffer, self.grad_output_buffer = (
            embedding_activation_buffer,
            grad_output_buffer,
        )
        self.disable_grad_reduce = disable_grad_reduce
        self.tp_comm_buffer_name = tp_comm_buffer_name

        # Fall back to the global tensor model parallel group when none is given.
        self.tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
        world_size = self.tp_group.size()
        rank = self.tp_group.rank()
        self.explicit_expert_comm = self.is_expert and (world_size > 1 or self.expert_parallel)
        if output_size % world_size != 0:
            raise ValueError(
                f'output_size ({output_size}) must be divisible by the tensor parallel size '
                f'({world_size})'
            )
        self.output_size_per_partition = divide(output_size, world_size)

        if not skip_weight_param_allocation:
            self.weight, master = _partitioned_weight(
                config,
                (self.output_size, self.input_size),
                0,
                init_method,
                rank=rank,
                world_size=world_size,
                stride=stride,
                expert_parallel=self.is_expert and self.expert_parallel,
                keep_master=keep_master_weight_for_test,
            )
            if master is not NO_MASTER:
                self.master_weight = master
            setattr(self.weight, 'allreduce', not (self.is_expert and self.expert_parallel))
        else:
            self.weight = None

        if bias:
            self.bias = _zero_bias(config, self.output_size_per_partition)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            self.bias.allreduce = not (self.is_expert and self.expert_parallel)
        else:
            self.register_parameter('bias', None)

        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel and world_size <= 1:
            warnings.warn(
                '`sequence_parallel` is set to `True`, but tensor model parallel size is '
                f'{world_size}. Disabling sequence parallel.'
            )
            self.sequence_parallel = False

        self.allreduce_dgrad = (
            world_size > 1 and not self.sequence_parallel and not self.disable_grad_reduce
        )
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if self.allreduce_dgrad and self.sequence_parallel:
            raise RuntimeError(
                'allreduce_dgrad and sequence_parallel cannot be enabled at the same time.'
            )
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None):
        """[s, b, h] (or [s/tp, b, h] with sequence parallel) -> ([s, b, o/tp] or [s, b, o], bias).

        Args:
            input_: the input.
            weight: the weight when the layer was built with skip_weight_param_allocation.

        Returns:
            (output, output_bias); output_bias is the bias when skip_bias_add, else None.
        """
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    'weight was not supplied to ColumnParallelLinear forward pass '
                    'and skip_weight_param_allocation is True.'
                )
            weight = self.weight
        else:
            expected_shape = (self.output_size_per_partition, self.input_size)
            if weight.shape != expected_shape:
                raise RuntimeError(
                    f'supplied weight\'s shape is {tuple(weight.shape)}, not {expected_shape} as '
                    'expected'
                )

        if self.config._cpu_offloading_context is not None:
            if self.config._cpu_offloading_context.inside_context is True:
                assert self.config.cpu_offloading is False, (
                    'CPU Offloading cannot be enabled while using non-TE modules'
                )

        bias = None if self.skip_bias_add else self.bias
        # The linear function itself all-reduces grad X (allreduce_dgrad) or gathers the
        # sequence; expert layers communicate on their own; otherwise the copy to the tp region
        # gives the backward all-reduce.
        linear_communicates = self.allreduce_dgrad or self.sequence_parallel
        if linear_communicates or self.explicit_expert_comm or self.disable_grad_reduce:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)

        if (
            self.config.defer_embedding_wgrad_compute
            and self.embedding_activation_buffer is not None
        ):
            self.embedding_activation_buffer.append(input_parallel)

        if not weight.requires_grad:
            self._forward_impl = linear_with_frozen_weight
        else:
            self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

        if weight.requires_grad and not self.explicit_expert_comm and self._overlaps_gather():
            # --tp-comm-overlap: the sequence all-gather pipelined with the GEMM.
            output_parallel = AllGatherMatmul.apply(
                input_parallel,
                weight,
                bias,
                self.gradient_accumulation_fusion,
                layer_overlap(self.config, self.tp_comm_buffer_name),
                self.tp_group,
            )
        else:
            output_parallel = self._forward_impl(
                input=input_parallel,
                weight=weight,
                bias=bias,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                allreduce_dgrad=False if self.explicit_expert_comm else self.allreduce_dgrad,
                sequence_parallel=False if self.explicit_expert_comm else self.sequence_parallel,
                grad_output_buffer=self.grad_output_buffer
                if self.config.defer_embedding_wgrad_compute
                else None,
                tp_group=self.tp_group,
            )
        if self.gather_output:
            assert not self.sequence_parallel
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias

    def _overlaps_gather(self) -> bool:
        """--tp-comm-overlap applies: a sequence-parallel input gathered by this layer (not a
        deferred embedding weight gradient, which keeps the plain path)."""
        return not self.config.defer_embedding_wgrad_compute and overlaps_all_gather(
            self.config, self.sequence_parallel, self.tp_group, self.tp_comm_buffer_name
        )

    def set_extra_state(self, state: Any):
        """Extra state is ignored (the key exists for Transformer Engine state-dict
        compatibility)."""

    def get_extra_state(self) -> None:
        """Keep compatibility with Transformer Engine state dicts (`._extra_state` keys)."""
        return None

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint: weight and bias split over TP along the output (dim 0)."""
        from megatron.core.dist_checkpointing.utils import module_sharded_state_dict

        return module_sharded_state_dict(
            self, prefix, sharded_offsets, metadata, {'weight': 0, 'bias': 0}
        )


class RowParallelLinear(torch.nn.Module):
    """Linear layer Y = XA + b with A split along its input (row) dimension.

    A = [A_1; ...; A_tp] and X = [X_1, ..., X_tp]: the weight [o, h] is split along dim 1, rank r
    holding [o, h/tp]; rank r computes the partial sum X_r A_r, [s, b, h/tp] -> [s, b, o].
    Communication:
      - input_is_parallel=False: X is first split along its last dim (backward all-gather);
      - default: the partial outputs are all-reduced over tp (backward identity);
      - sequence_parallel: they are reduce-scattered along the sequence instead
        ([s, b, o] -> [s/tp, b, o]; backward all-gather).
    The bias [o] is replicated and added after the reduction; under sequence parallelism it
    carries `sequence_parallel = True` (its gradient is reduced over tp by finalize_model_grads).

    Args:
        input_size: h (divisible by the tp size).
        output_size: o.
        config: ModelParallelConfig.
        init_method: weight init.
        bias: add a bias.
        input_is_parallel: the input is already split along its last dim (e.g. the output of
            a ColumnParallelLinear); required with sequence_parallel.
        skip_bias_add: return the bias instead of adding it.
        stride: interleaving of the split, see _initialize_affine_weight_cpu.
        keep_master_weight_for_test: keep the CPU master weight in `self.master_weight`.
        is_expert: an MoE expert layer (no tp communication when tp/ep > 1).
        tp_comm_buffer_name: the layer's name in Transformer Engine's userbuffers configuration
            (`qkv`, `proj`, `fc1`, `fc2`), which may choose its --tp-comm-overlap pipelines.
        tp_group: tensor parallel group (default: the global one).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str = None,
        tp_group=None,
    ):
        super().__init__()
        self.config, self.input_size, self.output_size = config, input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.is_expert, self.expert_parallel = is_expert, config.expert_model_parallel_size > 1
        self.sequence_parallel = config.sequence_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if self.sequence_parallel and not self.input_is_parallel:
            raise ValueError('To enable `sequence_parallel`, `input_is_parallel` must be `True`')

        # Fall back to the global tensor model parallel group when none is given.
        self.tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
        world_size = self.tp_group.size()
        rank = self.tp_group.rank()
        self.explicit_expert_comm = self.is_expert and (world_size > 1 or self.expert_parallel)
        if input_size % world_size != 0:
            raise ValueError(
                f'input_size ({input_size}) must be divisible by the tensor parallel size '
                f'({world_size})'
            )
        self.input_size_per_partition = divide(input_size, world_size)

        self.weight, master = _partitioned_weight(
            config,
            (self.output_size, self.input_size),
            1,
            init_method,
            rank=rank,
            world_size=world_size,
            stride=stride,
            expert_parallel=self.is_expert and self.expert_parallel,
            keep_master=keep_master_weight_for_test,
        )
        if master is not NO_MASTER:
            self.master_weight = master
        setattr(self.weight, 'allreduce', not (self.is_expert and self.expert_parallel))

        if bias:
            # Replicated over tp; under SP each rank's gradient covers its own tokens only, so
            # finalize_model_grads reduces it over tp (the `sequence_parallel` mark).
            self.bias = _zero_bias(config, self.output_size)
            self.bias.allreduce = not (self.is_expert and self.expert_parallel)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter('bias', None)

        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_: torch.Tensor):
        """[s, b, h/tp] (or [s, b, h] if not input_is_parallel) -> ([s, b, o] or [s/tp, b, o],
        bias).

        Returns:
            (output, output_bias); output_bias is the bias when skip_bias_add, else None.
        """
        if self.config._cpu_offloading_context is not None:
            if self.config._cpu_offloading_context.inside_context is True:
                assert self.config.cpu_offloading is False, (
                    'CPU Offloading cannot be enabled while using non-TE modules'
                )

        if self.input_is_parallel:
            input_parallel = input_
        else:
            assert not self.sequence_parallel
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)

        if not self.weight.requires_grad:
            self._forward_impl = linear_with_frozen_weight
        else:
            self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

        overlap = (
            self.weight.requires_grad
            and not self.explicit_expert_comm
            and overlaps_reduce_scatter(
                self.config, self.sequence_parallel, self.tp_group, self.tp_comm_buffer_name
            )
        )
        if overlap:
            # --tp-comm-overlap: the GEMM and the sequence reduce-scatter in one pipeline.
            output_parallel = MatmulReduceScatter.apply(
                input_parallel, self.weight, self.gradient_accumulation_fusion, self.tp_group
            )
        else:
            output_parallel = self._forward_impl(
                input=input_parallel,
                weight=self.weight,
                bias=None,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                allreduce_dgrad=False,
                sequence_parallel=False,
                grad_output_buffer=None,
                tp_group=self.tp_group,
            )

        # All-reduce (or reduce-scatter along the sequence) the partial outputs across tp.
        if overlap:
            output_ = output_parallel
        elif self.explicit_expert_comm:
            assert self.skip_bias_add
            output_ = output_parallel
        elif self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(
                output_parallel, group=self.tp_group
            )
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        if self.skip_bias_add:
            return output_, self.bias  # the caller adds it (fused with what follows)
        return (output_ if self.bias is None else output_ + self.bias), None

    def set_extra_state(self, state: Any):
        """Extra state is ignored (the key exists for Transformer Engine state-dict
        compatibility)."""

    def get_extra_state(self) -> None:
        """Keep compatibility with Transformer Engine state dicts (`._extra_state` keys)."""
        return None

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint: weight split over TP along the input (dim 1); the bias
        (added after the all-reduce) is replicated."""
        from megatron.core.dist_checkpointing.utils import module_sharded_state_dict

        return module_sharded_state_dict(self, prefix, sharded_offsets, metadata, {'weight': 1})
