"""FSDP2-sharded tensors (DTensors) in the torch_dist format, under the plain model keys.

A model wrapped in FSDP2 (`fully_shard`) holds every parameter as a DTensor sharded on dim 0
over the data-parallel mesh (`torch.chunk` sizes: ceil(rows / DP) rows per rank, the last ranks
possibly fewer or none; under HSDP over the shard dimension of a (replicate, shard) mesh, each
replica holding the same rows); Adam's moments and any fp32 main copy built on those parameters are
DTensors with the same placement. The model's `sharded_state_dict` describes each parameter with
the same key, global shape and tensor-parallel offset as without FSDP, but its data is that
DTensor (the full tensor-parallel piece, of which this rank holds a few rows).

`shard_dtensor_entries` rewrites every such entry so that each rank writes (and reads) only its
rows: the rows of a row-major tensor are one contiguous range of its flattening, so the entry
becomes a flattened-range slice of the tensor-parallel piece, exactly the form the distributed
optimizer's `fully_sharded_model_space` state takes. The stored tensors therefore are the same
global tensors a DDP or distributed-optimizer run writes, and any of them loads any other at any
DP size. Entries built by factories (the fused SwiGLU fc1 stored as its two halves) get the
slice through their own `build_fn`, which already cuts flattened ranges.

On load the flat slice is a view of the DTensor's local shard, so the checkpoint reader fills
the shard in place; the merge step hands back the DTensor itself, which is what
`load_state_dict` of an FSDP2 module expects. A rank that holds no rows of a tensor (more
ranks than rows) requests nothing for it, so the key is absent from what it loads: the caller
keeps its own (empty) shard (`is_empty_shard`).
"""

import dataclasses
import math
from typing import Any, Tuple

import torch
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedTensor,
    ShardedTensorFactory,
)


def _shard_mesh_dim(tensor: DTensor) -> int:
    """The mesh dimension `tensor` is sharded over (on dim 0); every other one must replicate.

    Only the layouts FSDP2 produces are accepted: `Shard(0)` over one data-parallel mesh
    dimension, or HSDP's `(Replicate(), Shard(0))`.
    """
    placements = tuple(tensor.placements)
    shard_dims = [d for d, p in enumerate(placements) if p.is_shard()]
    if (
        len(shard_dims) != 1
        or placements[shard_dims[0]].dim != 0
        or not all(p.is_replicate() for d, p in enumerate(placements) if d != shard_dims[0])
    ):
        raise CheckpointingException(
            f'a DTensor with placements {placements} has no torch_dist layout (only the '
            'FSDP2 Shard(0) layout over one data-parallel mesh dimension, replicated over any '
            'other)'
        )
    return shard_dims[0]


def dim0_shard_range(tensor: DTensor) -> Tuple[torch.Tensor, slice]:
    """(flat view of the local shard, its range in the flattened full tensor)."""
    shard_dim = _shard_mesh_dim(tensor)
    local = tensor.to_local()
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    world = tensor.device_mesh.size(shard_dim)
    rank = tensor.device_mesh.get_local_rank(shard_dim)
    rows_per_rank = math.ceil(rows / world)
    first_row = min(rank * rows_per_rank, rows)
    local_rows = local.shape[0] if local.dim() > 0 else 1
    if first_row + local_rows > rows:
        raise CheckpointingException(
            f'DTensor shard of rank {rank} ({local_rows} rows from row {first_row}) exceeds its '
            f'{rows} rows: not torch.chunk sizes'
        )
    row_numel = math.prod(tensor.shape[1:])
    if not local.is_contiguous():
        raise CheckpointingException('a DTensor local shard is not contiguous')
    flat = local.view(-1)  # [local rows x row numel], shares the shard's storage
    return flat, slice(first_row * row_numel, (first_row + local_rows) * row_numel)


def is_empty_shard(tensor: Any) -> bool:
    """Whether `tensor` is a DTensor of which this rank holds no element."""
    return isinstance(tensor, DTensor) and tensor.to_local().numel() == 0


def _replica_index(tensor: DTensor) -> int:
    """This rank's index among the ranks holding the same rows (0 on the first HSDP replica,
    always 0 without replication)."""
    mesh, shard_dim = tensor.device_mesh, _shard_mesh_dim(tensor)
    index = 0
    for dim in range(mesh.ndim):
        if dim != shard_dim:
            index = index * mesh.size(dim) + mesh.get_local_rank(dim)
    return index


def _shard_replica_id(key: str, replica_id, replica_index: int = 0) -> Any:
    """The entry's replica id with the data-parallel component set to the index of this rank's
    copy of its rows: every shard rank of the first replica writes its own rows (tensor-parallel
    replicas keep their ids)."""
    if isinstance(replica_id, tuple) and len(replica_id) == 3:
        return (replica_id[0], replica_id[1], replica_index)
    raise CheckpointingException(
        f'{key}: expected replica_id (PP, TP, DP) for an FSDP2-sharded tensor, got {replica_id}'
    )


def _copy_back(flat: torch.Tensor, merged: Any) -> None:
    """Make sure the loaded values are in the shard (a merge may have built a new tensor)."""
    if isinstance(merged, torch.Tensor) and merged.numel() == flat.numel():
        if merged.numel() and merged.data_ptr() != flat.data_ptr():
            with torch.no_grad():
                flat.copy_(merged.reshape(-1))


def _as_shard_factory(entry) -> Any:
    """`entry` (a ShardedTensor or factory holding a DTensor) as a factory of its local rows."""
    dtensor = entry.data
    flat, flat_range = dim0_shard_range(dtensor)
    replica_id = _shard_replica_id(entry.key, entry.replica_id, _replica_index(dtensor))

    if isinstance(entry, ShardedTensorFactory):
        inner_build, inner_merge = entry.build_fn, entry.merge_fn

        def build(key, _data, _replica_id, _flattened_range):
            if flat.numel() == 0:
                return {}
            return inner_build(key, flat, replica_id, flat_range)

        def merge(loaded):
            if flat.numel():
                _copy_back(flat, inner_merge(loaded))
            return dtensor

    else:

        def build(key, _data, _replica_id, _flattened_range):
            if flat.numel() == 0:
                return {}
            return dataclasses.replace(
                entry,
                data=flat,
                dtype=flat.dtype,
                flattened_range=flat_range,
                replica_id=replica_id,
            )

        def merge(loaded):
            if flat.numel():
                _copy_back(flat, loaded)
            return dtensor

    return ShardedTensorFactory(entry.key, dtensor, build, merge, replica_id)


def shard_dtensor_entries(sharded_state_dict) -> int:
    """Rewrite every ShardedTensor / factory whose data is a DTensor (in place).

    Call it on the whole training state dict after the optimizer built its entries (the
    optimizer finds its parameters' entries by the identity of their data).

    Returns:
        the number of rewritten entries.
    """
    count = [0]

    def convert(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)) and isinstance(x.data, DTensor):
            if getattr(x, 'flattened_range', None) is not None:
                raise CheckpointingException(
                    f'{x.key}: a flattened slice of a DTensor has no torch_dist layout'
                )
            count[0] += 1
            return _as_shard_factory(x)
        return x

    dict_list_map_inplace(convert, sharded_state_dict)
    return count[0]
