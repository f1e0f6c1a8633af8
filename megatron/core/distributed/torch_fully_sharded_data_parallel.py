"""TorchFullyShardedDataParallel: fully sharded data parallelism on PyTorch's FSDP2 `fully_shard`.

Every data-parallel rank keeps only a dim-0 shard (`torch.chunk` over the data-parallel group) of
each parameter, of its gradient and, because the optimizer is built on those sharded parameters,
of the optimizer state. Parameters are grouped into FSDP units: each transformer layer, the input
embedding and the output layer (when it has its own weight), then the root module for whatever is
left (final norm, and the tied embedding/output weight). For a unit:

- forward: its parameters are all-gathered over the data-parallel group just before its forward
  (the next unit is prefetched) and freed again afterwards unless `reshard_after_forward` is off;
- backward: they are all-gathered again before the unit's backward; at the end of it the
  gradients are reduce-scattered (averaged) over the data-parallel group into the sharded
  `param.grad` (a DTensor).

Tensor parallelism composes by sharding each rank's tensor-parallel piece over the data-parallel
group of that tensor-parallel rank (the FSDP mesh is the data x context parallel group), so the
tensor-parallel collectives of the layers are unchanged. Gradient accumulation over micro-batches
reduces once, on the last micro-batch: `no_sync()` turns FSDP2's gradient synchronisation off,
so earlier micro-batches accumulate unsharded gradients locally.

HSDP (replicate x shard): given a replicate group and a shard group that tile the data-parallel
group (R instances of S contiguous ranks), the dense units get a 2-D mesh (R, S): parameters are
`(Replicate(), Shard(0))`, so a rank holds 1/S of each; gradients are reduce-scattered over the
shard group and then all-reduced over the replicate group.

Expert parallelism: each MoE layer's experts (parameters with `allreduce=False`) are a unit of
their own on a 1-D mesh over the expert-data-parallel group (the ranks holding the same experts),
wrapped before the layer that contains them; everything else is sharded over the full
data-parallel group. Their reduce-scatter sums over the expert-data-parallel group and divides
by the full data-parallel size, as DDP scales expert gradients.
"""

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .. import group_fallbacks, parallel_state
from ..device import get_current_device_type
from .sharded_tensors import register_mesh_groups

logger = logging.getLogger(__name__)

#: Python attributes other modules read from parameters; `fully_shard` replaces every parameter
#: by a new DTensor parameter, so these are copied onto the replacement.
PRESERVED_PARAM_ATTRIBUTES = (
    'tensor_model_parallel',
    'partition_dim',
    'partition_stride',
    'sequence_parallel',
    'allreduce',
    'shared',
    'shared_embedding',
    'zero_out_wgrad',
    'is_embedding_or_output_parameter',
    'average_gradients_across_tp_domain',
    'expert_tp',
)


@dataclass
class TorchFullyShardedDataParallelConfig:
    """Options of `TorchFullyShardedDataParallel`; read-only for the wrapper.

    Attributes:
        reshard_after_forward: free each unit's gathered parameters after its forward and gather
            them again for backward (ZeRO-3); False keeps them until backward (ZeRO-2-like
            memory for parameters, one all-gather fewer per unit).
        param_dtype: dtype the gathered parameters (and the units' floating-point inputs) are
            cast to for compute; None computes in the stored dtype.
        reduce_dtype: dtype of the gradient reduce-scatter; None reduces in `param_dtype`.
        output_dtype: dtype the root module's floating-point outputs are cast to (None: as
            computed).
    """

    reshard_after_forward: bool = True
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None


def _unit_modules(module: torch.nn.Module, tied: bool) -> List[torch.nn.Module]:
    """The submodules that become FSDP units, in forward order (pre-order traversal)."""
    from ..models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from ..tensor_parallel.layers import ColumnParallelLinear
    from ..transformer.transformer_layer import TransformerLayer

    units = []
    output_layer = getattr(_inner_model(module), 'output_layer', None)
    for sub in module.modules():
        if isinstance(sub, TransformerLayer):
            units.append(sub)
        elif isinstance(sub, LanguageModelEmbedding) and not tied:
            # A tied table is read by the output layer too: a parameter may belong to one unit
            # only, so it stays with the root (gathered for the whole forward and backward).
            units.append(sub)
        elif sub is output_layer and isinstance(sub, ColumnParallelLinear) and not tied:
            units.append(sub)
    return units


