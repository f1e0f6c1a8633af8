"""All-gather context parallelism (`cp_comm_type='all_gather'`).

Forward: all-gather every rank's keys/values over the CP group once per layer and put them in
natural sequence order (rank g holds chunks g and 2P-1-g). Each of the two local query chunks
(global chunk ids r and 2P-1-r) then attends to the keys up to its own end: the earlier chunks
without a mask and its own chunk with the square causal mask, merged by log-sum-exp.

Backward: all-gather the keys/values again (they are not kept, which saves P-1 key/value blocks of
memory per layer), compute the blocks' gradients with the merged output and log-sum-exp, and
reduce-scatter the key/value gradients back to their owners (sum).

Packed sequences (`segments`, see `packed.py`): the natural order is that of every sequence
(chunks 0..2P-1 of each), and each query chunk attends only to the chunks of its own sequence.

Traffic per layer: forward (P-1) x |KV| received; backward (P-1) x |KV| received and
(P-1) x |dKV| reduce-scattered. No overlap with compute: simpler than the ring, more memory.
"""

import torch

from megatron.core.tensor_parallel.utils import (
    all_gather_into_tensor,
    reduce_scatter_tensor,
)

from .block_attention import (
    BlockDropout,
    accumulation_dtype,
    block_backward,
    block_forward,
    merge_block_output,
)


def _natural_index(segments, size, local_length, device) -> torch.Tensor:
    """Positions in the rank-major gathered stream (rank g's token t at g * local_length + t) of
    the natural order: per segment (offset o, length 2c), chunks 0..2P-1 of that sequence; chunk
    g < P is the first half of rank g's segment, chunk g >= P the second half of rank 2P-1-g's."""
    pieces = []
    for offset, length in segments:
        chunk = length // 2
        for chunk_id in range(2 * size):
            owner = chunk_id if chunk_id < size else 2 * size - 1 - chunk_id
            start = owner * local_length + offset + (0 if chunk_id < size else chunk)
            pieces.append(torch.arange(start, start + chunk, device=device))
    return torch.cat(pieces)


def _gather_kv_natural(kv, group, size, index):
    """[2, b, hkv, s, d] per rank -> [2, b, hkv, P s, d] in natural (per-segment) order."""
    # Collectives concatenate along dim 0: [P * 2, b, hkv, s, d] -> [P, 2, b, hkv, s, d].
    gathered = torch.empty((size * kv.size(0),) + kv.shape[1:], dtype=kv.dtype, device=kv.device)
    all_gather_into_tensor(gathered, kv, group=group)
    gathered = gathered.view(size, *kv.shape)
    # [P, 2, b, hkv, s, d] -> [2, b, hkv, P, s, d] -> [2, b, hkv, P s, d] (rank-major stream)
    stream = gathered.permute(1, 2, 3, 0, 4, 5).reshape(*kv.shape[:3], -1, kv.size(4))
    return stream.index_select(3, index)


def _scatter_dkv_to_owners(dkv_natural, group, size, index):
    """[2, b, hkv, P s, d] natural-order gradients -> this rank's [2, b, hkv, s, d], summed."""
    stream = torch.zeros_like(dkv_natural).index_copy_(3, index, dkv_natural)
    two, b, h, total, d = stream.shape
    # [2, b, hkv, P s, d] -> [2, b, hkv, P, s, d] -> [P, 2, b, hkv, s, d]
    per_rank = stream.view(two, b, h, size, total // size, d).permute(3, 0, 1, 2, 4, 5)
    mine = torch.empty(per_rank.shape[1:], dtype=per_rank.dtype, device=per_rank.device)
    # [P, 2, b, hkv, s, d] -> [P * 2, b, hkv, s, d]: rank g's part is rows [2g, 2g + 2).
    flat = per_rank.reshape(-1, *per_rank.shape[2:])
    reduce_scatter_tensor(mine, flat, group=group)
    return mine


def _blocks(rank, size, causal, segments):
    """[(query rows, key columns of the natural stream, causal, segment)] of this rank: per
    segment, each local query chunk (global chunk id g) against chunks 0..g-1 of its sequence
    unmasked and chunk g with the causal mask (all 2P chunks unmasked without causality)."""
    plan = []
    for index, (offset, length) in enumerate(segments):
        chunk = length // 2
        natural = size * offset  # the sequence's start in the natural stream
        for half, chunk_id in enumerate((rank, 2 * size - 1 - rank)):
            rows = slice(offset + half * chunk, offset + (half + 1) * chunk)
            if not causal:
                plan.append((rows, slice(natural, natural + size * length), False, index))
                continue
            if chunk_id > 0:
                plan.append((rows, slice(natural, natural + chunk_id * chunk), False, index))
            diagonal = slice(natural + chunk_id * chunk, natural + (chunk_id + 1) * chunk)
            plan.append((rows, diagonal, True, index))
    return plan


def _dropout(dropout_p, seed, rank, index):
    if dropout_p == 0.0:
        return None
    return BlockDropout(dropout_p, (seed + 1000003 * rank + 7919 * index) % (2**63))


class AllGatherAttention(torch.autograd.Function):
    """forward(q, k, v, group, causal, scale, dropout_p, dropout_seed, segments): q [b, hq, 2c, d],
    k / v [b, hkv, 2c, d] (dual-chunk layout; or packed segments [(offset, length)], each its own
    dual-chunk sequence) -> out [b, hq, 2c, d]."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, dropout_p, dropout_seed, segments):
        size = torch.distributed.get_world_size(group=group)
        rank = torch.distributed.get_rank(group=group)
        segments = segments or [(0, q.size(2))]
        index = _natural_index(segments, size, q.size(2), q.device)
        kv = _gather_kv_natural(torch.stack([k, v]).contiguous(), group, size, index)
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for number, (rows, cols, block_causal, _) in enumerate(
            _blocks(rank, size, causal, segments)
        ):
            block_out, block_lse = block_forward(
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                causal=block_causal,
                scale=scale,
                dropout=_dropout(dropout_p, dropout_seed, rank, number),
            )
            merge_block_output(out, lse, block_out, block_lse, rows)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.dropout_p, ctx.dropout_seed = dropout_p, dropout_seed
        ctx.segments, ctx.index = segments, index
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        size = torch.distributed.get_world_size(group=group)
        rank = torch.distributed.get_rank(group=group)
        kv = _gather_kv_natural(torch.stack([k, v]).contiguous(), group, size, ctx.index)
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        plan = _blocks(rank, size, ctx.causal, ctx.segments)
        for number, (rows, cols, block_causal, _) in enumerate(plan):
            block_dq, block_dk, block_dv = block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal=block_causal,
                scale=ctx.scale,
                dropout=_dropout(ctx.dropout_p, ctx.dropout_seed, rank, number),
            )
            dq[:, :, rows] += block_dq
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
        dkv = _scatter_dkv_to_owners(dkv, group, size, ctx.index)
        grads = dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return grads + (None,) * 6


def all_gather_attention(
    q,
    k,
    v,
    group,
    *,
    causal: bool,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    segments=None,
):
    """All-gather context-parallel attention; see `AllGatherAttention`."""
    return AllGatherAttention.apply(
        q, k, v, group, causal, scale, dropout_p, dropout_seed, segments
    )
