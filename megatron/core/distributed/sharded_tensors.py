"""Helpers for gradients and parameters that may be DTensors (FSDP2-sharded) or plain tensors."""

from typing import List

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (shares its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


#: Process groups of the meshes our wrappers built, per mesh dimension. A mesh made with
#: `DeviceMesh.from_group` may not resolve its group back by name once parallel_state rebuilt its
#: groups, so the wrapper records them here.
_MESH_GROUPS = {}


def register_mesh_groups(mesh, groups: List[torch.distributed.ProcessGroup]) -> None:
    """Record the process group of each dimension of `mesh` (the wrappers call this)."""
    _MESH_GROUPS[mesh] = list(groups)


def _mesh_group(mesh, dim: int) -> torch.distributed.ProcessGroup:
    groups = _MESH_GROUPS.get(mesh)
    if groups is not None:
        return groups[dim]
    return mesh.get_group(dim)


def shard_groups(tensor: torch.Tensor) -> List[torch.distributed.ProcessGroup]:
    """The groups of the mesh dimensions a DTensor is sharded over: its local pieces must be
    summed over them to cover the whole tensor (replicated dimensions are left out). Empty for a
    plain tensor."""
    if not isinstance(tensor, DTensor):
        return []
    mesh = tensor.device_mesh
    return [_mesh_group(mesh, dim) for dim, p in enumerate(tensor.placements) if p.is_shard()]
