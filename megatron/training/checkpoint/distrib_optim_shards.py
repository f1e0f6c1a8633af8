"""Per-data-parallel-rank distributed-optimizer files: `distrib_optim_dp<rank>.pt`.

Megatron's legacy layout gathers every rank's optimizer shards to data-parallel rank 0, which
writes one `distrib_optim.pt`: the save is as slow as the gather plus one writer. Here every DP
rank writes its own shard next to `model_optim_rng.pt`, in parallel and without a collective:

    iter_0000500/mp_rank_00/distrib_optim_dp000.pt ... distrib_optim_dp003.pt   (DP = 4)

Each file is `{'format', 'data_parallel_rank', 'data_parallel_world_size', 'state'}` with `state`
from the optimizer's `get_parameter_state_shard()`. Loading memory-maps every shard of the folder
and each rank copies only the saved ranges overlapping its own new shard, so the files load at
any DP size (same model and bucket size). A folder holding only `distrib_optim.pt` (the legacy
layout) still loads through the optimizer's `load_parameter_state`.
"""

import os
from typing import Any, Callable, Dict, List, Optional

import torch

SHARD_FILE_FORMAT = 'megatron-distrib-optim-dp-shard-file-v1'


def shard_name(model_checkpoint_name: str, data_parallel_rank: int) -> str:
    """`distrib_optim_dp<rank:03d>.pt` next to a rank's `model_optim_rng.pt`."""
    folder = os.path.dirname(model_checkpoint_name)
    return os.path.join(folder, f'distrib_optim_dp{data_parallel_rank:03d}.pt')


def write_shard(optimizer, filename: str, data_parallel_rank: int, data_parallel_world_size: int):
    """torch.save this rank's optimizer shard to `filename` and flush it to disk (no collective).

    The caller writes to a temporary name and renames it only after every rank succeeded.
    """
    shard = {
        'format': SHARD_FILE_FORMAT,
        'data_parallel_rank': data_parallel_rank,
        'data_parallel_world_size': data_parallel_world_size,
        'state': optimizer.get_parameter_state_shard(),
    }
    with open(filename, 'wb') as f:
        torch.save(shard, f)
        f.flush()
        os.fsync(f.fileno())


def load_shards(
    model_checkpoint_name: str, load_fn: Callable[[str], Dict[str, Any]]
) -> Optional[List[Dict]]:
    """The `state` of every saved rank's shard in the folder, or None when there are none.

    `load_fn` opens a file (memory-mapped, weights only). The saved DP size is read from rank
    0's shard; shards of higher ranks (left by an earlier save at a larger DP size) are ignored.

    Raises:
        ValueError: a shard file of the saved DP size is missing or names another DP layout.
    """
    first = shard_name(model_checkpoint_name, 0)
    if not os.path.isfile(first):
        return None
    shards = [load_fn(first)]
    saved_dp = shards[0].get('data_parallel_world_size')
    for rank in range(1, saved_dp):
        name = shard_name(model_checkpoint_name, rank)
        if not os.path.isfile(name):
            raise ValueError(
                f'{first} was saved at data-parallel size {saved_dp} but {name} is missing'
            )
        shards.append(load_fn(name))
    for rank, shard in enumerate(shards):
        if (
            shard.get('format') != SHARD_FILE_FORMAT
            or shard.get('data_parallel_rank') != rank
            or shard.get('data_parallel_world_size') != saved_dp
        ):
            raise ValueError(
                f'{shard_name(model_checkpoint_name, rank)} is not data-parallel rank {rank} of '
                f'{saved_dp} (a shard from another save?)'
            )
    return [shard['state'] for shard in shards]


def load_expert_parallel_shards(
    model_checkpoint_name: str,
    load_fn: Callable[[str], Dict[str, Any]],
    expert_parallel_size: int,
    expert_parallel_rank: int,
) -> Optional[List[List[Dict]]]:
    """With expert parallelism: [dense shards, expert shards] for a chained (dense, expert)
    distributed optimizer, or None when the folder holds no shard.

    Expert-parallel rank r's folder (`..._{r:03d}`) holds the files of the data-parallel ranks
    whose expert-parallel rank is r. The dense optimizer is sharded over all data-parallel ranks,
    so its shards come from every sibling folder; the expert optimizer is sharded over the ranks
    holding the same experts, whose files are all in this rank's folder.
    """
    folder = os.path.dirname(model_checkpoint_name)
    suffix = f'_{expert_parallel_rank:03d}'
    if not folder.endswith(suffix):
        raise ValueError(
            f'{folder} is not the folder of expert-parallel rank {expert_parallel_rank}'
        )
    if not any(n.startswith('distrib_optim_dp') for n in os.listdir(folder)):
        return None
    by_rank = {}
    mine = []
    for rank in range(expert_parallel_size):
        sibling = os.path.join(folder[: -len(suffix)] + f'_{rank:03d}', 'model_optim_rng.pt')
        names = sorted(
            name
            for name in os.listdir(os.path.dirname(sibling))
            if name.startswith('distrib_optim_dp') and name.endswith('.pt')
        )
        for name in names:
            shard = load_fn(os.path.join(os.path.dirname(sibling), name))
            if shard.get('format') != SHARD_FILE_FORMAT:
                raise ValueError(f'{name} in {os.path.dirname(sibling)} is not an optimizer shard')
            by_rank[shard['data_parallel_rank']] = shard
            if rank == expert_parallel_rank:
                mine.append(shard)
    saved_dp = by_rank[min(by_rank)]['data_parallel_world_size']
    if sorted(by_rank) != list(range(saved_dp)):
        raise ValueError(
            f'{folder}: the optimizer shards of its expert-parallel siblings are data-parallel '
            f'ranks {sorted(by_rank)}, not 0..{saved_dp - 1}'
        )
    dense = [by_rank[r]['state'] for r in range(saved_dp)]
    return [dense, [shard['state'] for shard in mine]]
