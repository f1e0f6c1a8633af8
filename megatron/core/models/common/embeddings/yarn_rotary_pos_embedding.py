"""Scaled rotary frequencies for long-context checkpoints: YaRN and the Llama-3.1 rule.

Shapes: d is the rotated size; the inverse frequencies are [d/2]; angles are [s, 1, 1, d] in the
half-split layout (the same angle at channel j and j + d/2), as `RotaryEmbedding` returns.

YaRN (later Megatron's `yarn_rotary_pos_embedding.py`): each frequency is blended between its
original value (fast-rotating channels, extrapolated) and its value divided by the scaling factor
(slow channels, interpolated) with a linear ramp over the channels whose wavelength lies between
`beta_fast` and `beta_slow` rotations of the original context. The attention temperature is
corrected by multiplying cos and sin by `yarn_concentration` (the "mscale").
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from megatron.core.utils import get_current_device


def default_inv_freq(dim: int, rotary_base: float, device=None) -> Tensor:
    """base^(-2j/d) for j < d/2: [d/2] fp32."""
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    return 1.0 / (rotary_base**exponent)


def yarn_get_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(factor) + 1 for factor > 1, else 1 (no correction without scaling)."""
    if scaling_factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def yarn_concentration(scaling_factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor cos and sin are multiplied by: g(f, mscale) / g(f, mscale_all_dim)."""
    return yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor, mscale_all_dim)


def _correction_dim(rotations: float, dim: int, base: float, original_max_position: int) -> float:
    """The channel index whose wavelength fits `rotations` times into the original context."""
    return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(
    dim: int,
    rotary_base: float,
    scaling_factor: float,
    original_max_position_embeddings: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    correction_range_round_to_int: bool = True,
    device=None,
) -> Tensor:
    """YaRN inverse frequencies [d/2] (fp32).

    Args:
        dim: rotated size d.
        rotary_base: RoPE base.
        scaling_factor: context extension factor f (the interpolated frequencies are base / f).
        original_max_position_embeddings: the pretraining context length L0.
        beta_fast: rotations over L0 below which channels are extrapolated (kept as they are).
        beta_slow: rotations over L0 above which channels are fully interpolated.
        correction_range_round_to_int: floor / ceil the ramp's ends to whole channels.
    """
    inv_extrapolation = default_inv_freq(dim, rotary_base, device)
    inv_interpolation = inv_extrapolation / scaling_factor
    low = _correction_dim(beta_fast, dim, rotary_base, original_max_position_embeddings)
    high = _correction_dim(beta_slow, dim, rotary_base, original_max_position_embeddings)
    if correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-channel ramp would divide by zero
    channel = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = torch.clamp((channel - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (fast channels), 0: interpolate
    return inv_interpolation * (1.0 - keep) + inv_extrapolation * keep


def llama3_inv_freq(
    inv_freq: Tensor,
    scaling_factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> Tensor:
    """Llama-3.1 scaling of inverse frequencies [d/2] (Megatron's `--use-rope-scaling`).

    Wavelengths shorter than L0 / high_freq_factor are kept, those longer than L0 /
    low_freq_factor are divided by the factor, and the band between is blended smoothly.
    """
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling_factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling_factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


class YarnRotaryEmbedding(torch.nn.Module):
    """YaRN rotary angles plus their concentration factor (no parameters, no communication).

    Args:
        kv_channels (int): rotated size d (MLA: qk_pos_emb_head_dim).
        rotary_base (float): RoPE base.
        scaling_factor (float): context extension factor.
        original_max_position_embeddings (int): pretraining context length.
        beta_fast, beta_slow (float): ends of the interpolation ramp, in rotations.
        mscale, mscale_all_dim (float): the temperature correction's numerator / denominator.
        correction_range_round_to_int (bool): round the ramp's ends to whole channels.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_base: float = 10000,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float = 1.0,
        mscale_all_dim: float = 0.0,
        correction_range_round_to_int: bool = True,
    ) -> None:
        super().__init__()
        self.inv_freq = yarn_inv_freq(
            kv_channels,
            rotary_base,
            scaling_factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            correction_range_round_to_int,
        )
        self.mscale = yarn_concentration(scaling_factor, mscale, mscale_all_dim)
        self._cos_sin_key, self._cos_sin = None, None

    def forward(self, max_seq_len: int, offset: int = 0) -> Tuple[Tensor, float]:
        """Angles of positions offset .. offset + max_seq_len - 1 [s, 1, 1, d] and the factor
        cos / sin must be multiplied by."""
        inv_freq = self.inv_freq.to(get_current_device())
        seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32) + offset
        freqs = torch.outer(seq, inv_freq)  # [s, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [s, d]
        return emb[:, None, None, :], self.mscale  # [s, 1, 1, d]

    def cos_sin(self, max_seq_len: int, offset: int = 0, dtype=torch.float32):
        """mscale cos and mscale sin of the angles of positions offset .. offset + max_seq_len - 1,
        [s, 1, 1, d/2] each (one value per channel pair), in `dtype`.

        The tables depend on the positions only, so the last ones are kept and reused: a
        training step (every layer, every step) computes them once.
        """
        key = (max_seq_len, offset, get_current_device(), dtype)
        if self._cos_sin_key != key:
            freqs, mscale = self.forward(max_seq_len, offset)
            self._cos_sin = rotary_cos_sin(freqs, mscale, dtype)
            self._cos_sin_key = key
        return self._cos_sin


def rotary_cos_sin(freqs: Tensor, mscale: float = 1.0, dtype=torch.float32):
    """Angles in the half-split layout [..., d] (angle j at channels j and j + d/2) -> mscale cos
    and mscale sin of the d/2 distinct angles [..., d/2], in `dtype`."""
    half = freqs[..., : freqs.size(-1) // 2]
    return (torch.cos(half) * mscale).to(dtype), (torch.sin(half) * mscale).to(dtype)


def rotate_deinterleaved(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on interleaved channel pairs, written out de-interleaved.

    The pair (t[2j], t[2j+1]) of t [s, b, n, d] is rotated by angle j: cos, sin [s, 1, 1, d/2]
    (or [s, b, 1, d/2]) from `rotary_cos_sin`. The result holds the rotated evens then the
    rotated odds (what the dot product sees is the same either way, as queries and keys get the
    same order). The evens and odds are read as strided views: no de-interleaved copy is made.
    """
    evens, odds = t[..., 0::2], t[..., 1::2]  # [s, b, n, d/2] each
    return torch.cat((evens * cos - odds * sin, odds * cos + evens * sin), dim=-1)


def optional_offset(inference_params: Optional[object]) -> int:
    """Position of the first token of this call: the cached length under a static KV cache."""
    if inference_params is None:
        return 0
    return int(getattr(inference_params, 'sequence_len_offset', 0))
