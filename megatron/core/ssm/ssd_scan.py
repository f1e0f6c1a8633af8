"""The Mamba-2 state-space scan (SSD) in plain PyTorch: a chunked matmul form and a sequential
reference.

Per head h with scalar decay A_h < 0 and a state S in R^{P x N} (S_0 = 0 or a given state):

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t (outer) B_t,      y_t = S_t C_t

The chunked form splits the sequence into chunks of T positions. Inside a chunk the outputs are
one masked matmul with the decay matrix L[i, j] = exp(sum_{k=j+1..i} dt_k A) (quadratic in T
only); every chunk also produces the state it leaves behind, the states are carried from chunk
to chunk with the chunk-level decays, and each position adds the contribution of the state that
entered its chunk. The cost is linear in the sequence length. Everything runs in fp32.

Packed documents: `seq_idx` [b, s] (non-decreasing document ids per row) cuts the recurrence,
so position i sees position j only when both carry the same id (the state is reset at each
document start). Heads map to groups by integer division: head h uses group h // (nh / G).

Notation: b batch, s sequence, nh heads, P head dim, G groups, N state size.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor


def _expand_groups(t: Tensor, nheads: int) -> Tensor:
    """[b, s, G, N] -> [b, s, nh, N]: contiguous heads share one group."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def ssd_sequential_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    initial_state: Optional[Tensor] = None,
    seq_idx: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The recurrence one position at a time (the reference the chunked form is tested against).

    Args:
        x: [b, s, nh, P] inputs.
        dt: [b, s, nh] step sizes (already softplus'ed).
        A: [nh] decays (negative).
        B, C: [b, s, G, N] input / output projections of the state.
        initial_state: [b, nh, P, N] state before position 0 (None: zeros).
        seq_idx: [b, s] document ids (None: one document per row).

    Returns:
        (y [b, s, nh, P] fp32, final state [b, nh, P, N] fp32).
    """
    b, s, nh, p = x.shape
    x, dt, A = x.float(), dt.float(), A.float()
    B = _expand_groups(B.float(), nh)
    C = _expand_groups(C.float(), nh)
    state = x.new_zeros(b, nh, p, B.shape[-1]) if initial_state is None else initial_state.float()
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t] * A)  # [b, nh]
        if seq_idx is not None and t > 0:
            same = (seq_idx[:, t] == seq_idx[:, t - 1]).to(decay.dtype)  # [b]
            decay = decay * same[:, None]
        update = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]  # [b, nh, P, N]
        state = decay[..., None, None] * state + update
        ys.append(torch.einsum('bhpn,bhn->bhp', state, C[:, t]))
    return torch.stack(ys, dim=1), state


def _pad_to_chunks(t: Tensor, pad: int, value: float = 0.0) -> Tensor:
    """Pad dim 1 (the sequence) by `pad` positions at the end."""
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[1] = pad
    return torch.cat([t, t.new_full(shape, value)], dim=1)


def _masked_exp(log_decay: Tensor, mask: Tensor) -> Tensor:
    """exp(log_decay) where mask, else 0 (masked entries never reach exp: no inf, no NaN grad)."""
    return torch.exp(log_decay.masked_fill(~mask, float('-inf')))


def ssd_chunked_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int = 128,
    initial_state: Optional[Tensor] = None,
    seq_idx: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """The same recurrence as `ssd_sequential_scan`, in chunks of `chunk_size` positions.

    The arguments and returns are those of `ssd_sequential_scan`; s need not be a multiple of
    the chunk size (the tail is padded with dt = 0, which neither decays nor adds to the state).
    """
    b, s, nh, p = x.shape
    T = chunk_size
    pad = (-s) % T
    x = _pad_to_chunks(x.float(), pad)
    dt = _pad_to_chunks(dt.float(), pad)
    B = _pad_to_chunks(_expand_groups(B.float(), nh), pad)
    C = _pad_to_chunks(_expand_groups(C.float(), nh), pad)
    if seq_idx is None:
        seq_idx = torch.zeros(b, s + pad, dtype=torch.long, device=x.device)
    else:
        seq_idx = torch.cat([seq_idx, seq_idx[:, -1:].expand(b, pad)], dim=1)
    c = (s + pad) // T
    n = B.shape[-1]

    x = x.view(b, c, T, nh, p)  # [b, c, T, nh, P]
    B = B.view(b, c, T, nh, n)  # [b, c, T, nh, N]
    C = C.view(b, c, T, nh, n)
    dt = dt.view(b, c, T, nh)
    ids = seq_idx.view(b, c, T)  # [b, c, T]
    xdt = x * dt[..., None]  # [b, c, T, nh, P]
    a = (dt * A.float()).permute(0, 3, 1, 2)  # [b, nh, c, T]
    a_cum = torch.cumsum(a, dim=-1)  # [b, nh, c, T], inclusive

    # 1. Within each chunk: y_i += sum_{j <= i} (C_i . B_j) exp(a_cum_i - a_cum_j) dt_j x_j.
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    same_doc = ids[:, :, :, None] == ids[:, :, None, :]  # [b, c, T, T]
    mask = (causal & same_doc)[:, None]  # [b, 1, c, T, T]
    L = _masked_exp(a_cum[..., :, None] - a_cum[..., None, :], mask)  # [b, nh, c, T, T]
    y = torch.einsum('bclhn,bcshn,bhcls,bcshp->bclhp', C, B, L, xdt)

    # 2. The state each chunk leaves behind from its own inputs.
    last = ids[:, :, -1:]  # [b, c, 1]
    to_end = _masked_exp(a_cum[..., -1:] - a_cum, (ids == last)[:, None])  # [b, nh, c, T]
    chunk_states = torch.einsum('bclhn,bhcl,bclhp->bchpn', B, to_end, xdt)  # [b, c, nh, P, N]

    # 3. Carry the states across chunks: entry k of `states` is the state after chunk k - 1
    # (entry 0: the initial state); k sees j < k through the decays of chunks j..k-1.
    if initial_state is None:
        initial_state = x.new_zeros(b, nh, p, n)
    states = torch.cat([initial_state.float()[:, None], chunk_states], dim=1)  # [b, c+1, nh, P, N]
    chunk_decay = torch.nn.functional.pad(a_cum[..., -1], (1, 0))  # [b, nh, c+1]
    chunk_cum = torch.cumsum(chunk_decay, dim=-1)
    boundary_ids = torch.cat([ids[:, :1, 0], ids[:, :, -1]], dim=1)  # [b, c+1]
    causal_c = torch.ones(c + 1, c + 1, dtype=torch.bool, device=x.device).tril()
    same_c = boundary_ids[:, :, None] == boundary_ids[:, None, :]  # [b, c+1, c+1]
    carry = _masked_exp(
        chunk_cum[..., :, None] - chunk_cum[..., None, :], (causal_c & same_c)[:, None]
    )  # [b, nh, c+1, c+1]
    states = torch.einsum('bhzk,bkhpn->bzhpn', carry, states)  # [b, c+1, nh, P, N]
    entering, final_state = states[:, :-1], states[:, -1]

    # 4. Each position's share of the state that entered its chunk.
    from_start = _masked_exp(a_cum, (ids == boundary_ids[:, :-1, None])[:, None])  # [b, nh, c, T]
    y = y + torch.einsum('bclhn,bchpn,bhcl->bclhp', C, entering, from_start)

    y = y.reshape(b, c * T, nh, p)[:, :s]  # [b, s, nh, P]
    return y, final_state
