"""Context parallelism of the Mamba mixer: an all-to-all from sequence chunks to heads.

Under context parallelism (CP size P) a rank holds s/P positions of every sequence in the
dual-chunk layout of attention (chunks r and 2P-1-r of 2P chunks, see
megatron/core/transformer/context_parallel/layout.py). A causal conv and a scan need the whole
sequence in order, but they are independent per channel / head. So after in_proj the mixer
trades sequence for heads (`seq_to_heads`): each rank sends its tokens' x, B, C and dt of head
share j to CP rank j and receives head share `rank` of every rank's tokens, then puts the 2P
chunks back in sequence order. The conv, the scan and the D skip run on the full sequence for
nh_l / P heads; `heads_to_seq` undoes the order and the exchange, back to this rank's chunks
with all d_inner_l channels. The gated grouped RMS norm is per position, so it runs after the
return on the local chunks (exact whatever the group size, and z never travels).

Head shares: CP rank j takes heads [j * nh_l/P, (j+1) * nh_l/P) of this TP rank and the
matching channels of x, the conv, dt_bias, A_log and D. Groups: with G_l % P == 0 rank j takes
groups [j * G_l/P, (j+1) * G_l/P); with G_l < P (P % G_l == 0) its heads lie in one group,
j * G_l // P, whose B and C are sent to every rank that needs them (replicated; their gradients
add up in the backward of the gather).

Both exchanges are one all-to-all over the CP group (`tensor_parallel.all_to_all`, whose
backward is the reverse all-to-all), and the reorders are index selects, so the pair is
differentiable. Document ids (`seq_idx`, whole-row layout) are all-gathered and reordered the
same way.

Packed sequences (`--sft`, THD): the batch is split per sequence instead (chunks r and 2P-1-r
of EVERY sequence, context_parallel/packed.py), so the order that puts the gathered stream back
in sequence order comes from the segment offsets (`packed_sequence_order`); they are the global
offsets / P on every rank, so no exchange is needed, and the document ids the conv and the
scan see are the segments of the whole sequence (`packed_segment_ids`).

Notation: b batch, s full sequence, P CP size, c = s / (2P) chunk length, nh_l / G_l / d_inner_l
heads / groups / channels of this TP rank, N state size, hd head dim.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron.core.tensor_parallel.mappings import all_to_all


def check_mamba_cp_dims(nheads_l: int, ngroups_l: int, cp_size: int, tp_size: int) -> None:
    """One-line ValueErrors for head / group counts the CP exchange cannot split."""
    if cp_size <= 1:
        return
    if nheads_l % cp_size != 0:
        raise ValueError(
            f"Mamba heads per tensor-parallel rank ({nheads_l * tp_size} / {tp_size} = "
            f"{nheads_l}) must be divisible by context_parallel_size ({cp_size}): nheads must "
            "be evenly divisible by tp_size * cp_size"
        )
    if ngroups_l < cp_size and cp_size % ngroups_l != 0:
        raise ValueError(
            f"context_parallel_size ({cp_size}) must be divisible by mamba_num_groups per "
            f"tensor-parallel rank ({ngroups_l * tp_size} / {tp_size} = {ngroups_l}) when it is "
            "larger: cp_size must be evenly divisible by ngroups/tp_size"
        )
    if ngroups_l >= cp_size and ngroups_l % cp_size != 0:
        raise ValueError(
            f"mamba_num_groups per tensor-parallel rank ({ngroups_l * tp_size} / {tp_size} = "
            f"{ngroups_l}) must be divisible by context_parallel_size ({cp_size}): ngroups must "
            "be evenly divisible by tp_size * cp_size"
        )


def sequence_order(cp_size: int, local_length: int, device=None) -> Tensor:
    """Positions in the source-major gathered stream (rank a's local token t at
    a * local_length + t) of the sequence positions 0..s-1: chunk k < P is the first half of
    rank k, chunk k >= P the second half of rank 2P-1-k."""
    chunk = local_length // 2
    pieces = []
    for k in range(2 * cp_size):
        source, half = (k, 0) if k < cp_size else (2 * cp_size - 1 - k, chunk)
        start = source * local_length + half
        pieces.append(torch.arange(start, start + chunk, device=device))
    return torch.cat(pieces)


def packed_segment_ids(offsets: Tensor, batch: int, local_length: int, cp_size: int) -> Tensor:
    """Segment ids [b, s] of the whole sequence of packed rows (s = P * local_length), from
    this rank's segment offsets (cu_seqlens_q_padded of the per-sequence split: the global
    offsets / P, over the batch-major local stream)."""
    bounds = offsets.to(torch.long) * cp_size  # global batch-major offsets
    positions = torch.arange(batch * local_length * cp_size, device=offsets.device)
    ids = torch.bucketize(positions, bounds[1:], right=True)  # [b * s]
    return ids.view(batch, local_length * cp_size)


def packed_sequence_order(offsets: Tensor, batch: int, local_length: int, cp_size: int) -> Tensor:
    """Positions [b * s] in the flattened source-major gathered stream ([b, P, s/P]: rank a's
    local token t of row i at (i * P + a) * local_length + t) of the sequence positions of
    packed rows split per sequence: chunk j of segment k (c_k tokens, at local offset o_k)
    is chunk j of rank j if j < P, else chunk 2P-1-j of rank 2P-1-j, which that rank holds
    at o_k + c_k."""
    local = offsets.to(torch.long)
    ids = packed_segment_ids(offsets, batch, local_length, cp_size).view(-1)
    chunk = (local[1:] - local[:-1])[ids] // 2  # c_k of every position's segment
    u = torch.arange(ids.numel(), device=offsets.device) - local[ids] * cp_size
    part = torch.div(u, chunk, rounding_mode='floor')  # j in [0, 2P)
    late = part >= cp_size
    source = torch.where(late, 2 * cp_size - 1 - part, part)
    held = local[ids] + late.to(torch.long) * chunk + u - part * chunk  # in the local stream
    row = torch.div(held, local_length, rounding_mode='floor')
    return (row * cp_size + source) * local_length + held - row * local_length


def check_packed_offsets(offsets: Tensor, batch: int, local_length: int) -> None:
    """One-line ValueErrors for segment offsets the packed exchange cannot reorder: they must
    cover the local stream row by row, each segment an even number of local tokens."""
    bounds = [int(x) for x in offsets.tolist()]
    total = batch * local_length
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(
            f"packed sequence offsets run from {bounds[0]} to {bounds[-1]}, but this context "
            f"parallel rank's stream has {total} tokens ({batch} x {local_length})"
        )
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if (hi - lo) % 2 or lo // local_length != max(hi - 1, lo) // local_length:
            raise ValueError(
                f"a packed sequence holds local tokens [{lo}, {hi}) of a {local_length}-token "
                "row: each sequence must lie in one row and be padded to a multiple of 2 x "
                "context parallel size"
            )


class MambaContextParallel:
    """The sequence <-> heads exchange of one mixer over a CP group (see the module docstring).

    Args:
        cp_group: the context parallel group (size P).
        d_inner_l, nheads_l, ngroups_l, d_state, headdim: this TP rank's mixer sizes.
    """

    def __init__(self, cp_group, d_inner_l, nheads_l, ngroups_l, d_state, headdim):
        self.group = cp_group
        self.size = cp_group.size()
        self.rank = cp_group.rank()
        self.headdim, self.d_state = headdim, d_state
        self.d_inner_l, self.nheads_l, self.ngroups_l = d_inner_l, nheads_l, ngroups_l
        self.nheads_c = nheads_l // self.size
        self.d_inner_c = self.nheads_c * headdim
        self.ngroups_c = max(ngroups_l // self.size, 1)
        self.conv_dim_c = self.d_inner_c + 2 * self.ngroups_c * d_state
        self._orders = {}  # (b, s/P, device) -> whole-row (order, inverse)

    def _group_slice(self, share: int) -> slice:
        """B / C channels (of G_l * N) of CP rank `share`'s heads."""
        first = share * self.ngroups_l // self.size
        n = self.d_state
        return slice(first * n, (first + self.ngroups_c) * n)

    def head_slice(self, share: Optional[int] = None) -> slice:
        """This rank's (or `share`'s) heads of the TP rank's nh_l."""
        share = self.rank if share is None else share
        return slice(share * self.nheads_c, (share + 1) * self.nheads_c)

    def channel_slice(self, share: Optional[int] = None) -> slice:
        """This rank's (or `share`'s) channels of d_inner_l (its heads' channels)."""
        share = self.rank if share is None else share
        return slice(share * self.d_inner_c, (share + 1) * self.d_inner_c)

    def conv_channels(self, device=None) -> Tensor:
        """Indices into the conv's conv_dim_l channels (x | B | C) of this rank's heads."""
        gn = self.ngroups_l * self.d_state
        groups = self._group_slice(self.rank)
        parts = [
            torch.arange(self.d_inner_l, device=device)[self.channel_slice()],
            self.d_inner_l + torch.arange(gn, device=device)[groups],
            self.d_inner_l + gn + torch.arange(gn, device=device)[groups],
        ]
        return torch.cat(parts)

    def exchange_order(
        self, batch: int, local_length: int, device, offsets: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """(order, inverse) [b * s]: the flattened source-major gathered stream's positions of
        the sequence positions, and back. `offsets`: the segment offsets of packed sequences
        split per sequence (None: the whole-row dual-chunk layout, cached)."""
        if offsets is not None:
            order = packed_sequence_order(offsets, batch, local_length, self.size)
        else:
            key = (batch, local_length, str(device))
            if key in self._orders:
                return self._orders[key]
            rows = torch.arange(batch, device=device)[:, None] * (self.size * local_length)
            order = (rows + sequence_order(self.size, local_length, device)).view(-1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        if offsets is None:
            self._orders[key] = (order, inverse)
        return order, inverse

    def seq_to_heads(self, xbc: Tensor, dt: Tensor, order: Tensor):
        """xbc [b, s/P, conv_dim_l] (pre-conv x | B | C), dt [b, s/P, nh_l] of this rank's
        tokens -> xbc [b, s, conv_dim_c], dt [b, s, nh_c] of this rank's heads, in sequence
        order (`order` of `exchange_order`)."""
        b, s_local = xbc.shape[:2]
        gn = self.ngroups_l * self.d_state
        x, B, C = torch.split(xbc, [self.d_inner_l, gn, gn], dim=-1)
        sends = []
        for share in range(self.size):
            groups = self._group_slice(share)
            sends.append(
                torch.cat(
                    [
                        x[..., self.channel_slice(share)],
                        B[..., groups],
                        C[..., groups],
                        dt[..., self.head_slice(share)],
                    ],
                    dim=-1,
                )
            )
        send = torch.stack(sends)  # [P (destination), b, s/P, conv_dim_c + nh_c]
        width = send.shape[-1]
        recv = all_to_all(self.group, send.reshape(-1, width))  # [P * b * s/P, width]
        recv = recv.view(self.size, b, s_local, width)  # [P (source), b, s/P, width]
        stream = recv.transpose(0, 1).reshape(-1, width)  # [b * P * s/P, width] source-major
        full = stream.index_select(0, order).view(b, self.size * s_local, width)  # [b, s, .]
        return full.split([self.conv_dim_c, self.nheads_c], dim=-1)

    def heads_to_seq(self, y: Tensor, inverse: Tensor) -> Tensor:
        """The inverse of `seq_to_heads` for the scan output: y [b, s, d_inner_c] (this rank's
        heads, sequence order) -> [b, s/P, d_inner_l] (this rank's tokens, every head)."""
        b, s, width = y.shape
        s_local = s // self.size
        stream = y.reshape(b * s, width).index_select(0, inverse)  # source-major
        send = stream.view(b, self.size, s_local, width).transpose(0, 1)  # [P (dest), b, s/P, .]
        recv = all_to_all(self.group, send.reshape(-1, width))
        recv = recv.view(self.size, b, s_local, width)  # [P (head share), b, s/P, d_inner_c]
        return recv.permute(1, 2, 0, 3).reshape(b, s_local, self.size * width)

    def gather_seq_idx(self, seq_idx: Tensor, order: Tensor) -> Tensor:
        """Document ids [b, s/P] of this rank's chunks (slices of the global ids) -> [b, s] of
        the whole sequence in order (all-gather; integer ids, no gradient)."""
        b, s_local = seq_idx.shape
        parts = [torch.empty_like(seq_idx) for _ in range(self.size)]
        torch.distributed.all_gather(parts, seq_idx.contiguous(), group=self.group)
        stream = torch.stack(parts, dim=1).reshape(-1)  # [b * P * s/P] source-major
        return stream.index_select(0, order).view(b, self.size * s_local)
