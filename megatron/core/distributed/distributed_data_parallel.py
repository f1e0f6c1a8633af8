"""DistributedDataParallel: data parallelism through contiguous, bucketed gradient buffers.

Unlike `torch.nn.parallel.DistributedDataParallel`, gradient reduction is not automatic at the end
of backward: the training loop (or `finalize_model_grads`) calls `finish_grad_sync()` once all
microbatches of an iteration have run backward. Between microbatches `no_sync()` suppresses the
overlapped reductions so gradients simply accumulate in `param.main_grad`.
"""

import logging
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch

from .. import group_fallbacks, parallel_state
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_and_grad_buffer import ParamAndGradBuffer

logger = logging.getLogger(__name__)


def _get_expert_data_parallel_group():
    """Data-parallel group for expert (non all-reduced) parameters."""
    return parallel_state.get_data_modulo_expert_parallel_group(with_context_parallel=True)


class DistributedDataParallel(torch.nn.Module):
    """Wraps a module so its gradients are accumulated in a flat buffer and reduced over DP.

    Every trainable parameter gets `param.main_grad`, a view into a contiguous gradient buffer
    (fp32 if `ddp_config.grad_reduce_in_fp32`, else the parameter dtype). A post-accumulate-grad
    hook on each parameter adds `param.grad` into `param.main_grad` and frees `param.grad`. With
    `overlap_grad_reduce`, a bucket's all-reduce (reduce-scatter with the distributed optimizer)
    starts asynchronously as soon as every parameter in it has its gradient, on the last microbatch
    (outside `no_sync()`). Gradients are averaged over the data-parallel group (with context
    parallelism: the data-and-context-parallel group).

    Args:
        config: the model's config (TransformerConfig / ModelParallelConfig); kept as `self.config`.
        ddp_config: DistributedDataParallelConfig.
        module: the model chunk to wrap.
        disable_bucketing: force a single bucket per buffer (e.g. for all but the first virtual
            pipeline chunk, as Megatron does).
        data_parallel_group: group to reduce over; None means parallel_state's
            data-parallel-with-context-parallel group.
    """

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        data_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module

        # Fallback: the global data-parallel group (context-parallel ranks also hold replicas).
        data_parallel_group = group_fallbacks.get_data_parallel_group_if_none(
            data_parallel_group, with_context_parallel=True
        )
        self.data_parallel_group = data_parallel_group
        dp_size = torch.distributed.get_world_size(group=data_parallel_group)

        # The effective bucket size is derived here; ddp_config itself is never modified.
        bucket_size = ddp_config.bucket_size
        if bucket_size is None:
            bucket_size = max(40000000, 1000000 * dp_size)
        # Without overlap there is nothing to gain from several buckets.
        if not ddp_config.overlap_grad_reduce:
            bucket_size = None
        if disable_bucketing:
            bucket_size = None
        self.bucket_size = bucket_size

        self.param_to_name: Dict[torch.nn.Parameter, str] = {}
        dense_params: List[torch.nn.Parameter] = []
        expert_parallel_params: List[torch.nn.Parameter] = []
        for name, param in self.module.named_parameters():
            if not param.requires_grad:
                continue
            param.grad_added_to_main_grad = False
            self.param_to_name[param] = name
            if getattr(param, "allreduce", True):
                dense_params.append(param)
            else:
                expert_parallel_params.append(param)

        def allocate_buffers_for_parameters(input_params, group, gradient_scaling_factor):
            param_and_grad_dtype_to_params: Dict[tuple, List[torch.nn.Parameter]] = {}
            for param in input_params:
                param_dtype = param.dtype
                grad_dtype = torch.float if ddp_config.grad_reduce_in_fp32 else param.dtype
                param_and_grad_dtype_to_params.setdefault((param_dtype, grad_dtype), []).append(
                    param
                )
            buffers = []
            for (param_dtype, grad_dtype), params in param_and_grad_dtype_to_params.items():
                buffers.append(
                    ParamAndGradBuffer(
                        ddp_config,
                        param_dtype,
                        grad_dtype,
                        params,
                        group,
                        self.bucket_size,
                        self.param_to_name,
                        gradient_scaling_factor,
                    )
                )
                for param in params:
                    self.param_to_buffer[param] = buffers[-1]
            return buffers

        self.param_to_buffer: Dict[torch.nn.Parameter, ParamAndGradBuffer] = {}
        if ddp_config.average_in_collective:
            gradient_scaling_factor = 1.0
            expert_gradient_scaling_factor = 1.0
        else:
            gradient_scaling_factor = 1.0 / dp_size
            expert_gradient_scaling_factor = gradient_scaling_factor
        if getattr(config, "calculate_per_token_loss", False):
            # Losses are summed over tokens and divided by the global token count later.
            gradient_scaling_factor = 1.0
            expert_gradient_scaling_factor = 1.0

        # Megatron names these attributes `buffers` / `expert_parallel_buffers` (shadowing
        # nn.Module.buffers on this wrapper); get_megatron_optimizer reads them.
        self.buffers = allocate_buffers_for_parameters(
            dense_params, data_parallel_group, gradient_scaling_factor
        )
        self.expert_data_parallel_group = None
        self.expert_parallel_buffers = []
        if expert_parallel_params:
            self.expert_data_parallel_group = _get_expert_data_parallel_group()
            expert_dp_size = torch.distributed.get_world_size(group=self.expert_data_parallel_group)
            # An expert's gradient already sums the tokens of its expert-parallel group (other
            # data-parallel replicas), so its sum over the expert-data-parallel group covers all
            # dp replicas: it is scaled by 1 / dp like a dense gradient (an average over the
            # expert-data-parallel group, then 1 / ep, with average_in_collective).
            if ddp_config.average_in_collective and not getattr(
                config, "calculate_per_token_loss", False
            ):
                expert_gradient_scaling_factor = expert_dp_size / dp_size
            self.expert_parallel_buffers = allocate_buffers_for_parameters(
                expert_parallel_params,
                self.expert_data_parallel_group,
                expert_gradient_scaling_factor,
            )

        # Backward hooks: move param.grad into main_grad, and signal readiness for overlap.
        self.grad_accs = []
        for param in self.module.parameters():
            if param.requires_grad:
                handle = param.register_post_accumulate_grad_hook(self._make_param_hook(param))
                self.grad_accs.append(handle)

        # With the distributed optimizer's overlap_param_gather, parameter all-gathers run in the
        # background after the optimizer step; each submodule waits, just before its forward,
        # for the gathers of the buckets holding its own parameters.
        self.param_to_bucket = {}
        for buffer in self.buffers + self.expert_parallel_buffers:
            self.param_to_bucket.update(buffer.param_to_bucket)
        self.forward_pre_hook_handles = []
        if ddp_config.use_distributed_optimizer:
            for module in self.module.modules():
                if any(p in self.param_to_bucket for p in module.parameters(recurse=False)):
                    self.forward_pre_hook_handles.append(
                        module.register_forward_pre_hook(self._make_forward_pre_hook())
                    )

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module."""
        return self.module(*inputs, **kwargs)

    def _make_param_hook(self, param: torch.nn.Parameter):
        """The hook run after autograd has accumulated a gradient into `param.grad`."""
        param_to_buffer = self.param_to_buffer
        overlap = self.ddp_config.overlap_grad_reduce

        def param_hook(*unused):
            if param.requires_grad:
                if overlap:
                    assert param.grad is not None, (
                        "param.grad being None is not safe when overlap_grad_reduce is True"
                    )
                if param.grad is not None and (
                    not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)
                ):
                    param.main_grad.add_(param.grad.data)
                param.grad = None
                if overlap:
                    param_to_buffer[param].register_grad_ready(param)

        return param_hook

    def _make_forward_pre_hook(self):
        """Hook that finishes the param all-gathers of the module's own parameters' buckets."""

        def hook(module, *unused):
            for param in module.parameters(recurse=False):
                bucket = self.param_to_bucket.get(param)
                if bucket is not None and bucket.param_gather_handle is not None:
                    bucket.finish_param_sync()

        return hook

    def start_param_sync(self, *unused, async_op: bool = False):
        """All-gather the updated parameter shards (distributed optimizer); async if asked."""
        for buffer in self._all_buffers():
            buffer.start_param_sync(async_op=async_op)

    def finish_param_sync(self, *unused):
        """Wait for all outstanding parameter all-gathers (before reading the parameters)."""
        for buffer in self._all_buffers():
            if buffer.param_data is not None:
                buffer.finish_param_sync()

    def _all_buffers(self):
        return self.buffers + self.expert_parallel_buffers

    @contextmanager
    def no_sync(self):
        """Context manager that turns off gradient synchronization (non-last microbatches)."""
        for buffer in self._all_buffers():
            buffer.is_last_microbatch = False
        try:
            yield
        finally:
            for buffer in self._all_buffers():
                buffer.is_last_microbatch = True

    def start_grad_sync(self, *unused):
        """Start the gradient reduction of every bucket (async with overlap_grad_reduce)."""
        for buffer in self._all_buffers():
            buffer.start_grad_sync()

    def finish_grad_sync(self):
        """Finish the gradient reduction of every bucket.

        Without overlap this issues the (synchronous) collectives; with overlap it waits for the
        ones the backward hooks started. Afterwards `param.main_grad` holds the DP-averaged
        gradient (with the distributed optimizer: only this rank's shard is reduced).
        """
        for buffer in self._all_buffers():
            buffer.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient in the buffers by `scaling_factor`."""
        for buffer in self._all_buffers():
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self):
        """Zero every gradient buffer and reset the buckets; call at the start of each iteration."""
        for param in self.module.parameters():
            if param.requires_grad:
                param.grad_added_to_main_grad = False
                # An optimizer may have left `.grad` aliasing main_grad; the next backward must
                # start from None or the hook would add the buffer into itself.
                param.grad = None
        for buffer in self._all_buffers():
            buffer.reset()

    def broadcast_params(self):
        """Make all data-parallel replicas equal to the first rank's parameters."""
        for param in self.module.parameters():
            is_expert_parallel = not getattr(param, "allreduce", True)
            group = (
                self.expert_data_parallel_group if is_expert_parallel else self.data_parallel_group
            )
            if torch.distributed.get_world_size(group=group) == 1:
                continue
            src = torch.distributed.get_global_rank(group, 0)
            torch.distributed.broadcast(param.data, src=src, group=group)

    def state_dict(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state dict (no `module.` prefix)."""
        self.finish_param_sync()
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's checkpoint state dict."""
        self.finish_param_sync()
        if hasattr(self.module, "state_dict_for_save_checkpoint"):
            return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped module (parameters keep their buffer views: copied in place)."""
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, *args, **kwargs):
        """The wrapped module's sharded state dict, when it provides one."""
        return self.module.sharded_state_dict(*args, **kwargs)