def _expert_modules(module: torch.nn.Module) -> List[torch.nn.Module]:
    """Each MoE layer's experts whose parameters are expert-parallel (`allreduce=False`)."""
    from ..transformer.moe.moe_layer import BaseMoELayer

    experts = []
    for sub in module.modules():
        if isinstance(sub, BaseMoELayer) and sub.experts is not None:
            params = list(sub.experts.parameters())
            if params and not any(getattr(p, 'allreduce', True) for p in params):
                experts.append(sub.experts)
    return experts


def _inner_model(module: torch.nn.Module) -> torch.nn.Module:
    """The language model under any Float16Module-style `.module` wrappers."""
    while hasattr(module, 'module') and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


class TorchFullyShardedDataParallel(torch.nn.Module):
    """Wraps a model chunk in FSDP2 (`torch.distributed.fsdp.fully_shard`), Megatron's name.

    Weights: every parameter becomes a DTensor sharded on dim 0 over the data-parallel (x
    context-parallel) group (HSDP: over the shard group, replicated across the replicate
    group; experts: over the expert-data-parallel group); tensor-parallel parameters are this
    rank's TP piece, sharded again.
    Collectives: all-gather per unit (over its shard group) before forward and before backward;
    reduce-scatter of the gradients per unit at the end of its backward, then under HSDP an
    all-reduce over the replicate group (once per step: `no_sync()` for the other
    micro-batches). With `calculate_per_token_loss`, `finalize_model_grads` divides the summed
    gradients by the global token count through `scale_gradients`.

    Args:
        config: the model's TransformerConfig (kept as `self.config`).
        ddp_config: the DistributedDataParallelConfig of the run (kept for the training loop;
            only `grad_reduce_in_fp32` and `average_in_collective` have a meaning here, handled
            through `fsdp_config.reduce_dtype` by the caller).
        module: the model chunk (a GPTModel, possibly inside a Float16Module).
        fsdp_config: TorchFullyShardedDataParallelConfig.
        data_parallel_group: the whole data-parallel (x context-parallel) group; None means
            parallel_state's.
        hsdp_groups: (replicate group, shard group) for HSDP, or None: then, when
            `data_parallel_group` is None too, parallel_state's partial data-parallel groups
            (--num-distributed-optimizer-instances > 1), else plain FSDP over the whole group.
        expert_data_parallel_group: the group sharing this rank's experts; None means
            parallel_state's data-modulo-expert-parallel group (with context parallel). Only
            used when the model has expert-parallel parameters.
    """

    #: The schedules must call `no_sync()` on all but the last micro-batch (see training.py).
    needs_no_sync_between_microbatches = True

    def __init__(
        self,
        config,
        ddp_config,
        module: torch.nn.Module,
        fsdp_config: Optional[TorchFullyShardedDataParallelConfig] = None,
        data_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
        hsdp_groups: Optional[Tuple[torch.distributed.ProcessGroup, ...]] = None,
        expert_data_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.fsdp_config = fsdp_config or TorchFullyShardedDataParallelConfig()
        if hsdp_groups is None and data_parallel_group is None:
            replicate = parallel_state.get_inter_partial_data_parallel_group()
            if replicate is not None:
                shard = parallel_state.get_data_parallel_group(
                    with_context_parallel=True, partial_data_parallel=True
                )
                hsdp_groups = (replicate, shard)
        self.data_parallel_group = group_fallbacks.get_data_parallel_group_if_none(
            data_parallel_group, with_context_parallel=True
        )
        device_type = get_current_device_type()
        self.mesh = _data_parallel_mesh(self.data_parallel_group, hsdp_groups, device_type)
        self.per_token_loss = bool(getattr(config, 'calculate_per_token_loss', False))

        tied = bool(getattr(_inner_model(module), 'share_embeddings_and_output_weights', False))
        saved_attributes = self._save_param_attributes(module)
        self.expert_units = _expert_modules(module)
        self.expert_data_parallel_group = None
        self.expert_mesh = None
        if self.expert_units:
            self.expert_data_parallel_group = (
                expert_data_parallel_group
                or parallel_state.get_data_modulo_expert_parallel_group(with_context_parallel=True)
            )
            self.expert_mesh = _data_parallel_mesh(
                self.expert_data_parallel_group, None, device_type
            )
        self.units = _unit_modules(module, tied)
        inner_policy = MixedPrecisionPolicy(
            param_dtype=self.fsdp_config.param_dtype, reduce_dtype=self.fsdp_config.reduce_dtype
        )
        root_policy = MixedPrecisionPolicy(
            param_dtype=self.fsdp_config.param_dtype,
            reduce_dtype=self.fsdp_config.reduce_dtype,
            output_dtype=self.fsdp_config.output_dtype,
        )
        shard = dict(reshard_after_forward=self.fsdp_config.reshard_after_forward)
        # Experts first: a unit nested in a layer must be wrapped before the layer takes the rest.
        dp_size = torch.distributed.get_world_size(group=self.data_parallel_group)
        for experts in self.expert_units:
            fully_shard(experts, mesh=self.expert_mesh, mp_policy=inner_policy, **shard)
            # Sum over the expert-data-parallel ranks, divide by the whole DP size (DDP's
            # scaling); a plain SUM keeps FSDP2 off NCCL's premul-sum, which gloo lacks.
            experts.set_gradient_divide_factor(float(dp_size))
            if self.expert_data_parallel_group.size() > 1:
                # (With one rank FSDP2 skips the collective and divides once already; forcing
                # SUM would divide a second time.)
                experts.set_force_sum_reduction_for_comms(True)
        for unit in self.units:
            fully_shard(unit, mesh=self.mesh, mp_policy=inner_policy, **shard)
        fully_shard(module, mesh=self.mesh, mp_policy=root_policy, **shard)
        self.module = module
        self._restore_param_attributes(module, saved_attributes)
        self.fsdp_modules: List[FSDPModule] = [
            m for m in module.modules() if isinstance(m, FSDPModule)
        ]
        if self.mesh.ndim > 1:
            # HSDP's all-reduce over the replicas: SUM and one division by the DP size instead of
            # AVG per collective (gloo has no AVG).
            for fsdp_module in self.fsdp_modules:
                if fsdp_module not in self.expert_units:
                    fsdp_module.set_force_sum_reduction_for_comms(True)
        if getattr(config, 'recompute_granularity', None) is not None:
            # A recomputed unit runs its forward again inside backward, which confuses FSDP2's
            # implicit backward prefetch order: name the unit before each one explicitly.
            for previous, unit in zip(self.units[:-1], self.units[1:]):
                unit.set_modules_to_backward_prefetch([previous])

    @staticmethod
    def _save_param_attributes(module: torch.nn.Module) -> Dict[str, Dict[str, object]]:
        saved = {}
        for name, param in module.named_parameters():
            attrs = {a: getattr(param, a) for a in PRESERVED_PARAM_ATTRIBUTES if hasattr(param, a)}
            saved[name] = attrs
        return saved

    @staticmethod
    def _restore_param_attributes(module: torch.nn.Module, saved) -> None:
        for name, param in module.named_parameters():
            for attribute, value in saved.get(name, {}).items():
                setattr(param, attribute, value)
            param.is_torch_fsdp2_param = True

    def forward(self, *inputs, **kwargs):
        """Run the wrapped (sharded) module."""
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally: no reduce-scatter until the context exits."""
        for fsdp_module in self.fsdp_modules:
            fsdp_module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for fsdp_module in self.fsdp_modules:
                fsdp_module.set_requires_gradient_sync(True, recurse=False)

    def start_grad_sync(self, *unused):
        """Nothing to start: FSDP2 reduce-scatters in each unit's backward."""

    def finish_grad_sync(self):
        """Nothing to finish: the reduce-scatters completed with backward."""

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every (sharded) gradient by `scaling_factor`.

        FSDP2 averages over the data-parallel group; a per-token loss wants the sum (then
        divided by the global token count, which is what `scaling_factor` is), so the mean is
        multiplied back by the group size here. (A divide factor of 1 would make FSDP2 use
        NCCL's premul-sum, which gloo lacks.)
        """
        if self.per_token_loss:
            scaling_factor *= torch.distributed.get_world_size(group=self.data_parallel_group)
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling_factor)

    def zero_grad_buffer(self):
        """Drop the gradients of the previous step (the optimizer builds on `param.grad`)."""
        for param in self.module.parameters():
            param.grad = None

    def start_param_sync(self, *unused, **kwargs):
        """Nothing to do: parameters are gathered per unit on use."""

    def finish_param_sync(self, *unused):
        """Nothing to do: parameters are gathered per unit on use."""

    def broadcast_params(self):
        """Make all data-parallel replicas equal: each rank's shard from the same full tensor is
        already consistent when every rank initialised the same full weight (same seed); with
        --data-parallel-random-init the first rank's full weights are broadcast and re-sharded
        (experts over their expert-data-parallel group, the rest over the whole group)."""
        expert_params = {id(p) for unit in self.expert_units for p in unit.parameters()}
        with torch.no_grad():
            for param in self.module.parameters():
                group = self.data_parallel_group
                if id(param) in expert_params:
                    group = self.expert_data_parallel_group
                if torch.distributed.get_world_size(group=group) == 1:
                    continue
                full = param.full_tensor()
                src = torch.distributed.get_global_rank(group, 0)
                torch.distributed.broadcast(full, src=src, group=group)
                param.to_local().copy_(_local_chunk(full, param))

    def state_dict(self, prefix: str = '', keep_vars: bool = False):
        """The module's state dict: parameters as DTensors (sharded, no communication)."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = '', keep_vars: bool = False):
        """The module's checkpoint state dict (DTensors)."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the sharded parameters: full tensors are sliced to this rank's shard,
        DTensors are copied as they are."""
        own = self.module.state_dict()
        converted = {}
        for key, value in state_dict.items():
            target = own.get(key)
            if (
                isinstance(target, DTensor)
                and isinstance(value, torch.Tensor)
                and not isinstance(value, DTensor)
            ):
                value = DTensor.from_local(
                    _local_chunk(value, target).contiguous(),
                    target.device_mesh,
                    target.placements,
                    shape=target.shape,
                    stride=target.stride(),
                    run_check=False,
                )
            converted[key] = value
        return self.module.load_state_dict(converted, strict=strict)

    def sharded_state_dict(self, *args, **kwargs):
        """The wrapped model's distributed-checkpoint view (see dist_checkpointing)."""
        return self.module.sharded_state_dict(*args, **kwargs)


def _data_parallel_mesh(
    group: torch.distributed.ProcessGroup,
    hsdp_groups: Optional[Tuple[torch.distributed.ProcessGroup, ...]],
    device_type: str,
) -> DeviceMesh:
    """The FSDP2 mesh over `group`: 1-D, or (replicate, shard) for HSDP.

    For HSDP the shard groups must be consecutive blocks of `group`'s ranks and the replicate
    groups the ranks at the same position in each block (so the mesh is `group`'s ranks viewed
    as [R, S]); anything else is refused, as the mesh would not describe the groups.
    """
    # DTensor caches sharding decisions keyed by meshes that compare equal when they cover the
    # same ranks, and those carry their process groups: after parallel_state rebuilt its
    # groups in the same process (tests, in-process restart) a cached plan would name a
    # destroyed group. Naming the dimensions after the groups keeps meshes distinct.
    if hsdp_groups is None or hsdp_groups[0].size() == 1:
        shard_group = group if hsdp_groups is None else hsdp_groups[1]
        mesh = DeviceMesh.from_group(
            shard_group, device_type, mesh_dim_names=(f'dp_shard_{shard_group.group_name}',)
        )
        register_mesh_groups(mesh, [shard_group])
        return mesh
    replicate_group, shard_group = hsdp_groups
    ranks = torch.distributed.get_process_group_ranks(group)
    replicas, shards = replicate_group.size(), shard_group.size()
    if replicas * shards != len(ranks):
        raise ValueError(
            f'HSDP groups of {replicas} replicas x {shard_group.size()} shards do not tile the '
            f'{len(ranks)} data-parallel ranks'
        )
    layout = torch.tensor(ranks, dtype=torch.int).view(replicas, shards)  # [R, S]
    rank = torch.distributed.get_rank()
    row, column = (layout == rank).nonzero()[0].tolist()
    if torch.distributed.get_process_group_ranks(shard_group) != layout[row].tolist() or (
        torch.distributed.get_process_group_ranks(replicate_group) != layout[:, column].tolist()
    ):
        raise ValueError(
            f'HSDP shard group {torch.distributed.get_process_group_ranks(shard_group)} and '
            f'replicate group {torch.distributed.get_process_group_ranks(replicate_group)} of '
            f'rank {rank} are not a row and a column of the data-parallel ranks {ranks} '
            f'viewed as [{replicas}, {shards}]'
        )
    mesh = DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=layout,
        mesh_dim_names=(
            f'dp_replicate_{replicate_group.group_name}',
            f'dp_shard_{shard_group.group_name}',
        ),
    )
    register_mesh_groups(mesh, [replicate_group, shard_group])
    return mesh


def _local_chunk(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of `full` under `like`'s placements (torch.chunk on each sharded dim)."""
    local = full
    mesh = like.device_mesh
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(like.placements):
        if placement.is_shard():
            chunks = torch.chunk(local, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            if index < len(chunks):
                local = chunks[index]
            else:
                shape = list(local.shape)
                shape[placement.dim] = 0
                local = local.new_empty(shape)
    return local
