"""Fully parallel save and load: replicated shards are spread over the data-parallel group.

Save (`FullyParallelSaveStrategyWrapper`, on by default, `--no-ckpt-fully-parallel-save`
disables it): without it, DP rank 0 writes every tensor its DP group holds. With it, every shard
whose main replica lies in the group is assigned to one holder, deterministically on all ranks
(fewest holders first, then larger shards first, then the shard id; each goes to the least
loaded holder), and the replica ids are rewritten: the chosen holder's becomes 0 (main), the
others' 1. The checkpoint is the same; the writing is spread over DP ranks.

Load (`FullyParallelLoadStrategyWrapper`, `--ckpt-fully-parallel-load`): a shard held by every
rank of the DP group is read by its assigned rank only and broadcast to the others, so the
storage is read once per DP group instead of DP times. Shards held by a single rank
(distributed-optimizer ranges) are read by that rank.
"""

from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
)

ShardId = Tuple


def _shard_id(sh: ShardedTensor) -> ShardId:
    rng = sh.flattened_range
    return (sh.key, tuple(sh.global_offset), None if rng is None else (rng.start, rng.stop))


def _numel(sh: ShardedTensor) -> int:
    if sh.flattened_range is not None:
        return sh.flattened_range.stop - sh.flattened_range.start
    n = 1
    for d in sh.local_shape:
        n *= d
    return n


def _gather_shards(sharded_state_dict: ShardedStateDict, group):
    """Collective over `group`: ({shard id: holder ranks}, {shard id: numel}, main shard ids)."""
    local = [
        (_shard_id(sh), _numel(sh), is_main_replica(sh.replica_id))
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, ShardedTensor)
    ]
    gathered: List = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, local, group=group)
    holders, sizes, has_main = defaultdict(list), {}, set()
    for rank, shards in enumerate(gathered):
        for shard_id, numel, main in shards:
            holders[shard_id].append(rank)
            sizes[shard_id] = numel
            if main:
                has_main.add(shard_id)
    return holders, sizes, has_main


def _assign(holders, sizes, has_main, size: int, only_main: bool) -> Dict[ShardId, int]:
    candidates = [s for s in holders if s in has_main] if only_main else list(holders)
    candidates.sort(key=lambda s: (len(holders[s]), -sizes[s], repr(s)))
    load = [0] * size
    assignment = {}
    for shard_id in candidates:
        rank = min(holders[shard_id], key=lambda r: (load[r], r))
        assignment[shard_id] = rank
        load[rank] += sizes[shard_id]
    return assignment


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict, group, only_main: bool = True
) -> Dict[ShardId, int]:
    """{shard id: group rank that handles it} (collective over `group`, deterministic)."""
    holders, sizes, has_main = _gather_shards(sharded_state_dict, group)
    size = torch.distributed.get_world_size(group)
    return _assign(holders, sizes, has_main, size, only_main)


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict, group, assignment: Dict[ShardId, int]
) -> None:
    """Rewrite replica ids: 0 where this rank was assigned the shard, 1 elsewhere."""
    rank = torch.distributed.get_rank(group)
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            owner = assignment.get(_shard_id(sh))
            if owner is not None:
                sh.replica_id = 0 if owner == rank else 1


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Spread the writing of replicated shards over `parallelization_group` (see above).

    Args:
        strategy: the wrapped save strategy.
        parallelization_group: the data-parallel group (with context parallelism).
        do_cache_distribution: compute the assignment once (`--ckpt-assume-constant-structure`).
    """

    def __init__(
        self,
        strategy: AsyncSaveShardedStrategy,
        parallelization_group=None,
        do_cache_distribution: bool = False,
    ):
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: Optional[Dict] = None

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        if (
            self.parallelization_group is None
            or torch.distributed.get_world_size(self.parallelization_group) == 1
        ):
            return
        if self.do_cache_distribution and self.cached_distribution is not None:
            assignment = self.cached_distribution
        else:
            assignment = determine_main_replica_uniform_distribution(
                sharded_state_dict, self.parallelization_group
            )
            if self.do_cache_distribution:
                self.cached_distribution = assignment
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, self.parallelization_group, assignment
        )

    @property
    def supports_preflight(self) -> bool:
        return getattr(self.base_strategy, 'supports_preflight', False)

    def save_request(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str, stage, preflight=None
    ):
        """The wrapped strategy's request after spreading the main replicas."""
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save_request(sharded_state_dict, checkpoint_dir, stage, preflight)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str, **kwargs):
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir, **kwargs)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str, **kwargs) -> None:
        self.apply_saving_parallelization(sharded_state_dict)
        self.base_strategy.save(sharded_state_dict, checkpoint_dir, **kwargs)


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Read each shard the whole DP group needs once and broadcast it (see above).

    Args:
        strategy: the wrapped load strategy (reads in place).
        parallelization_group: the data-parallel group; a gloo group for CPU tensors.
    """

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group=None):
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> ShardedStateDict:
        group = self.parallelization_group
        if group is None or torch.distributed.get_world_size(group) == 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        size = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        tensors = [sh for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
        holders, sizes, has_main = _gather_shards(sharded_state_dict, group)  # one exchange
        assignment = _assign(holders, sizes, has_main, size, only_main=False)
        holders_all = {sid for sid, ranks in holders.items() if len(set(ranks)) == size}
        mine, others = [], []
        for sh in tensors:
            sid = _shard_id(sh)
            if sid in holders_all and assignment[sid] != rank:
                others.append(sh)
            else:
                mine.append(sh)
        # Everything but the tensors others read for us (objects are read by every rank).
        skip = {id(sh) for sh in others}
        request = [x for x in nested_values(sharded_state_dict) if id(x) not in skip]
        self.base_strategy.load({i: x for i, x in enumerate(request)}, checkpoint_dir)
        ranks = torch.distributed.get_process_group_ranks(group)
        by_id = {}
        for sh in tensors:
            by_id.setdefault(_shard_id(sh), []).append(sh)
        for sid in sorted(holders_all, key=repr):
            src = ranks[assignment[sid]]
            first = by_id[sid][0]
            with torch.no_grad():
                buf = first.data.detach().contiguous()
                torch.distributed.broadcast(buf, src=src, group=group)
                for sh in by_id[sid]:
                    if sh.data.data_ptr() != buf.data_ptr():
                        sh.data.detach().copy_(buf.view_as(sh.data))
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: str):
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def stored_keys(self, checkpoint_dir: str) -> set:
        return self.base_strategy.stored_keys(checkpoint_dir)


# Megatron's private names, which its unit tests import.
_ShardId = ShardId
_sharded_tensor_shard_id = _shard_id
