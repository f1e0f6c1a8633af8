"""Distributed-checkpoint layout of the experts: one global tensor per weight, with an expert axis.

Keys and global shapes (Megatron's), for the layer stack `decoder.layers.` (L layers, E experts,
h hidden size, F the expert ffn size, g = 2 for gated experts else 1)::

    decoder.layers.mlp.experts.experts.linear_fc1.weight   [L, E, g F, h]   GLU: rows [W; V]
    decoder.layers.mlp.experts.experts.linear_fc2.weight   [L, E, h, F]
    decoder.layers.mlp.experts.experts.linear_fc1.bias     [L, E, g F]      (add_bias_linear)
    decoder.layers.mlp.experts.experts.linear_fc2.bias     [L, E, h]
    decoder.layers.mlp.experts.experts.linear_fc{1,2}._extra_state/shard_{l}.{e}_{L}.{E}

Every expert is stored under its *global* index (expert-parallel rank r holds experts
r nle .. r nle + nle - 1), split over tensor parallelism as the dense MLP is (fc1 along its rows,
each GLU half separately, fc2 along its columns). `SequentialMLP` and `GroupedMLP` write the
same tensors, so a checkpoint loads at any expert / tensor parallel size with either
(`--moe-grouped-gemm` may change between runs).

Replica ids are (0, 0 or tp rank, expert-data-parallel rank): the ranks holding the same experts
are the expert-data-parallel group (data parallel / expert parallel), so each expert chunk is
written once, by expert-data-parallel rank 0 (TP-replicated parts by TP rank 0 of it).

`GroupedMLP` keeps each local expert's weights as contiguous transposed blocks (`weight1`
[h, nle g f] viewed as [nle, h, g f], `weight2` [nle f, h] as [nle, f, h], f = F / tp), so its
chunks are transposed views of those blocks; a distributed-optimizer slice of a grouped weight
(a flat range of that memory) becomes the few rectangular boxes it covers in the stored layout.
All chunks are views: loading writes into the weights (and optimizer states) in place.
"""

import math
from functools import partial
from typing import List, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    flat_range_boxes,
)
from megatron.core.dist_checkpointing.utils import (
    make_sharded_object_for_checkpoint,
    replace_prefix_for_sharding,
)


def check_dist_checkpoint_supported(config) -> None:
    """Experts split over TP x EP (`moe_extended_tp`) have no distributed-checkpoint layout."""
    if config.moe_extended_tp:
        raise ValueError(
            'distributed checkpoints (--use-dist-ckpt / --ckpt-format torch_dist) do not support '
            '--moe-extended-tp: use --ckpt-format torch'
        )


def expert_data_parallel_rank() -> int:
    """This rank's index among the ranks holding the same experts."""
    return parallel_state.get_data_modulo_expert_parallel_rank(with_context_parallel=True)


def set_expert_data_parallel_replica(sharded_state_dict) -> None:
    """Replace the data-parallel slot of every leaf's (pp, tp, dp) replica id by the
    expert-data-parallel rank."""
    rank = expert_data_parallel_rank()
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            rid = sh.replica_id
            assert isinstance(rid, tuple) and len(rid) == 3, f'{sh.key}: replica id {rid}'
            sh.replica_id = (rid[0], rid[1], rank)


def sequential_experts_sharded_state_dict(experts, prefix, sharded_offsets, metadata):
    """SequentialMLP: each local expert's MLP with the axis (axis, global expert, E) appended to
    `sharded_offsets` and its `local_experts.{i}.` dropped from the keys."""
    check_dist_checkpoint_supported(experts.config)
    num_experts = experts.config.num_moe_experts
    out = {}
    for local_index, (expert_id, expert) in enumerate(
        zip(experts.local_expert_indices, experts.local_experts)
    ):
        state_prefix = f'{prefix}local_experts.{local_index}.'
        offsets = (*sharded_offsets, (len(sharded_offsets), expert_id, num_experts))
        expert_sd = expert.sharded_state_dict(state_prefix, offsets, metadata)
        replace_prefix_for_sharding(expert_sd, state_prefix, f'{prefix}experts.')
        set_expert_data_parallel_replica(expert_sd)
        out.update(expert_sd)
    return out


