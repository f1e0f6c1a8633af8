"""Helpers that build and rename the sharded state dicts of modules.

Module-level (Megatron's names, re-exported from megatron.core.transformer.utils):

- `make_sharded_tensors_for_checkpoint`: a module's own state dict -> ShardedTensors (the
  params named in `tensor_parallel_layers_axis_map` split over TP along that axis, the others
  replicated over TP) and `_extra_state` -> ShardedObject;
- `sharded_state_dict_default`: a child's `sharded_state_dict()` or, for plain torch modules,
  its state dict made replicated;
- `make_sharded_object_for_checkpoint`.

`sharded_offsets` is a tuple of `(axis, offset, size)` prepended to every tensor of a module
(e.g. `(0, global_layer, num_layers)` for transformer layers); a further axis (the expert axis
of MoE layers) is prepended by appending another triple.

Replica ids are (pipeline-ish, tp, dp) triples: TP-split tensors (0, 0, dp_rank) — DP rank 0
of each TP rank writes; TP-replicated tensors (0, tp_rank, dp_rank) — TP 0, DP 0 writes.
"""

from typing import Dict, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

ShardedOffsets = Tuple[Tuple[int, int, int], ...]


def _dp_rank() -> int:
    return parallel_state.get_data_parallel_rank(with_context_parallel=True)


def make_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor, key: str, prepend_offsets: ShardedOffsets = (), replica_id=None, **kwargs
) -> ShardedTensor:
    """A tensor replicated over TP (written by TP 0, DP 0)."""
    if replica_id is None:
        replica_id = (0, parallel_state.get_tensor_model_parallel_rank(), _dp_rank())
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *prepend_offsets,
        replica_id=replica_id,
        prepend_axis_num=len(prepend_offsets),
        **kwargs,
    )


def make_tp_sharded_tensor_for_checkpoint(
    tensor: torch.Tensor,
    key: str,
    tp_axis: int = 0,
    replica_id=None,
    prepend_offsets: ShardedOffsets = (),
    **kwargs,
) -> ShardedTensor:
    """A tensor split over TP along `tp_axis` (local dims; written by DP 0 of each TP rank)."""
    prepend_axis_num = len(prepend_offsets)
    # (axis in the global tensor, this rank's fragment, fragment count) along the TP split.
    tp_split = (
        prepend_axis_num + tp_axis,
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    offsets = (*prepend_offsets, tp_split)
    return ShardedTensor.from_rank_offsets(
        key,
        tensor,
        *offsets,
        prepend_axis_num=prepend_axis_num,
        replica_id=(0, 0, _dp_rank()) if replica_id is None else replica_id,
        **kwargs,
    )


def _extra_state_offsets(sharded_offsets: ShardedOffsets):
    """Grid shape and position of a per-module object: the prepended axes, or (1,) / (0,)."""
    if not sharded_offsets:
        return (1,), (0,)
    ordered = sorted(sharded_offsets, key=lambda t: t[0])
    return tuple(s for _, _, s in ordered), tuple(o for _, o, _ in ordered)


def make_sharded_object_for_checkpoint(
    obj, key: str, sharded_offsets: ShardedOffsets = (), replica_id=None, **kwargs
) -> ShardedObject:
    """One cell of a per-layer grid of objects (written by TP 0, DP 0)."""
    if replica_id is None:
        replica_id = (0, parallel_state.get_tensor_model_parallel_rank(), _dp_rank())
    shape, offset = _extra_state_offsets(sharded_offsets)
    return ShardedObject(key, obj, shape, offset, replica_id, **kwargs)


def make_sharded_tensors_for_checkpoint(
    state_dict: Dict[str, torch.Tensor],
    prefix: str,
    tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
    sharded_offsets: ShardedOffsets = (),
    extra_state_suffix: str = '_extra_state',
) -> ShardedStateDict:
    """A module's own state dict -> {prefix + name: ShardedTensor / ShardedObject}."""
    axis_map = tensor_parallel_layers_axis_map or {}
    out = {}
    for name, tensor in state_dict.items():
        key = f'{prefix}{name}'
        if name.endswith(extra_state_suffix):
            out[key] = make_sharded_object_for_checkpoint(tensor, key, sharded_offsets)
        elif name in axis_map:
            out[key] = make_tp_sharded_tensor_for_checkpoint(
                tensor, key, axis_map[name], prepend_offsets=sharded_offsets
            )
        else:
            out[key] = make_sharded_tensor_for_checkpoint(tensor, key, sharded_offsets)
    return out


def sharded_state_dict_default(
    module: torch.nn.Module, prefix: str = '', sharded_offsets: ShardedOffsets = (), metadata=None
) -> ShardedStateDict:
    """`module.sharded_state_dict()`, or its plain state dict as replicated tensors."""
    if hasattr(module, 'sharded_state_dict'):
        return module.sharded_state_dict(
            prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata
        )
    module_sd = module.state_dict(prefix='', keep_vars=True)
    return make_sharded_tensors_for_checkpoint(module_sd, prefix, {}, sharded_offsets)


def module_sharded_state_dict(
    module: torch.nn.Module,
    prefix: str = '',
    sharded_offsets: ShardedOffsets = (),
    metadata=None,
    tensor_parallel_layers_axis_map: Optional[Dict[str, int]] = None,
) -> ShardedStateDict:
    """A module's own params / buffers / extra state, then every child's sharded state dict."""
    own = {}
    module._save_to_state_dict(own, '', keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(
        own, prefix, tensor_parallel_layers_axis_map, sharded_offsets
    )
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f'{prefix}{name}.', sharded_offsets, metadata))
    return out


