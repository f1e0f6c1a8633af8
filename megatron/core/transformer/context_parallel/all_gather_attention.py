"""All-gather context parallelism (`cp_comm_type='all_gather'`).

Forward: all-gather every rank's keys/values over the CP group once per layer and put them in
natural sequence order (rank g holds chunks g and 2P-1-g). Each of the two local query chunks
(global chunk ids r and 2P-1-r) then attends to the keys up to its own end: the earlier chunks
without a mask and its own chunk with the square causal mask, merged by log-sum-exp.

Backward: all-gather the keys/values again (they are not kept, which saves P-1 key/value blocks of
memory per layer), compute the blocks' gradients with the merged output and log-sum-exp, and
reduce-scatter the key/value gradients back to their owners (sum).

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


def _gather_kv_natural(kv, group, size):
    """[2, b, hkv, 2c, d] per rank -> [2, b, hkv, 2Pc, d] in natural sequence order."""
    # Collectives concatenate along dim 0: [P * 2, b, hkv, 2c, d] -> [P, 2, b, hkv, 2c, d].
    gathered = torch.empty((size * kv.size(0),) + kv.shape[1:], dtype=kv.dtype, device=kv.device)
    all_gather_into_tensor(gathered, kv, group=group)
    gathered = gathered.view(size, *kv.shape)
    chunks = [None] * (2 * size)
    for rank in range(size):
        first, second = gathered[rank].chunk(2, dim=3)
        chunks[rank], chunks[2 * size - 1 - rank] = first, second
    return torch.cat(chunks, dim=3)


def _scatter_dkv_to_owners(dkv_natural, group, size):
    """[2, b, hkv, 2Pc, d] natural-order gradients -> this rank's [2, b, hkv, 2c, d], summed."""
    chunks = dkv_natural.chunk(2 * size, dim=3)
    per_rank = torch.stack(
        [torch.cat([chunks[g], chunks[2 * size - 1 - g]], dim=3) for g in range(size)]
    )  # [P, 2, b, hkv, 2c, d]
    mine = torch.empty(per_rank.shape[1:], dtype=per_rank.dtype, device=per_rank.device)
    # [P, 2, b, hkv, 2c, d] -> [P * 2, b, hkv, 2c, d]: rank g's part is rows [2g, 2g + 2).
    flat = per_rank.reshape(-1, *per_rank.shape[2:])
    reduce_scatter_tensor(mine, flat, group=group)
    return mine


def _blocks(rank, size, chunk, causal):
    """(query rows, key columns of the natural sequence, causal) of every block of this rank."""
    plan = []
    for half, chunk_id in enumerate((rank, 2 * size - 1 - rank)):
        rows = slice(half * chunk, (half + 1) * chunk)
        if not causal:
            plan.append((half, rows, slice(None), False))
            continue
        if chunk_id > 0:
            plan.append((half, rows, slice(0, chunk_id * chunk), False))
        plan.append((half, rows, slice(chunk_id * chunk, (chunk_id + 1) * chunk), True))
    return plan


def _dropout(dropout_p, seed, rank, index):
    if dropout_p == 0.0:
        return None
    return BlockDropout(dropout_p, (seed + 1000003 * rank + 7919 * index) % (2**63))


class AllGatherAttention(torch.autograd.Function):
    """forward(q, k, v, group, causal, scale, dropout_p, dropout_seed): q [b, hq, 2c, d],
    k / v [b, hkv, 2c, d] (dual-chunk layout) -> out [b, hq, 2c, d]."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, dropout_p, dropout_seed):
        size = torch.distributed.get_world_size(group=group)
        rank = torch.distributed.get_rank(group=group)
        chunk = q.size(2) // 2
        kv = _gather_kv_natural(torch.stack([k, v]).contiguous(), group, size)
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for index, (_, rows, cols, block_causal) in enumerate(_blocks(rank, size, chunk, causal)):
            block_out, block_lse = block_forward(
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                causal=block_causal,
                scale=scale,
                dropout=_dropout(dropout_p, dropout_seed, rank, index),
            )
            merge_block_output(out, lse, block_out, block_lse, rows)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.dropout_p, ctx.dropout_seed = dropout_p, dropout_seed
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        size = torch.distributed.get_world_size(group=group)
        rank = torch.distributed.get_rank(group=group)
        chunk = q.size(2) // 2
        kv = _gather_kv_natural(torch.stack([k, v]).contiguous(), group, size)
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        plan = _blocks(rank, size, chunk, ctx.causal)
        for index, (_, rows, cols, block_causal) in enumerate(plan):
            block_dq, block_dk, block_dv = block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal=block_causal,
                scale=ctx.scale,
                dropout=_dropout(ctx.dropout_p, ctx.dropout_seed, rank, index),
            )
            dq[:, :, rows] += block_dq
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
        dkv = _scatter_dkv_to_owners(dkv, group, size)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def all_gather_attention(
    q, k, v, group, *, causal: bool, scale: float, dropout_p: float = 0.0, dropout_seed: int = 0
):
    """All-gather context-parallel attention; see `AllGatherAttention`."""
    return AllGatherAttention.apply(q, k, v, group, causal, scale, dropout_p, dropout_seed)
