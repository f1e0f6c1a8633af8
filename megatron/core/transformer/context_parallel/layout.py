"""The dual-chunk (load-balanced) sequence layout of context parallelism.

With context parallel size P, the sequence of length s is viewed as 2P chunks of c = s / (2P)
tokens. CP rank r holds chunks r and 2P-1-r, in that order (Megatron's `get_batch_on_this_cp_rank`,
Transformer Engine's "DualChunkSwap"). Example, P = 2, s = 8: rank 0 holds positions
[0, 1, 6, 7], rank 1 holds [2, 3, 4, 5]. Under a causal mask every rank then has the same amount of
attention work: an early chunk (little to attend to) is paired with a late one (much to attend to).

The same layout is used for every CP communication type (p2p, all_gather, a2a, a2a+p2p); only the
attention op differs.
"""

from typing import Dict, Optional

import torch
from torch import Tensor


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple:
    """The two global chunk indices held by `cp_rank`: (r, 2P-1-r)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_global_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """Global positions of the s / P local tokens of `cp_rank`, in local order.

    Local index t < c maps to r*c + t; local index t >= c maps to (2P-1-r)*c + (t - c).
    """
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length ({seq_length}) must be divisible by 2 x context parallel size "
            f"({cp_size})"
        )
    chunk = seq_length // (2 * cp_size)
    first, second = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def slice_for_cp_rank(tensor: Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> Tensor:
    """This rank's two chunks of `tensor` along `seq_dim` (length s -> s / P), chunk r first.

    Size 1 returns the tensor itself.
    """
    if cp_size == 1:
        return tensor
    seq_length = tensor.size(seq_dim)
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence dimension {seq_dim} has length {seq_length}, not divisible by 2 x context "
            f"parallel size ({cp_size})"
        )
    chunk = seq_length // (2 * cp_size)
    # [..., s, ...] -> [..., 2P, c, ...]
    viewed = tensor.view(*tensor.shape[:seq_dim], 2 * cp_size, chunk, *tensor.shape[seq_dim + 1 :])
    index = torch.tensor(cp_chunk_ids(cp_size, cp_rank), device=tensor.device)
    picked = viewed.index_select(seq_dim, index)  # [..., 2, c, ...]
    return picked.reshape(*tensor.shape[:seq_dim], 2 * chunk, *tensor.shape[seq_dim + 1 :])


def gather_from_cp_layout(local_parts, seq_dim: int) -> Tensor:
    """Inverse of `slice_for_cp_rank`: the full sequence from every rank's local tensor.

    Args:
        local_parts: the P local tensors, in CP rank order.
        seq_dim: their sequence dimension (length s / P each).
    """
    cp_size = len(local_parts)
    chunks = [None] * (2 * cp_size)
    for rank, part in enumerate(local_parts):
        first, second = torch.chunk(part, 2, dim=seq_dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = first, second
    return torch.cat(chunks, dim=seq_dim)


def get_batch_on_this_cp_rank(
    batch: Dict[str, Optional[Tensor]], cp_size: int, cp_rank: int
) -> Dict[str, Optional[Tensor]]:
    """Slice every tensor of a GPT micro-batch to this CP rank's two chunks.

    tokens, labels, loss_mask and position_ids ([b, s]) are sliced along dim 1; attention_mask
    ([b, 1, s, s]) along dim 2 only (its query rows: the keys stay the full sequence). None entries
    stay None. The labels are already shifted by the dataset, so no token crosses a chunk border.
    Position ids keep their global values (learned position embeddings look them up as they are).
    """
    if cp_size == 1:
        return batch
    sliced = {}
    for key, value in batch.items():
        if value is None:
            sliced[key] = None
        else:
            seq_dim = 2 if key == 'attention_mask' else 1
            sliced[key] = slice_for_cp_rank(value, seq_dim, cp_size, cp_rank)
    return sliced
