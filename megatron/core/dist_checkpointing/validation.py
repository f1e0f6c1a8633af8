"""Checks of a sharded state dict: sharding integrity (save and load) and key strictness (load).

Sharding integrity: every chunk of every global tensor has exactly one main replica across the
ranks, chunks agree on dtype and global shape, flattened ranges tile their chunk, and every
cell of a ShardedObject grid has one main replica. Every rank describes its shards as plain
tuples (`local_sharding_records`), rank 0 gathers and checks them (`sharding_problems`) and
broadcasts the verdict, so every rank raises the same one-line error. A save does this inside
the strategy's planning exchange (one gather and one broadcast for both, none at all when the
structure is unchanged under `--ckpt-assume-constant-structure`).

Strictness (`--dist-ckpt-strictness`): "unexpected" keys are requested but absent from the
checkpoint; "missing" keys are in the checkpoint but requested by no rank (a global exchange).
"""

import logging
import math
from collections import defaultdict
from enum import Enum
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """Handling of a mismatch between the requested keys and the checkpoint's."""

    ASSUME_OK_UNEXPECTED = 'assume_ok_unexpected'
    LOG_UNEXPECTED = 'log_unexpected'
    LOG_ALL = 'log_all'
    RAISE_UNEXPECTED = 'raise_unexpected'
    RAISE_ALL = 'raise_all'
    RETURN_UNEXPECTED = 'return_unexpected'
    RETURN_ALL = 'return_all'
    IGNORE_ALL = 'ignore_all'

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: 'StrictHandling') -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: 'StrictHandling') -> bool:
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: 'StrictHandling') -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict) -> StrictHandling:
    """A StrictHandling from its value string (or itself)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError:
        choices = [s.value for s in StrictHandling]
        raise ValueError(f'invalid strictness {strict!r}; choose one of {choices}')


def _key_of(sh) -> str:
    return sh.unique_key if isinstance(sh, ShardedObject) else sh.key


def determine_mismatch(
    requested: List, stored_keys: Set[str], global_requested: Optional[Set[str]]
) -> Tuple[List[str], List[str]]:
    """(missing, unexpected) key lists; missing only when global_requested is given."""
    requested_keys = {_key_of(sh) for sh in requested}
    unexpected = sorted(requested_keys - stored_keys)
    missing = sorted(stored_keys - global_requested) if global_requested is not None else []
    return missing, unexpected


def mismatch_message(missing: List[str], unexpected: List[str]) -> str:
    parts = []
    if missing:
        parts.append(
            'Some keys found in the checkpoint are missing in the provided sharded state dict. '
            f'Missing keys (for all ranks): {missing}.'
        )
    if unexpected:
        parts.append(
            'Unexpected keys (not found in the checkpoint) encountered in the provided sharded '
            f'state dict. Unexpected keys (for rank {_rank()}): {unexpected}.'
        )
    return ' '.join(parts)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class TensorRecord(NamedTuple):
    """What the sharding check needs of one ShardedTensor (a plain tuple: cheap to gather)."""

    key: str
    global_shape: Tuple[int, ...]
    dtype: torch.dtype
    global_offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    local_chunk_shape: Tuple[int, ...]
    main: bool
    flattened_range: Optional[Tuple[int, int]]


class ObjectRecord(NamedTuple):
    """What the sharding check needs of one ShardedObject."""

    key: str
    unique_key: str
    global_shape: Tuple[int, ...]
    main: bool


def local_sharding_records(sharded_state_dict) -> List:
    """This rank's TensorRecords and ObjectRecords (no collective)."""
    records = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            rng = sh.flattened_range
            records.append(
                TensorRecord(
                    sh.key,
                    sh.global_shape,
                    sh.dtype,
                    sh.global_offset,
                    sh.local_shape,
                    sh.local_chunk_shape,
                    is_main_replica(sh.replica_id),
                    None if rng is None else (rng.start, rng.stop),
                )
            )
        elif isinstance(sh, ShardedObject):
            records.append(
                ObjectRecord(sh.key, sh.unique_key, sh.global_shape, is_main_replica(sh.replica_id))
            )
    return records


