"""What a rank contributes to a distributed checkpoint: sharded tensors, objects and factories.

A *sharded state dict* is a nested dict whose leaves are

- `ShardedTensor`: this rank's chunk of a global tensor named by `key` (the same on every rank
  and independent of the parallel layout), with its global shape and offset;
- `ShardedObject`: a picklable object that is one cell of a grid of objects (e.g. the RNG
  states of every (pp, tp) position); it cannot be resharded;
- `ShardedTensorFactory`: a tensor that is stored as several `ShardedTensor`s (built by
  `build_fn`) and put back together by `merge_fn` after loading (e.g. the fused GLU fc1);
- `LocalNonpersistentObject`: never written; on load the caller's own object is put back;
- anything else: "common" state (rank 0's copy goes to `common.pt`).

Replica ids: every chunk of a global tensor is held by one or more ranks; exactly one of them
(the *main replica*, `replica_id` 0 or all zeros) writes it. On load every replica reads.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

ReplicaId = Union[int, Tuple[int, ...]]
ShardedStateDict = Dict[str, Any]


class CheckpointingException(ValueError):
    """A distributed checkpoint cannot be written or read as requested (a ValueError: the
    training entry points print it as one `error:` line)."""


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The replica that writes a chunk: id 0, or every element of a tuple id 0."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase:
    """Common base of the leaves that are written shard-wise."""

    key: str
    replica_id: ReplicaId


@dataclass
class ShardedTensor(ShardedBase):
    """This rank's chunk of the global tensor `key`.

    Args:
        key: global name (layout independent).
        data: the local tensor (for a model parameter: the Parameter itself).
        dtype: dtype of the stored tensor (== data.dtype).
        local_shape: shape of the local chunk without the prepended axes.
        global_shape: shape of the global tensor (prepended axes included).
        global_offset: offset of the chunk in the global tensor (prepended axes: the index).
        axis_fragmentations: number of chunks along each global axis.
        replica_id: see the module docstring.
        prepend_axis_num: leading global axes the local tensor lacks (local size 1 each), e.g.
            the layer axis of `decoder.layers.*` or an expert axis.
        allow_shape_mismatch: the stored global shape may differ (padded vocabulary): only the
            overlap is read on load and the rest of the target is zeroed.
        flattened_range: `data` is the slice [start, stop) of the row-major flattening of the
            `local_shape` chunk (distributed-optimizer state).
    """

    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        self.local_shape = tuple(self.local_shape)
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        if self.data is not None and self.data.dtype != self.dtype:
            raise CheckpointingException(
                f'{self.key}: data dtype {self.data.dtype} != declared dtype {self.dtype}'
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f'{self.key}: local shape {self.local_shape} with {self.prepend_axis_num} '
                f'prepended axes does not match global shape {self.global_shape}'
            )
        if len(self.global_offset) != len(self.global_shape):
            raise CheckpointingException(
                f'{self.key}: global offset {self.global_offset} does not match global shape '
                f'{self.global_shape}'
            )
        if self.data is not None:
            if self.flattened_range is None:
                if tuple(self.data.shape) != self.local_shape:
                    raise CheckpointingException(
                        f'{self.key}: data shape {tuple(self.data.shape)} != local shape '
                        f'{self.local_shape}'
                    )
            elif self.data.dim() != 1 or self.data.numel() != (
                self.flattened_range.stop - self.flattened_range.start
            ):
                raise CheckpointingException(
                    f'{self.key}: flattened data of {self.data.numel()} elements does not match '
                    f'range {self.flattened_range}'
                )

    @property
    def local_chunk_shape(self) -> Tuple[int, ...]:
        """The local chunk's shape in global dims (prepended axes of size 1)."""
        return (1,) * self.prepend_axis_num + self.local_shape

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        return self.global_offset

    def without_data(self) -> 'ShardedTensor':
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        allow_shape_mismatch: bool = False,
        flattened_range: Optional[slice] = None,
        local_shape: Optional[Tuple[int, ...]] = None,
    ) -> 'ShardedTensor':
        """A chunk of a regular grid: `(axis, rank_on_axis, fragments)` for every split axis.

        The axis counts in global dims (prepended axes first). The global size along a split
        axis is fragments x local size; a prepended axis has local size 1, so its "rank" is the
        index (global layer, expert).
        """
        if local_shape is None:
            local_shape = tuple(data.shape)
        chunk = (1,) * prepend_axis_num + tuple(local_shape)
        global_shape = list(chunk)
        global_offset = [0] * len(chunk)
        fragments = [1] * len(chunk)
        seen = set()
        for axis, rank, num in rank_offsets:
            if axis in seen:
                raise CheckpointingException(f'{key}: axis {axis} given twice in {rank_offsets}')
            seen.add(axis)
            if not 0 <= rank < num:
                raise CheckpointingException(f'{key}: rank {rank} not in [0, {num}) on axis {axis}')
            global_shape[axis] = chunk[axis] * num
            global_offset[axis] = chunk[axis] * rank
            fragments[axis] = num
        return cls(
            key,
            data,
            data.dtype,
            tuple(local_shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragments),
            replica_id,
            prepend_axis_num,
            allow_shape_mismatch,
            flattened_range,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: slice,
        **kwargs,
    ) -> 'ShardedTensor':
        """`from_rank_offsets` for a 1-D slice `flattened_range` of the local chunk."""
        return cls.from_rank_offsets(
            key,
            data,
            *rank_offsets,
            flattened_range=flattened_range,
            local_shape=tuple(non_flat_local_shape),
            **kwargs,
        )


