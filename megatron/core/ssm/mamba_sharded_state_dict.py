"""Distributed-checkpoint layout of the Mamba mixer (later Megatron's keys).

The TP-invariant form: in_proj.weight is stored as five tensors `in_proj.weight.z`, `.x`, `.B`,
`.C`, `.dt` and the conv as `conv1d.weight.x/.B/.C` and `conv1d.bias.x/.B/.C`, each with its
global (tp = 1) size and split over TP along dim 0; A_log, D, dt_bias and norm.weight are split
along dim 0, out_proj along dim 1, the fused norm weight is replicated. A checkpoint saved at
one TP size therefore loads at any other. Slices of the distributed optimizer (flattened
ranges) are cut at the segment boundaries.
"""

from typing import List

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

IN_PROJ_SEGMENTS = ('z', 'x', 'B', 'C', 'dt')
CONV_SEGMENTS = ('x', 'B', 'C')


def segment_factory(
    original: ShardedTensor, local_sizes: List[int], names, sharded_offsets
) -> ShardedTensorFactory:
    """Store a tensor whose dim 0 is the concatenation of TP-split segments as one sharded
    tensor per segment (`{key}.{name}`), each split over TP along dim 0."""
    axis = len(sharded_offsets)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    row_shape = tuple(original.local_shape[1:])
    row_numel = 1
    for dim in row_shape:
        row_numel *= dim
    starts = [sum(local_sizes[:i]) for i in range(len(local_sizes))]

    def build(key, t, replica_id, flattened_range):
        common = dict(replica_id=replica_id, prepend_axis_num=len(sharded_offsets))
        tp_offset = (axis, tp_rank, tp_size)
        out = []
        for name, start, size in zip(names, starts, local_sizes):
            shape = (size,) + row_shape
            if flattened_range is None:
                piece = t[start : start + size]
                out.append(
                    ShardedTensor.from_rank_offsets(
                        f'{key}.{name}', piece, *sharded_offsets, tp_offset, **common
                    )
                )
                continue
            seg_lo, seg_hi = start * row_numel, (start + size) * row_numel
            lo = max(flattened_range.start, seg_lo)
            hi = min(flattened_range.stop, seg_hi)
            if hi <= lo:
                continue
            out.append(
                ShardedTensor.from_rank_offsets_flat(
                    f'{key}.{name}',
                    t[lo - flattened_range.start : hi - flattened_range.start],
                    shape,
                    *sharded_offsets,
                    tp_offset,
                    flattened_range=slice(lo - seg_lo, hi - seg_lo),
                    **common,
                )
            )
        return out

    def merge(loaded):
        with torch.no_grad():
            return torch.cat(list(loaded))

    return ShardedTensorFactory(
        original.key,
        original.data,
        build,
        merge,
        original.replica_id,
        original.flattened_range,
    )


def mixer_sharded_state_dict(mixer, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
    """The sharded state dict of a MambaMixer (see the module docstring)."""
    from megatron.core.dist_checkpointing.utils import (
        make_sharded_tensors_for_checkpoint,
        sharded_state_dict_default,
    )

    own = {}
    mixer._save_to_state_dict(own, '', keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(
        own, prefix, {'A_log': 0, 'D': 0, 'dt_bias': 0}, sharded_offsets
    )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sizes = [size // tp for size in mixer.segment_sizes]
    for name, child in mixer.named_children():
        child_prefix = f'{prefix}{name}.'
        if name == 'conv1d':
            child_sd = make_sharded_tensors_for_checkpoint(
                child.state_dict(prefix='', keep_vars=True),
                child_prefix,
                {'weight': 0, 'bias': 0},
                sharded_offsets,
            )
            for key in list(child_sd):
                child_sd[key] = segment_factory(
                    child_sd[key], sizes[1:4], CONV_SEGMENTS, sharded_offsets
                )
        elif name == 'norm':
            child_sd = make_sharded_tensors_for_checkpoint(
                child.state_dict(prefix='', keep_vars=True),
                child_prefix,
                {'weight': 0},
                sharded_offsets,
            )
        else:
            child_sd = sharded_state_dict_default(child, child_prefix, sharded_offsets, metadata)
            if name == 'in_proj':
                key = f'{child_prefix}weight'
                child_sd[key] = segment_factory(
                    child_sd[key], sizes, IN_PROJ_SEGMENTS, sharded_offsets
                )
        out.update(child_sd)
    return out
