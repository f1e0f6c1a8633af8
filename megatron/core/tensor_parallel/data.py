"""Broadcast a batch from the first rank of each tensor parallel group to the others.

Only tp rank 0 reads data; the other tp ranks receive the same tensors. Two broadcasts over the
tp group: the shapes (a small int64 tensor), then all tensors flattened into one buffer.
"""

import math
from typing import Dict, List

import torch

from megatron.core import group_fallbacks
from megatron.core.utils import get_current_device

_MAX_DATA_DIM = 5


def _check_data_types(keys: List[str], data: Dict[str, torch.Tensor], target_dtype: torch.dtype):
    """Every tensor must have the broadcast dtype."""
    for key in keys:
        if data[key].dtype != target_dtype:
            raise ValueError(
                f'{key} has data type {data[key].dtype} which is different than {target_dtype}'
            )


def _build_key_size_numel_dictionaries(
    keys: List[str], data: Dict[str, torch.Tensor], group, src_rank
):
    """Broadcast the shapes from the source rank; returns (key -> size, key -> numel, total)."""
    max_dim = _MAX_DATA_DIM
    sizes = [0 for _ in range(max_dim) for _ in keys]

    # Pack the sizes on the source rank.
    if group.rank() == 0:
        offset = 0
        for key in keys:
            if data[key].dim() >= max_dim:
                raise ValueError(
                    f'{key}: tensors of {data[key].dim()} dims are not supported (max '
                    f'{max_dim - 1})'
                )
            size = data[key].size()
            for i, s in enumerate(size):
                sizes[i + offset] = s
            offset += max_dim

    sizes_tensor = torch.tensor(sizes, dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(sizes_tensor, src_rank, group=group)
    sizes_cpu = sizes_tensor.cpu()

    # Each key owns max_dim slots; its shape is the slots before the first 0.
    slots = sizes_cpu.view(len(keys), max_dim).tolist()
    key_size = {}
    for key, row in zip(keys, slots):
        key_size[key] = row[: row.index(0)] if 0 in row else row
    key_numel = {key: math.prod(size) for key, size in key_size.items()}
    return key_size, key_numel, sum(key_numel.values())


def broadcast_data(
    keys: List[str], data: Dict[str, torch.Tensor], datatype: torch.dtype, tp_group=None
):
    """Broadcast `data[key]` for every key from tp rank 0 to the other tp ranks.

    Args:
        keys: which entries to broadcast (the same list on every rank).
        data: on tp rank 0, the tensors (all of dtype `datatype`, < 5 dims, no zero-size dim);
            ignored on the other ranks.
        datatype: dtype of every tensor.
        tp_group: tensor parallel group (default: the global one).

    Returns:
        key -> tensor on the current device, equal on every rank of the tp group.
    """
    # Fall back to the global tensor model parallel group when none is given.
    group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
    src_rank = torch.distributed.get_global_rank(group, 0)
    key_size, key_numel, total_numel = _build_key_size_numel_dictionaries(
        keys, data, group, src_rank
    )

    device = get_current_device()
    if group.rank() == 0:
        _check_data_types(keys, data, datatype)
        flatten_data = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0).to(
            device
        )
    else:
        flatten_data = torch.empty(total_numel, device=device, dtype=datatype)

    torch.distributed.broadcast(flatten_data, src_rank, group=group)

    # Cut the flat buffer back into the keys' tensors (views, in key order).
    pieces = flatten_data.split([key_numel[key] for key in keys])
    return {key: piece.view(key_size[key]) for key, piece in zip(keys, pieces)}
