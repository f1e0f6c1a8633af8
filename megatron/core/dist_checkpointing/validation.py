"""Checks of a sharded state dict: sharding integrity (save and load) and key strictness (load).

Sharding integrity: every chunk of every global tensor has exactly one main replica across the
ranks, chunks agree on dtype and global shape, flattened ranges tile their chunk, and every
cell of a ShardedObject grid has one main replica. All ranks gather their metadata (one
`all_gather_object`), rank 0 checks, and every rank raises the same one-line error.

Strictness (`--dist-ckpt-strictness`): "unexpected" keys are requested but absent from the
checkpoint; "missing" keys are in the checkpoint but requested by no rank (a global exchange).
"""

import logging
import math
from collections import defaultdict
from enum import Enum
from typing import Dict, List, Optional, Set, Tuple

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


def _gather(obj, group=None) -> List:
    if not torch.distributed.is_initialized():
        return [obj]
    out = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def _tensor_shard_problems(key: str, shards: List[Tuple[int, ShardedTensor]]) -> List[str]:
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
    chunks: Dict[Tuple, ShardedTensor] = {}
    for rank, sh in shards:
        chunks[sh.global_offset] = sh
        if is_main_replica(sh.replica_id):
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
        spans = sorted((r.start, r.stop) for r in ranges)
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


def validate_sharding_integrity(sharded_state_dict, group=None) -> None:
    """Collective: raise CheckpointingException on every rank if the sharding is inconsistent."""
    local = [
        sh.without_data()
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, (ShardedTensor, ShardedObject))
    ]
    gathered = _gather(local, group)
    problems = []
    if _rank() == 0 or not torch.distributed.is_initialized():
        tensors = defaultdict(list)
        objects = defaultdict(list)
        for rank, shards in enumerate(gathered):
            for sh in shards:
                if isinstance(sh, ShardedTensor):
                    tensors[sh.key].append((rank, sh))
                else:
                    objects[sh.key].append((rank, sh))
        for key in sorted(tensors):
            problems.extend(_tensor_shard_problems(key, tensors[key]))
        for key in sorted(objects):
            mains = [sh.unique_key for _, sh in objects[key] if is_main_replica(sh.replica_id)]
            duplicates = sorted({k for k in mains if mains.count(k) > 1})
            if duplicates:
                problems.append(f'Duplicate ShardedObject keys: {duplicates}')
            expected = math.prod(objects[key][0][1].global_shape)
            if len(set(mains)) != expected:
                problems.append(
                    f'Invalid access pattern: {expected - len(set(mains))} ShardedObject are '
                    f'missing (key {key})'
                )
    verdict = _broadcast_from_0(problems[:5])
    if verdict:
        raise CheckpointingException('; '.join(verdict))


def _broadcast_from_0(obj):
    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
