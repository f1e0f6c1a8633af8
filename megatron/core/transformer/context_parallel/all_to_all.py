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

Traffic: (A-1)/A of each of q, k, v and out per layer forward, of dq, dk, dv and dout backward.
"""

import torch
from torch import Tensor


def _all_to_all(send: Tensor, group) -> Tensor:
    """[A, ...] with slot g going to rank g -> [A, ...] with slot g coming from rank g."""
    recv = torch.empty_like(send)
    torch.distributed.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_heads(x: Tensor, group) -> Tensor:
    """[b, h, 2c, d] (this rank's two chunks, all heads) -> [b, h/A, 2Ac, d] (the group's two
    super-chunks, head group `rank`)."""
    size = torch.distributed.get_world_size(group=group)
    b, h, s, d = x.shape
    chunk = s // 2
    # [b, h, 2c, d] -> [b, A, h/A, 2c, d] -> [A, b, h/A, 2c, d]
    send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()
    recv = _all_to_all(send, group)  # [A (source rank), b, h/A, 2c, d]
    first = [recv[a][:, :, :chunk] for a in range(size)]
    second = [recv[a][:, :, chunk:] for a in reversed(range(size))]
    return torch.cat(first + second, dim=2)


def heads_to_seq(y: Tensor, group) -> Tensor:
    """Inverse of `seq_to_heads`: [b, h/A, 2Ac, d] -> [b, h, 2c, d]."""
    size = torch.distributed.get_world_size(group=group)
    b, hg, s, d = y.shape
    chunk = s // (2 * size)
    pieces = y.chunk(2 * size, dim=2)
    # Rank a gets the a-th chunk of the first super-chunk and the (A-1-a)-th of the second.
    send = torch.stack(
        [torch.cat([pieces[a], pieces[2 * size - 1 - a]], dim=2) for a in range(size)]
    )  # [A, b, h/A, 2c, d]
    recv = _all_to_all(send, group)  # [A (head group), b, h/A, 2c, d]
    # [A, b, h/A, 2c, d] -> [b, A, h/A, 2c, d] -> [b, h, 2c, d]
    return recv.transpose(0, 1).reshape(b, size * hg, 2 * chunk, d)


class SeqToHeads(torch.autograd.Function):
    """`seq_to_heads` forward, `heads_to_seq` backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """`heads_to_seq` forward, `seq_to_heads` backward."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.group), None
