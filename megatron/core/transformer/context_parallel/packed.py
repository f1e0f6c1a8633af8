"""Packed sequences (THD) under context parallelism: the per-sequence dual-chunk layout.

Megatron's rule (its `get_thd_batch_on_this_cp_rank`, with the indices of Transformer Engine's
`thd_get_partitioned_indices`): the dataset pads every packed sequence to a multiple of 2 x cp,
and each sequence is split ON ITS OWN into 2cp chunks of c_k = len_k / (2cp) tokens; CP rank r
keeps chunks r and 2cp-1-r of EVERY sequence, sequence after sequence. (The whole-sample split of
`layout.py` would cut sequences anywhere and leave the causal work of each sequence unbalanced.)

Example, cp = 2, a sample of 12 tokens holding sequences of 4 and 8 tokens (chunks of 1 and 2):
rank 0 keeps positions [0, 3, 4, 5, 10, 11], rank 1 keeps [1, 2, 6, 7, 8, 9].

On a rank, sequence k then occupies 2 c_k consecutive tokens [chunk r | chunk 2cp-1-r]: the local
stream is again a packed stream, its segments the padded lengths / cp, and each segment is a small
dual-chunk sequence, so the CP attention schemes run per segment unchanged (`packed_segments`).
A local token's position in its sequence is r c_k + t for t < c_k, else (2cp-1-r) c_k + t - c_k.

Real (unpadded) tokens: the dataset pads a sequence at its end, so on every rank the real tokens of
a sequence are a prefix of its local segment (if chunk r is not all real, the later chunk
2cp-1-r is all padding). Their number is Transformer Engine's `get_cu_seqlens_on_cp_rank`:

    min(max(n - r c, 0), c) + min(max(n - (2cp-1-r) c, 0), c)      (n real tokens of 2cp c)

The PackedSeqParams of a rank (`get_thd_batch_on_this_cp_rank`) hold its local values:
`cu_seqlens_q_padded` = the segment offsets in the local stream (the global ones / cp, the same on
every rank), `cu_seqlens_q` = the cumulative real-token counts of this rank.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams, packed_segment_ids

#: Batch entries that hold one value per token ([b, L]) and are split per sequence.
TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def sample_boundaries(cu_seqlens_row: Tensor, seq_length: int) -> List[int]:
    """Segment boundaries [0, ..., L] of one sample from the dataset's row (segment starts, then
    L, right-filled with L)."""
    values = [int(x) for x in cu_seqlens_row.tolist()]
    return values[: values.index(seq_length) + 1]


def thd_partitioned_indices(boundaries: List[int], cp_size: int, cp_rank: int) -> List[int]:
    """The positions of one sample that CP rank `cp_rank` keeps, in local order: chunks r and
    2cp-1-r of every sequence (`boundaries` = [0, ..., L], each length a multiple of 2cp; with
    cp = 1 any lengths, and all positions are kept)."""
    if cp_size == 1:
        return list(range(boundaries[0], boundaries[-1]))
    index = []
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        chunk = (end - start) // (2 * cp_size)
        for chunk_id in (cp_rank, 2 * cp_size - 1 - cp_rank):
            first = start + chunk_id * chunk
            index.extend(range(first, first + chunk))
    return index


def real_tokens_on_cp_rank(padded_length: int, real: int, cp_size: int, cp_rank: int) -> int:
    """Real tokens of a sequence (`real` of `padded_length`) that CP rank `cp_rank` holds."""
    if cp_size == 1:
        return real
    chunk = padded_length // (2 * cp_size)
    return sum(
        min(max(real - chunk_id * chunk, 0), chunk)
        for chunk_id in (cp_rank, 2 * cp_size - 1 - cp_rank)
    )


def _check_boundaries(boundaries, real_lengths, cp_size, sample):
    multiple = 2 * cp_size
    for k, (start, end) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        if cp_size > 1 and (end - start) % multiple:
            raise ValueError(
                f"packed sequence {k} of sample {sample} has {end - start} tokens, not a multiple "
                f"of 2 x context parallel size ({multiple}): the dataset must pad each sequence "
                "for this --context-parallel-size"
            )
        if not 0 <= real_lengths[k] <= end - start:
            raise ValueError(
                f"packed sequence {k} of sample {sample}: {real_lengths[k]} real tokens do not "
                f"fit its {end - start} positions"
            )


def get_thd_batch_on_this_cp_rank(
    batch: Dict[str, Optional[Tensor]], cp_size: int, cp_rank: int
) -> Tuple[Dict[str, Optional[Tensor]], PackedSeqParams]:
    """This CP rank's share of a packed micro-batch and its PackedSeqParams.

    Args:
        batch: `tokens`, `labels`, `loss_mask`, `position_ids` ([b, L] each, or None where a
            pipeline stage does not need them), `cu_seqlens` (int [b, L + 1]: segment starts,
            then L, right-filled with L; every segment a multiple of 2 x cp long),
            `cu_seqlens_unpadded` (int [b, L + 1]: cumulative real tokens of the segments,
            right-filled with the total; None: no padding inside segments).
        cp_size, cp_rank: the context parallel group. Size 1 runs the same code (keeps all).

    Returns:
        (the token fields sliced to [b, L / cp] by the per-sequence split; PackedSeqParams over
        the batch-major local stream of b * L / cp tokens: cu_seqlens_q/kv the cumulative real
        tokens of this rank, cu_seqlens_q/kv_padded the segment offsets, max_seqlen_q/kv the
        longest local segment).
    """
    cu_seqlens = batch["cu_seqlens"]
    unpadded = batch.get("cu_seqlens_unpadded")
    b, seq_length = cu_seqlens.shape[0], cu_seqlens.shape[1] - 1
    if cp_size > 1 and seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length ({seq_length}) must be divisible by 2 x context parallel size "
            f"({cp_size})"
        )
    local_length = seq_length // cp_size
    indices, offsets, real_counts = [], [0], [0]
    for i in range(b):
        bounds = sample_boundaries(cu_seqlens[i], seq_length)
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        if unpadded is None:
            real = lengths
        else:
            cumulative = [int(x) for x in unpadded[i, : len(bounds)].tolist()]
            real = [hi - lo for lo, hi in zip(cumulative[:-1], cumulative[1:])]
        _check_boundaries(bounds, real, cp_size, i)
        indices.append(thd_partitioned_indices(bounds, cp_size, cp_rank))
        for length, n in zip(lengths, real):
            offsets.append(offsets[-1] + length // cp_size)
            real_counts.append(
                real_counts[-1] + real_tokens_on_cp_rank(length, n, cp_size, cp_rank)
            )
        assert offsets[-1] == (i + 1) * local_length, (offsets[-1], i, local_length)
    device = cu_seqlens.device
    index = torch.tensor(indices, dtype=torch.int64, device=device)  # [b, L / cp]
    sliced = dict(batch)
    for key in TOKEN_FIELDS:
        if sliced.get(key) is not None:
            sliced[key] = torch.gather(sliced[key], 1, index)
    offsets_t = torch.tensor(offsets, dtype=torch.int32, device=device)
    real_t = torch.tensor(real_counts, dtype=torch.int32, device=device)
    longest = torch.diff(offsets_t).max()
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=real_t,
        cu_seqlens_kv=real_t,
        cu_seqlens_q_padded=offsets_t,
        cu_seqlens_kv_padded=offsets_t,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return sliced, params


def packed_position_ids_on_cp_rank(
    offsets: Tensor, total: int, cp_size: int = 1, cp_rank: int = 0
) -> Tensor:
    """Each local token's position within its sequence: int64 [total].

    Args:
        offsets: segment offsets of the local stream (cu_seqlens_q_padded, or cu_seqlens_q
            without padding), ending at `total`.
        total: tokens in the local stream.
        cp_size, cp_rank: the per-sequence split (size 1: positions restart at every offset).
    """
    offsets = offsets.to(torch.int64)
    segment = packed_segment_ids(offsets, total)
    local = torch.arange(total, device=offsets.device) - offsets[segment]
    if cp_size == 1:
        return local
    chunk = (offsets[segment + 1] - offsets[segment]) // 2
    return torch.where(
        local < chunk, cp_rank * chunk + local, (2 * cp_size - 1 - cp_rank) * chunk + local - chunk
    )


def packed_segments(packed_seq_params: PackedSeqParams, total: int) -> List[Tuple[int, int]]:
    """(offset, length) of every segment of the local stream, for the CP attention schemes.

    Raises:
        ValueError: offsets that do not cover the stream of `total` tokens, or a segment of odd
            local length (each sequence must be padded to a multiple of 2 x cp).
    """
    bounds = [int(x) for x in packed_seq_params.segment_offsets().tolist()]
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"packed sequence offsets run from {bounds[0]} to {bounds[-1]}, but this rank's "
            f"stream has {total} tokens (PackedSeqParams must be those of this CP rank)"
        )
    segments = [(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
    odd = [length for _, length in segments if length % 2]
    if odd:
        raise ValueError(
            f"a packed sequence has {odd[0]} tokens on this context parallel rank, not an even "
            "number: each sequence must be padded to a multiple of 2 x context parallel size"
        )
    return segments
