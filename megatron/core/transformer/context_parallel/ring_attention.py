"""Ring attention (`cp_comm_type='p2p'`): key/value blocks travel around the CP group.

Inputs on CP rank r of P hold the dual-chunk layout (see `layout.py`): local sequence
[chunk r | chunk 2P-1-r], each chunk c tokens. At step i = 0..P-1 rank r holds the keys/values of
rank j = (r - i) mod P and computes one block (causal mask, load balanced):

    i = 0        both query chunks x both KV chunks, causal (the order [r, 2P-1-r] is the same
                 on both sides, so the square causal mask is exact)
    1 <= i <= r  (j < r) both query chunks x KV chunk j only, no mask: chunk j precedes both query
                 chunks, chunk 2P-1-j follows both of them
    i > r        (j > r) query chunk 2P-1-r only x both KV chunks, no mask: query chunk r
                 precedes both KV chunks

Each step costs about 2c^2 scores on every rank. The partial outputs are merged by their
log-sum-exp (`merge_block_output`). While a block computes, its keys/values are sent to rank r+1
and the next ones received from rank r-1 (P-1 transfers; the next transfer overlaps the current
block's compute).

Backward walks the ring the other way: it starts from the last keys/values received in forward
(owner r+1, the only ones saved) and sends keys/values to r-1. A key/value gradient accumulator
travels one hop behind its keys/values: each rank adds its contribution for the block it holds
and passes the sum on; after P-1 hops it arrives, complete, at the owner. Query gradients stay
local. Traffic per layer: forward (P-1) x |KV|; backward (P-1) x |KV| + (P-1) x |dKV| (dKV in
fp32).

Communication: `torch.distributed.batch_isend_irecv` on the CP group (global peer ranks), which
works with gloo and NCCL, also for P = 2 where both directions share one peer.

Packed sequences (`segments`): with the per-sequence split (`packed.py`) every sequence is its own
dual-chunk sequence inside the local stream, so each step runs the plan above once per segment
(its halves are the segment's two chunks) and a segment never meets another one's keys. Without
segments the whole local sequence is the one segment.
"""

from typing import List, Optional

import torch
from torch import Tensor

from .block_attention import (
    BlockDropout,
    accumulation_dtype,
    block_backward,
    block_forward,
    merge_block_output,
)


def _ring_peers(group) -> tuple:
    """(rank in group, group size, global rank of next, global rank of previous)."""
    if group is None:
        return 0, 1, None, None
    ranks = torch.distributed.get_process_group_ranks(group)
    size = len(ranks)
    rank = torch.distributed.get_rank(group=group)
    return rank, size, ranks[(rank + 1) % size], ranks[(rank - 1) % size]


def _start_exchange(sends, recvs, group) -> List:
    """Post sends [(tensor, dst)] and receives [(tensor, src)] at once; returns the requests."""
    ops = [torch.distributed.P2POp(torch.distributed.isend, t, peer, group) for t, peer in sends]
    ops += [torch.distributed.P2POp(torch.distributed.irecv, t, peer, group) for t, peer in recvs]
    if not ops:
        return []
    return torch.distributed.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _block_plan(step: int, rank: int, size: int, causal: bool, segments):
    """[(query rows, kv rows, causal mask, segment index)] of forward step `step` on `rank`: the
    plan of the module docstring applied to every (offset, length) segment."""
    owner = (rank - step) % size
    plan = []
    for index, (offset, length) in enumerate(segments):
        chunk = length // 2
        full = slice(offset, offset + length)
        if not causal:
            plan.append((full, full, False, index))
        elif step == 0:
            plan.append((full, full, True, index))
        elif owner < rank:
            plan.append((full, slice(offset, offset + chunk), False, index))
        else:
            plan.append((slice(offset + chunk, offset + length), full, False, index))
    return plan


def _dropout_for(dropout_p: float, seed: int, rank: int, step: int, size: int, segment: int):
    if dropout_p == 0.0:
        return None
    owner = (rank - step) % size
    # One mask per (query rank, key owner, segment); the backward rebuilds the same one.
    return BlockDropout(
        dropout_p, (seed + 1000003 * rank + 7919 * owner + 104723 * segment) % (2**63)
    )