# ---------------------------------------------------------------------------------------------
# renaming


def _sharded_leaves(sharded_state_dict):
    for x in nested_values(sharded_state_dict):
        if isinstance(x, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            yield x


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Rename the keys (not the dict keys) of every sharded leaf starting with old_prefix."""
    for sh in _sharded_leaves(sharded_state_dict):
        if not sh.key.startswith(old_prefix):
            raise ValueError(f'expected {sh.key} to start with {old_prefix}')
        sh.key = f'{new_prefix}{sh.key[len(old_prefix) :]}'


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename keys by the first matching old prefix of `prefix_map` (e.g. local -> TE names)."""
    for sh in _sharded_leaves(sharded_state_dict):
        for old, new in prefix_map.items():
            if sh.key.startswith(old):
                sh.key = f'{new}{sh.key[len(old) :]}'
                break


def set_replica_pipeline_slot(sharded_state_dict: ShardedStateDict, value: int) -> None:
    """Make every sharded leaf a non-main replica along the first (pipeline-ish) id slot."""
    for sh in _sharded_leaves(sharded_state_dict):
        rid = sh.replica_id
        sh.replica_id = (value, *rid[1:]) if isinstance(rid, tuple) else (value, 0, rid)


# ---------------------------------------------------------------------------------------------
# gated linear unit


def apply_swiglu_sharded_factory(
    original_sh_ten: ShardedTensor, sharded_offsets: ShardedOffsets
) -> ShardedTensorFactory:
    """Store a GLU `linear_fc1` weight / bias as the TP-independent [W_full; V_full].

    Each TP rank holds [W_r; V_r] (gate rows, then up rows). Along the split axis the global
    tensor has 2 x TP fragments: W_r is fragment r, V_r fragment TP + r, so the stored tensor is
    the TP=1 layout and loads at any TP. A flattened slice (distributed optimizer) is cut at
    the W / V boundary.
    """
    axis = len(sharded_offsets)  # axis 0 of the local tensor, after the prepended axes
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    local_shape = original_sh_ten.local_shape
    half_shape = (local_shape[0] // 2,) + tuple(local_shape[1:])
    half_numel = 1
    for dim in half_shape:
        half_numel *= dim

    def build(key, t, replica_id, flattened_range):
        offset_w = (axis, tp_rank, 2 * tp_size)
        offset_v = (axis, tp_size + tp_rank, 2 * tp_size)
        common = dict(replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
        if flattened_range is None:
            w, v = torch.chunk(t, 2, dim=0)
            return [
                ShardedTensor.from_rank_offsets(key, w, *sharded_offsets, offset_w, **common),
                ShardedTensor.from_rank_offsets(key, v, *sharded_offsets, offset_v, **common),
            ]
        out = []
        start, stop = flattened_range.start, flattened_range.stop
        for half, offset in ((0, offset_w), (1, offset_v)):
            lo, hi = max(start, half * half_numel), min(stop, (half + 1) * half_numel)
            if hi <= lo:
                continue
            out.append(
                ShardedTensor.from_rank_offsets_flat(
                    key,
                    t[lo - start : hi - start],
                    half_shape,
                    *sharded_offsets,
                    offset,
                    flattened_range=slice(lo - half * half_numel, hi - half * half_numel),
                    **common,
                )
            )
        return out

    def merge(sub_state_dict):
        with torch.no_grad():
            return torch.cat(sub_state_dict)

    return ShardedTensorFactory(
        original_sh_ten.key,
        original_sh_ten.data,
        build,
        merge,
        original_sh_ten.replica_id,
        original_sh_ten.flattened_range,
    )


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend `prefix` to the key of every sharded leaf (objects included)."""
    for sh in _sharded_leaves(sharded_state_dict):
        sh.key = f'{prefix}{sh.key}'


# Megatron's splitters of a sharded state dict: each returns (matching leaves, the rest).


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict):
    """(ShardedTensors, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict):
    """(ShardedTensors and ShardedTensorFactories, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict):
    """(ShardedTensors, factories and LocalNonpersistentObjects, everything else)."""
    kinds = (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, kinds))


def extract_sharded_base(sharded_state_dict: ShardedStateDict):
    """(every ShardedBase: tensors, objects, factories; everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict):
    """(LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )
