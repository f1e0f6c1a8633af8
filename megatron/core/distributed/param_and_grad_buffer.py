"""Contiguous parameter and gradient buffers for data parallelism, split into buckets.

Every parameter of a `DistributedDataParallel` module gets a `.main_grad` attribute that is a view
into one flat gradient buffer (one buffer per (param dtype, grad dtype) pair). Backward hooks add
each `param.grad` into its `main_grad` and free `param.grad`. The buffer is split into buckets (in
reverse parameter order, which approximates the order in which backward produces gradients); a
bucket's data-parallel reduction is one collective on its contiguous slice:

- plain DDP: all-reduce of the bucket over the data-parallel group;
- distributed optimizer: reduce-scatter of the bucket, each data-parallel rank receiving the
  reduced 1/DP shard it owns (buckets are padded so their size divides by DP). A parameter buffer
  of the same layout is then allocated and the parameters' `.data` become views into it, so that
  after the optimizer step an all-gather of each bucket's parameter shards updates the model.

Gradients are scaled by `gradient_scaling_factor` (1 / DP for averaging) before the reduction.
"""

import logging
import math
from enum import Enum
from typing import Dict, List, Optional

import torch

from ..utils import get_current_device
from .distributed_data_parallel_config import DistributedDataParallelConfig

logger = logging.getLogger(__name__)


class BufferType(Enum):
    """Which of a `ParamAndGradBuffer`'s flat tensors a view refers to."""

    PARAM = 1
    GRAD = 2


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> List[torch.Tensor]:
    """Split a 1-D buffer into `data_parallel_world_size` equal contiguous views (rank order)."""
    assert buffer.numel() % data_parallel_world_size == 0
    shard_size = buffer.numel() // data_parallel_world_size
    return [buffer[r * shard_size : (r + 1) * shard_size] for r in range(data_parallel_world_size)]


def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group, async_op=False):
    """All-gather equal shards into one flat tensor (rank order), using the non-deprecated API."""
    gather = getattr(torch.distributed, "all_gather_single", None)
    if gather is None:  # older torch
        gather = torch.distributed.all_gather_into_tensor
    return gather(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input_: torch.Tensor, op, group, async_op=False):
    """Reduce a flat tensor and scatter equal shards (rank order), using the non-deprecated API."""
    scatter = getattr(torch.distributed, "reduce_scatter_single", None)
    if scatter is None:  # older torch
        scatter = torch.distributed.reduce_scatter_tensor
    return scatter(output, input_, op=op, group=group, async_op=async_op)


class GradSyncNotIssuedError(RuntimeError, AssertionError):
    """finish_grad_sync() with overlap_grad_reduce before the bucket's reduction was started.

    Megatron r0.8 asserts here, so this is also an AssertionError for library code catching it.
    """


class Bucket:
    """A contiguous group of parameters whose gradients are reduced by one collective.

    Args:
        ddp_config: DistributedDataParallel configuration.
        params: parameters whose gradients live in this bucket.
        param_data: view of the parameter buffer for this bucket (distributed optimizer), or None.
        grad_data: view of the gradient buffer for this bucket.
        offset: start of this bucket in the full buffer.
        numel_unpadded: number of elements in the bucket without end padding.
        data_parallel_group: group the gradients are reduced over.
        data_parallel_world_size: size of that group.
        gradient_scaling_factor: gradients are multiplied by this before the reduction
            (1 / DP to average, 1.0 to sum or when the collective averages).
    """

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        params: List[torch.nn.Parameter],
        param_data: Optional[torch.Tensor],
        grad_data: torch.Tensor,
        offset: int,
        numel_unpadded: int,
        data_parallel_group: torch.distributed.ProcessGroup,
        data_parallel_world_size: int,
        gradient_scaling_factor: float,
    ):
        self.ddp_config = ddp_config
        # The bucket's params in buffer order, and as a set for "is this one mine" checks;
        # params_with_grad fills up as their gradients become ready.
        self.params_list, self.params, self.params_with_grad = params, set(params), set()
        # Views into the model-wide buffers; `offset` is where the bucket starts in them.
        self.param_data, self.grad_data, self.offset = param_data, grad_data, offset
        self.numel_unpadded = numel_unpadded
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_world_size
        self.data_parallel_rank = torch.distributed.get_rank(group=data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        # Outstanding async all-gather of this bucket's parameters (distributed optimizer with
        # overlap_param_gather), waited for before the bucket's params are used.
        self.param_gather_handle = None
        self.reset()

    def reset(self):
        """Forget which gradients are ready and any outstanding communication (next iteration)."""
        self.params_with_grad = set()
        self.communication_handle = None
        self.communication_issued = False
        self._synced_by_finish = False

    def _check_grads(self):
        """Validate the bucket's local gradient norm before the data-parallel collective: NaN
        and Inf are fatal (tolerance 0.001 between reruns: attention backward is not
        deterministic), a large norm (`check_for_large_grads`) is not."""
        from functools import partial

        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine = get_rerun_state_machine()
        norm = self.grad_data.norm(p=2)
        where = (
            f"bucket at offset {self.offset} ({self.grad_data.numel()} elements) in backward "
            "pass before data-parallel communication collective"
        )
        checks = (("NaN", torch.isnan), ("Inf", torch.isinf))
        for name, rejection in checks if self.ddp_config.check_for_nan_in_grad else ():
            machine.validate_result(
                result=norm,
                rejection_func=rejection,
                message=f"found {name} in local grad norm for {where}",
                tolerance=0.001,
                fatal=True,
            )
        if self.ddp_config.check_for_large_grads:
            machine.validate_result(
                result=norm,
                rejection_func=partial(
                    machine.is_unexpectedly_large, threshold=10, context="grads"
                ),
                message=f"found unexpected large grads in {where}",
                tolerance=0.001,
                fatal=False,
            )

    def start_grad_sync(self):
        """Start the bucket's data-parallel reduction (async if `overlap_grad_reduce`).

        All-reduce of the whole bucket, or, with the distributed optimizer, reduce-scatter into
        this rank's shard of the bucket.
        """
        assert self.communication_handle is None and not self.communication_issued, (
            "Should not have multiple communication calls outstanding at once"
        )

        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self._check_grads()

        reduce_op = torch.distributed.ReduceOp.SUM
        if self.ddp_config.average_in_collective:
            reduce_op = torch.distributed.ReduceOp.AVG
        if self.gradient_scaling_factor != 1.0:
            self.grad_data *= self.gradient_scaling_factor

        async_op = self.ddp_config.overlap_grad_reduce
        if self.data_parallel_world_size == 1:
            self.communication_handle = None
        elif self.ddp_config.use_distributed_optimizer:
            local_data_view = shard_buffer(self.grad_data, self.data_parallel_world_size)[
                self.data_parallel_rank
            ]
            self.communication_handle = reduce_scatter_tensor(
                local_data_view,
                self.grad_data,
                op=reduce_op,
                group=self.data_parallel_group,
                async_op=async_op,
            )
        else:
            self.communication_handle = torch.distributed.all_reduce(
                self.grad_data, op=reduce_op, group=self.data_parallel_group, async_op=async_op
            )
        self.communication_issued = True

    def finish_grad_sync(self):
        """Finish the bucket's reduction.

        Without `overlap_grad_reduce` every call runs the (synchronous) collective, as Megatron
        r0.8 does, except right after an explicit `start_grad_sync()`, whose result stands. With
        it, waits for the reduction the last gradient's hook (or a schedule's grad_sync_func)
        started; calling it before every parameter's gradient is ready raises
        GradSyncNotIssuedError.
        """
        if not self.ddp_config.overlap_grad_reduce:
            if not self.communication_issued or self._synced_by_finish:
                self.communication_handle = None
                self.communication_issued = False
                self.start_grad_sync()
            self._synced_by_finish = True
            return
        if not self.communication_issued:
            raise GradSyncNotIssuedError(
                "Communication call has not been issued for this bucket "
                f"({len(self.params_with_grad)}/{len(self.params)} params have grad available); "
                "with overlap_grad_reduce every parameter in the module must receive a gradient "
                "on the last microbatch"
            )
        if self.communication_handle is not None:
            self.communication_handle.wait()
            self.communication_handle = None

    def start_param_sync(self, async_op: bool = False):
        """All-gather the bucket's parameter shards over DP into `param_data` (distributed
        optimizer).

        Each data-parallel rank contributes the shard it updated; with `async_op` the gather runs in
        the background until `finish_param_sync()`.
        """
        assert self.param_data is not None, "start_param_sync() needs the distributed optimizer"
        self.finish_param_sync()
        if self.data_parallel_world_size == 1:
            return
        local = shard_buffer(self.param_data, self.data_parallel_world_size)[
            self.data_parallel_rank
        ]
        if torch.distributed.get_backend(self.data_parallel_group) == "gloo":
            local = local.clone()  # gloo does not promise in-place (aliased) gathers
        self.param_gather_handle = all_gather_into_tensor(
            self.param_data, local, group=self.data_parallel_group, async_op=async_op
        )

    def finish_param_sync(self):
        """Wait for an outstanding parameter all-gather, if any."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None

    def register_grad_ready(self, param: torch.nn.Parameter):
        """Record that `param`'s gradient is accumulated; start the reduction once all are."""
        assert param in self.params, "Param is not in the bucket"
        assert param not in self.params_with_grad, "Cannot set grad twice"
        assert self.ddp_config.overlap_grad_reduce, (
            "register_grad_ready() should only be called with overlap"
        )
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()


class ParamAndGradBuffer:
    """Flat gradient buffer (and, for the distributed optimizer, parameter buffer) with buckets.

    Parameters are laid out in reverse order of `params`. A bucket closes once it holds
    `bucket_size` elements or more (None: one bucket). With the distributed optimizer every
    parameter starts at a multiple of 64 elements, each bucket's end is padded to a multiple of
    lcm(DP, 128) so every rank owns an equal, aligned shard, and a shared embedding weight has a
    bucket of its own (Megatron r0.8's layout, so the bucket sizes match its; see
    docs/differences.md for the one case where the shared weight's start differs).

    Args:
        ddp_config: DistributedDataParallel configuration.
        param_dtype: dtype of the parameters (and of the parameter buffer).
        grad_dtype: dtype of the gradient buffer.
        params: parameters to place in this buffer (all of `param_dtype`).
        data_parallel_group: group gradients are reduced over.
        bucket_size: approximate elements per bucket, or None for a single bucket.
        param_to_name: names of the parameters (for logging).
        gradient_scaling_factor: factor applied to gradients before the reduction.
    """

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: List[torch.nn.Parameter],
        data_parallel_group: torch.distributed.ProcessGroup,
        bucket_size: Optional[int],
        param_to_name: Dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
    ):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = torch.distributed.get_world_size(group=data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.is_last_microbatch = True

        unique_params = set()
        for param in params:
            assert param not in unique_params, "a parameter appears twice in a ParamAndGradBuffer"
            unique_params.add(param)

        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        # param -> (start index, end index, bucket id) in the flat buffers.
        self.param_index_map: Dict[torch.nn.Parameter, tuple] = {}
        # bucket id -> (start index, end index) in the flat buffers (end includes padding).
        self.bucket_indices: List[tuple] = []
        self.per_bucket_numel_unpadded: List[int] = []

        per_bucket_params = self._compute_layout(params, bucket_size)
        self.numel = self.bucket_indices[-1][1] if self.bucket_indices else 0
        self.numel_unpadded = sum(self.per_bucket_numel_unpadded)
        if self.ddp_config.use_distributed_optimizer:
            assert self.numel % self.data_parallel_world_size == 0
        self._allocate_and_point_params()
        self._build_buckets(per_bucket_params)
        self._log_buckets(param_to_name)

    def _compute_layout(
        self, params: List[torch.nn.Parameter], bucket_size: Optional[int]
    ) -> List[List[torch.nn.Parameter]]:
        """First pass: fill param_index_map, bucket_indices and per_bucket_numel_unpadded; return
        each bucket's parameters (Megatron r0.8's rule: in reverse parameter order a bucket closes
        once it holds >= bucket_size elements, padding between parameters included, and before
        and after a shared embedding weight)."""

        def _pad(number_to_be_padded: int, divisor: int) -> int:
            return int(math.ceil(number_to_be_padded / divisor) * divisor)

        def _pad_end_of_bucket_if_needed(bucket_end_index: int) -> int:
            if self.ddp_config.use_distributed_optimizer:
                # Equal shards per DP rank, 128-element aligned for efficient collectives.
                return _pad(bucket_end_index, math.lcm(self.data_parallel_world_size, 128))
            return bucket_end_index

        def _pad_start_of_param_if_needed(param_start_index: int) -> int:
            if self.ddp_config.use_distributed_optimizer:
                # Every parameter starts 64-element (128-byte for 16-bit values) aligned.
                return _pad(param_start_index, 64)
            return param_start_index

        def _does_param_require_new_bucket(param) -> bool:
            # With the distributed optimizer a shared embedding weight is alone in its bucket, so
            # the first and last pipeline stages shard its optimizer state the same way across DP
            # replicas (the DP reduce-scatter can then run before the embedding all-reduce).
            return (
                getattr(param, "shared_embedding", False)
                and self.ddp_config.use_distributed_optimizer
            )

        param_start_index = 0
        bucket_data_start_index = 0
        bucket_params: List[torch.nn.Parameter] = []
        bucket_id = 0
        per_bucket_params: List[List[torch.nn.Parameter]] = []

        def _close_bucket(data_end_index: int) -> int:
            nonlocal bucket_data_start_index, bucket_params, bucket_id
            self.per_bucket_numel_unpadded.append(data_end_index - bucket_data_start_index)
            data_end_index = _pad_end_of_bucket_if_needed(data_end_index)
            self.bucket_indices.append((bucket_data_start_index, data_end_index))
            per_bucket_params.append(bucket_params)
            bucket_data_start_index = data_end_index
            bucket_params = []
            bucket_id += 1
            return data_end_index

        param_end_index = 0
        for param in params[::-1]:
            if not param.requires_grad:
                continue
            param_start_index = _pad_start_of_param_if_needed(param_start_index)
            if _does_param_require_new_bucket(param) and len(bucket_params) > 0:
                # The parameters gathered so far close their bucket first, so the shared weight
                # starts its own bucket at a DP-aligned offset on every stage holding a copy.
                # Megatron r0.8 leaves the weight at this (64-aligned) start instead, inside the
                # previous bucket's end padding, where no optimizer shard owns it.
                param_start_index = _close_bucket(param_start_index)
            param_end_index = param_start_index + param.data.nelement()
            self.param_index_map[param] = (param_start_index, param_end_index, bucket_id)
            bucket_params.append(param)
            if (
                bucket_size is not None
                and (param_end_index - bucket_data_start_index) >= bucket_size
            ) or _does_param_require_new_bucket(param):
                param_start_index = _close_bucket(param_end_index)
            else:
                param_start_index = param_end_index
        if len(bucket_params) > 0:
            _close_bucket(param_end_index)
        return per_bucket_params

    def _allocate_and_point_params(self) -> None:
        """Allocate the flat buffers; point every parameter (and its main_grad) into them."""
        device = get_current_device()
        self.param_data = None
        if self.ddp_config.use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)

        for param, (start, end, _) in self.param_index_map.items():
            if self.param_data is not None:
                old_param_data = param.data
                param.data = self._get(param.data.shape, start, BufferType.PARAM)
                assert old_param_data._base is None
                param.data.detach().copy_(old_param_data)
                del old_param_data
            param.main_grad = self._get(param.data.shape, start, BufferType.GRAD)

    def _build_buckets(self, per_bucket_params: List[List[torch.nn.Parameter]]) -> None:
        """One Bucket per layout entry, over views of the flat buffers."""
        for bucket_id, ((start, end), bparams) in enumerate(
            zip(self.bucket_indices, per_bucket_params)
        ):
            bucket_param_data = None
            if self.param_data is not None:
                bucket_param_data = self._get(torch.Size([end - start]), start, BufferType.PARAM)
            bucket_grad_data = self._get(torch.Size([end - start]), start, BufferType.GRAD)
            bucket = Bucket(
                ddp_config=self.ddp_config,
                params=bparams,
                param_data=bucket_param_data,
                grad_data=bucket_grad_data,
                offset=start,
                numel_unpadded=self.per_bucket_numel_unpadded[bucket_id],
                data_parallel_group=self.data_parallel_group,
                data_parallel_world_size=self.data_parallel_world_size,
                gradient_scaling_factor=self.gradient_scaling_factor,
            )
            self.buckets.append(bucket)
            for param in bparams:
                assert param not in self.param_to_bucket
                self.param_to_bucket[param] = bucket

    def _log_buckets(self, param_to_name: Dict[torch.nn.Parameter, str]) -> None:
        """Log the buckets and their parameters (rank 0, INFO)."""
        if logger.isEnabledFor(logging.INFO) and torch.distributed.get_rank() == 0:
            lines = [
                f"Number of buckets for gradient all-reduce / reduce-scatter: {len(self.buckets)}"
            ]
            for index, bucket in enumerate(self.buckets):
                numel = sum(p.data.nelement() for p in bucket.params_list)
                lines.append(f"Params for bucket {index + 1} ({numel} elements):")
                lines += [f"    {param_to_name.get(p, '?')}" for p in bucket.params_list]
            logger.info("\n".join(lines))

    def _get(self, shape: torch.Size, start_index: int, buffer_type: BufferType) -> torch.Tensor:
        """A view of `shape` into the parameter or gradient buffer starting at `start_index`."""
        end_index = start_index + shape.numel()
        assert end_index <= self.numel, "Requested tensor is out of buffer range"
        storage = {BufferType.PARAM: self.param_data, BufferType.GRAD: self.grad_data}
        if buffer_type not in storage:
            raise ValueError(f"Illegal buffer type {buffer_type}")
        assert storage[buffer_type] is not None, "this buffer holds no parameter copy"
        return storage[buffer_type][start_index:end_index].view(shape)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient in the buffer by `scaling_factor`."""
        self.grad_data *= scaling_factor

    def reset(self):
        """Zero the gradient buffer and reset the buckets for the next iteration."""
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
        self.is_last_microbatch = True

    def start_grad_sync(self):
        """Start the reduction of every bucket not yet started (async with overlap_grad_reduce)."""
        for bucket in self.buckets:
            if not bucket.communication_issued:
                bucket.start_grad_sync()

    def finish_grad_sync(self):
        """Finish the reduction of every bucket (start it synchronously without overlap)."""
        for bucket in self.buckets:
            bucket.finish_grad_sync()

    def start_param_sync(self, async_op: bool = False):
        """All-gather every bucket's parameters (last bucket first: the forward needs it first)."""
        for bucket in reversed(self.buckets):
            bucket.start_param_sync(async_op=async_op)

    def finish_param_sync(self):
        """Wait for every outstanding parameter all-gather of this buffer."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    def register_grad_ready(self, param: torch.nn.Parameter):
        """Called by the backward hook when `param`'s gradient is in `main_grad` (overlap only)."""
        assert self.ddp_config.overlap_grad_reduce, (
            "register_grad_ready() should only be called with overlap"
        )
        if self.is_last_microbatch:
            self.param_to_bucket[param].register_grad_ready(param)