# ---------------------------------------------------------------------------------------------
# GroupedMLP


class _GroupedWeightLayout:
    """Where the elements of one grouped weight go in the stored global tensor.

    The weight's memory is viewed as [nle, X, Y] (fc1: X = h and Y = g f, split into g halves
    of f; fc2: X = f, Y = h) and expert e's block [X, Y] is stored transposed, as [Y, X], at
    expert first + e. Along the TP-split axis the local f rows / columns sit at tp_rank f (plus
    half F for the second GLU half).
    """

    def __init__(self, experts, which: int, sharded_offsets):
        config = experts.config
        tp_size, self.tp_rank = experts.tp_group.size(), experts.tp_group.rank()
        self.which = which
        self.offsets = tuple(sharded_offsets)
        self.nle = experts.num_local_experts
        self.first = experts.local_expert_indices[0]
        self.num_experts = config.num_moe_experts
        self.h = config.hidden_size
        self.ffn = config.moe_ffn_hidden_size  # F
        self.f = self.ffn // tp_size
        self.tp_size = tp_size
        self.g = 2 if (which == 1 and config.gated_linear_unit) else 1
        # Row-major view of the weight's memory with the GLU halves as their own axis.
        self.view_shape = (
            (self.nle, self.h, self.g, self.f) if which == 1 else (self.nle, self.f, self.h)
        )

    @property
    def global_shape(self) -> Tuple[int, ...]:
        prepended = tuple(size for _, _, size in self.offsets)
        if self.which == 1:
            return prepended + (self.num_experts, self.g * self.ffn, self.h)
        return prepended + (self.num_experts, self.h, self.ffn)

    def _strides(self) -> Tuple[int, ...]:
        return tuple(math.prod(self.view_shape[i + 1 :]) for i in range(len(self.view_shape)))

    def boxes(self, start: int, stop: int) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
        """(offset, shape) in view coordinates of the boxes covering the flat range [start,
        stop), each within one GLU half."""
        out = []
        for box in flat_range_boxes(self.view_shape, start, stop):
            if self.which == 1:
                for half in range(box.offset[2], box.offset[2] + box.shape[2]):
                    offset = (box.offset[0], box.offset[1], half, box.offset[3])
                    out.append((offset, (box.shape[0], box.shape[1], 1, box.shape[3])))
            else:
                out.append((tuple(box.offset), tuple(box.shape)))
        return out

    def chunk(self, flat: torch.Tensor, base: int, offset, shape):
        """(stored chunk view [ne, Y', X'], its global offset) of one box; `flat` holds the
        weight's elements from flat index `base` on."""
        strides = self._strides()
        start = sum(o * s for o, s in zip(offset, strides)) - base
        if self.which == 1:
            e, c, half, r = offset
            size, stride = (shape[0], shape[1], shape[3]), (strides[0], strides[1], strides[3])
            rows = half * self.ffn + self.tp_rank * self.f + r
            global_offset = (self.first + e, rows, c)  # [e, rows of g F, h]
        else:
            e, r, c = offset
            size, stride = tuple(shape), strides
            global_offset = (self.first + e, c, self.tp_rank * self.f + r)  # [e, h, F]
        view = flat.as_strided(size, stride, flat.storage_offset() + start).permute(0, 2, 1)
        return view, tuple(o for _, o, _ in self.offsets) + global_offset

    def build(self, key, t: torch.Tensor, replica_id, flattened_range):
        """The stored chunks of the whole local weight (Megatron's sub-tensors) or of a
        distributed-optimizer slice of it (boxes)."""
        flat = t.detach().view(-1)  # a view: the chunks below alias the weight / state
        p = len(self.offsets)
        if flattened_range is None:
            out = []
            ep_rank, ep_size = self.first // self.nle, self.num_experts // self.nle
            for half in range(self.g):
                if self.which == 1:
                    box = ((0, 0, half, 0), (self.nle, self.h, 1, self.f))
                    split = (p + 1, half * self.tp_size + self.tp_rank, self.g * self.tp_size)
                else:
                    box = ((0, 0, 0), self.view_shape)
                    split = (p + 2, self.tp_rank, self.tp_size)
                view, _ = self.chunk(flat, 0, *box)
                out.append(
                    ShardedTensor.from_rank_offsets(
                        key,
                        view,
                        *self.offsets,
                        (p, ep_rank, ep_size),
                        split,
                        replica_id=replica_id,
                        prepend_axis_num=p,
                    )
                )
            return out
        out = []
        start, stop = flattened_range.start, flattened_range.stop
        for offset, shape in self.boxes(start, stop):
            view, global_offset = self.chunk(flat, start, offset, shape)
            out.append(
                ShardedTensor(
                    key,
                    view,
                    view.dtype,
                    tuple(view.shape),
                    self.global_shape,
                    global_offset,
                    None,
                    replica_id,
                    p,
                )
            )
        return out


