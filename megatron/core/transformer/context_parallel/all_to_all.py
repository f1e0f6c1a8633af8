"""All-to-all between the sequence and the heads (Ulysses, `cp_comm_type='a2a'`).

Before attention, `seq_to_heads` trades heads for sequence over a group of A ranks: each rank sends
head group g (h / A heads) of its local tokens to rank g and receives head group `rank` of every
group member's tokens. After attention `heads_to_seq` does the inverse. Each is the other's
backward, so the pair is differentiable (`SeqToHeads`, `HeadsToSeq`).

Sequence order. Inside the CP group rank (o, a) = o * A + a (a fastest, as the level-0 groups of
hierarchical CP are contiguous) holds global chunks o*A + a and 2P-1-o*A-a. Collected over
a = 0..A-1, the first chunks form super-chunk o (chunks o*A .. o*A+A-1) and the second chunks
super-chunk 2R-1-o of the 2R super-chunks of size A*c (R = P / A): the result is again the
dual-chunk layout, for a CP group of R ranks. With A = P (plain a2a) R = 1 and the result is the
whole sequence in natural order; with A < P (a2a+p2p) a ring over the R outer ranks follows.

Packed sequences (`segments`, see `packed.py`): every sequence is its own dual-chunk sequence in
the local stream, so the reordering above runs per sequence and the output is again a packed
stream, each sequence A times longer (its dual-chunk layout for the R outer ranks).

Traffic: (A-1)/A of each of q, k, v and out per layer forward, of dq, dk, dv and dout backward.
"""

from typing import List, Optional

import torch
from torch import Tensor


def _all_to_all(send: Tensor, group) -> Tensor:
    """[A, ...] with slot g going to rank g -> [A, ...] with slot g coming from rank g."""
    recv = torch.empty_like(send)
    torch.distributed.all_to_all_single(recv, send, group=group)
    return recv


def _received_order(segments, size, local_length, device) -> Tensor:
    """Positions in the source-major received stream (rank a's token t at a * local_length + t)
    of the output order: per segment (offset o, length 2c), the first halves (chunks) of ranks
    0..A-1, then the second halves of ranks A-1..0."""
    pieces = []
    for offset, length in segments:
        chunk = length // 2
        for a in range(size):
            start = a * local_length + offset
            pieces.append(torch.arange(start, start + chunk, device=device))
        for a in reversed(range(size)):
            start = a * local_length + offset + chunk
            pieces.append(torch.arange(start, start + chunk, device=device))
    return torch.cat(pieces)


def gathered_segments(segments: List, size: int) -> List:
    """The segments after `seq_to_heads` over `size` ranks: (offset, length) scaled by `size`."""
    return [(size * offset, size * length) for offset, length in segments]


def seq_to_heads(x: Tensor, group, segments: Optional[List] = None) -> Tensor:
    """[b, h, 2c, d] (this rank's two chunks, all heads) -> [b, h/A, 2Ac, d] (the group's two
    super-chunks, head group `rank`). With packed `segments` [(offset, length)] the same holds
    per segment: segment (o, 2c) becomes (A o, 2Ac) of the output."""
    size = torch.distributed.get_world_size(group=group)
    b, h, s, d = x.shape
    # [b, h, 2c, d] -> [b, A, h/A, 2c, d] -> [A, b, h/A, 2c, d]
    send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()
    recv = _all_to_all(send, group)  # [A (source rank), b, h/A, 2c, d]
    # [A, b, h/A, 2c, d] -> [b, h/A, A, 2c, d] -> [b, h/A, A 2c, d] (source-major stream)
    stream = recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)
    return stream.index_select(2, _received_order(segments or [(0, s)], size, s, x.device))


def heads_to_seq(y: Tensor, group, segments: Optional[List] = None) -> Tensor:
    """Inverse of `seq_to_heads` (same `segments`, those before it): [b, h/A, 2Ac, d] ->
    [b, h, 2c, d]."""
    size = torch.distributed.get_world_size(group=group)
    b, hg, total, d = y.shape
    s = total // size
    order = _received_order(segments or [(0, s)], size, s, y.device)
    stream = torch.empty_like(y).index_copy_(2, order, y)  # back to the source-major stream
    # [b, h/A, A 2c, d] -> [b, h/A, A, 2c, d] -> [A, b, h/A, 2c, d]: slot a goes to rank a.
    send = stream.view(b, hg, size, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group)  # [A (head group), b, h/A, 2c, d]
    # [A, b, h/A, 2c, d] -> [b, A, h/A, 2c, d] -> [b, h, 2c, d]
    return recv.transpose(0, 1).reshape(b, size * hg, s, d)


class SeqToHeads(torch.autograd.Function):
    """`seq_to_heads` forward, `heads_to_seq` backward."""

    @staticmethod
    def forward(ctx, x, group, segments=None):
        ctx.group, ctx.segments = group, segments
        return seq_to_heads(x, group, segments)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.group, ctx.segments), None, None


class HeadsToSeq(torch.autograd.Function):
    """`heads_to_seq` forward, `seq_to_heads` backward."""

    @staticmethod
    def forward(ctx, y, group, segments=None):
        ctx.group, ctx.segments = group, segments
        return heads_to_seq(y, group, segments)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.group, ctx.segments), None, None