def _tensor_shard_problems(key: str, shards: List[Tuple[int, TensorRecord]]) -> List[str]:
    """Problems of one global tensor's shards gathered from all ranks."""
    problems = []
    first = shards[0][1]
    for rank, sh in shards:
        if sh.global_shape != first.global_shape or sh.dtype != first.dtype:
            problems.append(
                f'{key}: rank {rank} has global shape {sh.global_shape} {sh.dtype}, rank '
                f'{shards[0][0]} has {first.global_shape} {first.dtype}'
            )
            return problems
    # Main replicas per chunk (offset) and, for flattened chunks, the ranges they cover.
    mains: Dict[Tuple, List] = defaultdict(list)
    chunks: Dict[Tuple, TensorRecord] = {}
    for rank, sh in shards:
        chunks[sh.global_offset] = sh
        if sh.main:
            mains[sh.global_offset].append((rank, sh.flattened_range))
    volume = 0
    for offset, sh in chunks.items():
        entries = mains.get(offset, [])
        numel = math.prod(sh.local_shape)
        volume += math.prod(sh.local_chunk_shape)
        if not entries:
            problems.append(
                f'Invalid access pattern for {key}: chunk at {offset} has no main replica'
            )
            continue
        ranges = [r for _, r in entries]
        if all(r is None for r in ranges):
            if len(ranges) > 1:
                holders = [rank for rank, _ in entries]
                problems.append(
                    f'Invalid access pattern for {key}: chunk at {offset} has {len(ranges)} main '
                    f'replicas (ranks {holders})'
                )
            continue
        if any(r is None for r in ranges):
            problems.append(f'{key}: chunk at {offset} is both flattened and not')
            continue
        spans = sorted(ranges)
        pos = 0
        for start, stop in spans:
            if start != pos:
                break
            pos = stop
        if pos != numel or len({s for s, _ in spans}) != len(spans):
            problems.append(
                f'Flattened ranges dont cover the whole shard {key} at {offset}: {spans} of '
                f'{numel} elements'
            )
    if not problems and volume != math.prod(first.global_shape):
        problems.append(
            f'Invalid access pattern for {key}: chunks cover {volume} of '
            f'{math.prod(first.global_shape)} elements of global shape {first.global_shape}'
        )
    return problems


def sharding_problems(gathered: List[List]) -> List[str]:
    """At most 5 problems of every rank's records (gathered[rank] = local_sharding_records)."""
    tensors = defaultdict(list)
    objects = defaultdict(list)
    for rank, records in enumerate(gathered):
        for rec in records:
            if isinstance(rec, TensorRecord):
                tensors[rec.key].append((rank, rec))
            else:
                objects[rec.key].append((rank, rec))
    problems = []
    for key in sorted(tensors):
        problems.extend(_tensor_shard_problems(key, tensors[key]))
    for key in sorted(objects):
        mains = [rec.unique_key for _, rec in objects[key] if rec.main]
        duplicates = sorted({k for k in mains if mains.count(k) > 1})
        if duplicates:
            problems.append(f'Duplicate ShardedObject keys: {duplicates}')
        expected = math.prod(objects[key][0][1].global_shape)
        if len(set(mains)) != expected:
            problems.append(
                f'Invalid access pattern: {expected - len(set(mains))} ShardedObject are '
                f'missing (key {key})'
            )
    return problems[:5]


def validate_sharding_integrity(sharded_state_dict, group=None) -> None:
    """Collective over `group` (default: all ranks): raise CheckpointingException on every rank
    if the sharding is inconsistent. The records are gathered on the group's first rank, which
    checks them and broadcasts the verdict."""
    records = local_sharding_records(sharded_state_dict)
    if not torch.distributed.is_initialized():
        problems = sharding_problems([records])
    else:
        root = 0 if group is None else torch.distributed.get_global_rank(group, 0)
        is_root = torch.distributed.get_rank() == root
        size = torch.distributed.get_world_size(group)
        gathered = [None] * size if is_root else None
        torch.distributed.gather_object(records, gathered, dst=root, group=group)
        box = [sharding_problems(gathered) if is_root else None]
        torch.distributed.broadcast_object_list(box, src=root, group=group)
        problems = box[0]
    if problems:
        raise CheckpointingException('; '.join(problems))