@dataclass
class ShardedObject(ShardedBase):
    """One cell of a grid of picklable objects.

    Args:
        key: name of the grid.
        data: the object (written with torch.save; must load with weights_only=True).
        global_shape: grid shape (e.g. (pp, tp)).
        global_offset: this cell's position in the grid.
        replica_id: see the module docstring.
        snapshot: `data` is a copy made for this save that nothing modifies afterwards (e.g.
            optimizer state gathered for it): an asynchronous save pickles it in its
            background writer instead of while the training loop waits.
    """

    key: str
    data: Any
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0
    snapshot: bool = False

    def __post_init__(self):
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)

    @property
    def unique_key(self) -> str:
        """`{key}/shard_{offsets joined by '.'}_{global shape joined by '.'}` (Megatron's name)."""
        offsets = '.'.join(map(str, self.global_offset))
        shape = '.'.join(map(str, self.global_shape))
        return f'{self.key}/shard_{offsets}_{shape}'

    def without_data(self) -> 'ShardedObject':
        return replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> 'ShardedObject':
        """The data-less ShardedObject whose `unique_key` is `unique_key`."""
        key, shard = unique_key.rsplit('/shard_', 1)
        offsets, shape = shard.split('_')
        return cls(
            key,
            None,
            tuple(int(x) for x in shape.split('.')),
            tuple(int(x) for x in offsets.split('.')),
            replica_id,
        )


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor stored as several ShardedTensors.

    Args:
        key: the key every built ShardedTensor gets.
        data: the local tensor.
        build_fn: (key, data, replica_id, flattened_range) -> sharded state dict of STs.
        merge_fn: the loaded sub-dict -> the local tensor.
        replica_id: passed to build_fn.
        flattened_range: passed to build_fn (distributed-optimizer slices).
    """

    key: str
    data: torch.Tensor
    build_fn: Callable
    merge_fn: Callable
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory by the sub-dict it builds (in place)."""

    def fn(x):
        if isinstance(x, ShardedTensorFactory):
            built = x.build()
            return _FactoryBuilt(x, built)
        return x

    dict_list_map_inplace(fn, sharded_state_dict)


class _FactoryBuilt(dict):
    """The sub-dict a factory built, remembering the factory (for the merge after load)."""

    def __init__(self, factory: ShardedTensorFactory, built):
        self.wrapped = not isinstance(built, dict)
        super().__init__({'_': built} if self.wrapped else built)
        self.factory = factory


def apply_factory_merges(state_dict: Any) -> Any:
    """Merge every factory's loaded sub-dict back into one tensor (merge_fn)."""
    if isinstance(state_dict, _FactoryBuilt):
        loaded = {k: apply_factory_merges(v) for k, v in state_dict.items()}
        return state_dict.factory.merge_fn(loaded['_'] if state_dict.wrapped else loaded)
    if isinstance(state_dict, dict):
        for k, v in state_dict.items():
            state_dict[k] = apply_factory_merges(v)
    elif isinstance(state_dict, list):
        state_dict[:] = [apply_factory_merges(v) for v in state_dict]
    return state_dict


@dataclass
class LocalNonpersistentObject:
    """An object that is not saved; on load the caller's own `obj` is put back."""

    obj: Any

    def unwrap(self) -> Any:
        return self.obj


# Megatron's misspelled alias, kept for code written against it.
LocalNonpersitentObject = LocalNonpersistentObject


@dataclass
class _Chunk:
    """A rectangular, row-major contiguous piece of a flattened range (see flat_range_boxes)."""

    flat_start: int
    flat_stop: int
    offset: Tuple[int, ...] = field(default_factory=tuple)
    shape: Tuple[int, ...] = field(default_factory=tuple)


def flat_range_boxes(shape: Tuple[int, ...], start: int, stop: int):
    """Split the flat range [start, stop) of a row-major tensor of `shape` into boxes.

    Every box has the form (fixed indices..., a partial range on one axis, full trailing axes),
    so its elements are contiguous in the flattening: the box is the flat slice
    [flat_start, flat_stop) viewed as `shape`. At most 2 * ndim - 1 boxes.

    Returns:
        list of _Chunk(flat_start, flat_stop, offset, shape) in flat order.
    """
    shape = tuple(shape)
    if not shape:
        return [_Chunk(start, stop, (), ())] if stop > start else []
    boxes = []

    def rec(lo: int, hi: int, dim: int, prefix: Tuple[int, ...], base: int):
        # [lo, hi) relative to `base` (the flat index of prefix + zeros).
        if hi <= lo:
            return
        inner = math.prod(shape[dim + 1 :])
        first = lo // inner
        if dim == len(shape) - 1:
            boxes.append(_Chunk(base + lo, base + hi, prefix + (lo,), (hi - lo,)))
            return
        # A partial leading row.
        if lo % inner:
            end = min(hi, (first + 1) * inner)
            rec(
                lo - first * inner,
                end - first * inner,
                dim + 1,
                prefix + (first,),
                base + first * inner,
            )
            first += 1
            lo = end
        if lo >= hi:
            return
        full_last = hi // inner  # rows [first, full_last) are complete
        if full_last > first:
            boxes.append(
                _Chunk(
                    base + first * inner,
                    base + full_last * inner,
                    prefix + (first,) + (0,) * (len(shape) - dim - 1),
                    (full_last - first,) + shape[dim + 1 :],
                )
            )
        if hi > full_last * inner:
            rec(0, hi - full_last * inner, dim + 1, prefix + (full_last,), base + full_last * inner)

    rec(start, stop, 0, (), 0)
    # Shapes in full dims: a box found at depth d has d leading axes of size 1.
    for box in boxes:
        missing = len(shape) - len(box.shape)
        box.shape = (1,) * missing + tuple(box.shape)
    return boxes
