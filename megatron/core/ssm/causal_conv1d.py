"""Depthwise causal 1-D convolution of the Mamba mixer, for training/prefill and for one decode
step, in plain PyTorch.

Output position t of channel c is bias_c + sum_k w_{c,k} x_{c, t-K+1+k}, inputs before the
sequence start being zero. With packed documents (`seq_idx`), inputs of an earlier document
count as zero too, so no information crosses a document boundary.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor] = None
) -> Tensor:
    """x [b, C, s], weight [C, 1, K], bias [C] -> [b, C, s] (before the activation).

    Args:
        seq_idx: [b, s] non-decreasing document ids; None: one document per row.
    """
    s = x.shape[-1]
    kernel = weight.shape[-1]
    if seq_idx is None:
        # A symmetric padding of K - 1 then the first s outputs: position t sees t-K+1..t.
        return F.conv1d(x, weight, bias, padding=kernel - 1, groups=x.shape[1])[..., :s]
    out = x * weight[:, 0, kernel - 1, None]  # [b, C, s]
    for shift in range(1, kernel):
        if shift >= s:
            break
        same = (seq_idx[:, shift:] == seq_idx[:, :-shift]).to(x.dtype)  # [b, s - shift]
        shifted = x[..., :-shift] * same[:, None, :]  # input t - shift seen from t
        out = out + F.pad(shifted, (shift, 0)) * weight[:, 0, kernel - 1 - shift, None]
    if bias is not None:
        out = out + bias[:, None]
    return out


def causal_conv1d_step(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor]
) -> Tensor:
    """One decode position: x [b, C], conv_state [b, C, K] (the last K inputs, updated in
    place: shifted left, x appended) -> [b, C] (before the activation)."""
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x.to(conv_state.dtype)
    out = torch.sum(conv_state.to(weight.dtype) * weight[:, 0, :], dim=-1)  # [b, C]
    if bias is not None:
        out = out + bias
    return out


def conv_state_from_prefill(x: Tensor, kernel: int) -> Tensor:
    """The last `kernel` inputs x [b, C, s] -> [b, C, K], zero-padded on the left if s < K."""
    s = x.shape[-1]
    if s >= kernel:
        return x[..., s - kernel :].clone()
    return F.pad(x, (kernel - s, 0))