def _merge_in_place(shape, loaded_views: List[torch.Tensor]) -> torch.Tensor:
    """The tensor the loaded chunk views were cut from: they were filled in place and together
    cover one contiguous stretch of its memory (the whole weight, or a distributed-optimizer
    slice, returned 1-D)."""
    numel = sum(v.numel() for v in loaded_views)
    start = min(v.storage_offset() for v in loaded_views)
    merged = loaded_views[0].as_strided((numel,), (1,), start)
    return merged.view(shape) if numel == math.prod(shape) else merged


def grouped_experts_sharded_state_dict(experts, prefix, sharded_offsets, metadata):
    """GroupedMLP: `weight1` / `weight2` as factories of the SequentialMLP keys (transposed
    per expert), plus the experts' `_extra_state` objects SequentialMLP has (None), as Megatron
    writes them, so either kind loads the other's checkpoint."""
    check_dist_checkpoint_supported(experts.config)
    replica_id = (0, 0, expert_data_parallel_rank())
    out = {}
    for which, name in ((1, 'weight1'), (2, 'weight2')):
        param = getattr(experts, name)
        layout = _GroupedWeightLayout(experts, which, sharded_offsets)
        out[f'{prefix}{name}'] = ShardedTensorFactory(
            f'{prefix}experts.linear_fc{which}.weight',
            param,
            layout.build,
            partial(_merge_in_place, tuple(param.shape)),
            replica_id,
        )
    object_rid = (0, experts.tp_group.rank(), expert_data_parallel_rank())
    for expert_id in experts.local_expert_indices:
        offsets = (
            *sharded_offsets,
            (len(sharded_offsets), expert_id, experts.config.num_moe_experts),
        )
        for fc in ('linear_fc1', 'linear_fc2'):
            out[f'{prefix}expert{expert_id}.{fc}._extra_state'] = (
                make_sharded_object_for_checkpoint(
                    None, f'{prefix}experts.{fc}._extra_state', offsets, object_rid
                )
            )
    return out


def drop_sequential_extra_states(module, incompatible_keys) -> None:
    """load_state_dict post-hook of GroupedMLP: the SequentialMLP `_extra_state` entries a
    distributed checkpoint hands back are not unexpected."""
    for key in list(incompatible_keys.unexpected_keys):
        name = key.rsplit('.', 3)
        if len(name) == 4 and name[1].startswith('expert') and name[3] == '_extra_state':
            if name[1][len('expert') :].isdigit() and name[2] in ('linear_fc1', 'linear_fc2'):
                incompatible_keys.unexpected_keys.remove(key)