class RingAttention(torch.autograd.Function):
    """Load-balanced causal ring attention over a CP group (see the module docstring).

    forward(q, k, v, group, causal, scale, dropout_p, dropout_seed, segments):
        q [b, hq, 2c, d], k / v [b, hkv, 2c, d] (this rank's dual-chunk sequence); group None
        means one rank; segments [(offset, length)] of packed sequences (None: one). Returns
        out [b, hq, 2c, d] in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, dropout_p, dropout_seed, segments):
        rank, size, next_rank, prev_rank = _ring_peers(group)
        segments = segments or [(0, q.size(2))]
        kv = torch.stack([k, v]).contiguous()  # [2, b, hkv, 2c, d]
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for step in range(size):
            requests, next_kv = [], None
            if step + 1 < size:
                next_kv = torch.empty_like(kv)
                requests = _start_exchange([(kv, next_rank)], [(next_kv, prev_rank)], group)
            for q_rows, kv_rows, block_causal, segment in _block_plan(
                step, rank, size, causal, segments
            ):
                block_out, block_lse = block_forward(
                    q[:, :, q_rows],
                    kv[0][:, :, kv_rows],
                    kv[1][:, :, kv_rows],
                    causal=block_causal,
                    scale=scale,
                    dropout=_dropout_for(dropout_p, dropout_seed, rank, step, size, segment),
                )
                merge_block_output(out, lse, block_out, block_lse, q_rows)
            _wait(requests)
            if next_kv is not None:
                kv = next_kv
        out = out.to(q.dtype)
        # kv now holds the keys/values of rank r+1: the backward ring starts from them.
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        ctx.dropout_p, ctx.dropout_seed = dropout_p, dropout_seed
        ctx.k_dtype, ctx.segments = k.dtype, segments
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, size, next_rank, prev_rank = _ring_peers(group)
        acc = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv: Optional[Tensor] = None
        for back_step in range(size):
            step = size - 1 - back_step  # the forward step this block belongs to
            sends, recvs, next_kv, dkv_in = [], [], None, None
            if back_step + 1 < size:
                next_kv = torch.empty_like(kv)
                sends.append((kv, prev_rank))
                recvs.append((next_kv, next_rank))
            if back_step > 0:
                # Pass our finished partial dKV on; receive the partial dKV of the block we hold.
                dkv_in = torch.empty_like(dkv)
                sends.append((dkv, prev_rank))
                recvs.append((dkv_in, next_rank))
            requests = _start_exchange(sends, recvs, group)
            block_grads = []
            for q_rows, kv_rows, block_causal, segment in _block_plan(
                step, rank, size, ctx.causal, ctx.segments
            ):
                block_dq, block_dk, block_dv = block_backward(
                    dout[:, :, q_rows],
                    q[:, :, q_rows],
                    kv[0][:, :, kv_rows],
                    kv[1][:, :, kv_rows],
                    out[:, :, q_rows],
                    lse[:, :, q_rows],
                    causal=block_causal,
                    scale=ctx.scale,
                    dropout=_dropout_for(
                        ctx.dropout_p, ctx.dropout_seed, rank, step, size, segment
                    ),
                )
                dq[:, :, q_rows] += block_dq
                block_grads.append((kv_rows, block_dk, block_dv))
            _wait(requests)
            if dkv_in is None:
                dkv_in = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            for kv_rows, block_dk, block_dv in block_grads:
                dkv_in[0][:, :, kv_rows] += block_dk
                dkv_in[1][:, :, kv_rows] += block_dv
            dkv = dkv_in
            if next_kv is not None:
                kv = next_kv
        # After P-1 hops the accumulator holds the full gradient of this rank's own keys/values.
        dk = dkv[0].to(ctx.k_dtype)
        dv = dkv[1].to(ctx.k_dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group,
    *,
    causal: bool,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    segments: Optional[List] = None,
) -> Tensor:
    """Ring attention of this rank's dual-chunk sequence (or packed segments); see
    `RingAttention`."""
    return RingAttention.apply(q, k, v, group, causal, scale, dropout_p, dropout_seed, segments)
