"""Scaled rotary frequencies against transformers' rope init functions (configs built here).

- YaRN: inverse frequencies and the cos/sin concentration factor for three settings, including
  fractional ramp ends (no rounding) and mscale != mscale_all_dim.
- Llama-3.1 (`--use-rope-scaling`): inverse frequencies of RotaryEmbedding(rope_scaling=True).
"""

import math

import pytest
import torch


def _hf_rope(rope_type, head_dim, params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=params.get('original_max_position_embeddings', 64) * 4,
        rope_parameters=dict(rope_type=rope_type, rope_theta=params.pop('base'), **params),
    )
    return ROPE_INIT_FUNCTIONS[rope_type](config, 'cpu')


@pytest.mark.parametrize(
    'dim,base,factor,l0,fast,slow,mscale,mscale_all,truncate',
    [
        (64, 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0, True),
        (16, 500000.0, 4.0, 32, 32.0, 1.0, 0.707, 0.707, True),
        (32, 10000.0, 8.0, 128, 16.0, 2.0, 1.0, 0.5, False),
    ],
)
def test_yarn_matches_hf(dim, base, factor, l0, fast, slow, mscale, mscale_all, truncate):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    hf_inv, hf_factor = _hf_rope(
        'yarn',
        dim,
        dict(
            base=base,
            factor=factor,
            original_max_position_embeddings=l0,
            beta_fast=fast,
            beta_slow=slow,
            mscale=mscale,
            mscale_all_dim=mscale_all,
            truncate=truncate,
        ),
    )
    ours = YarnRotaryEmbedding(dim, base, factor, l0, fast, slow, mscale, mscale_all, truncate)
    torch.testing.assert_close(ours.inv_freq, hf_inv, atol=0, rtol=1e-6)
    assert math.isclose(ours.mscale, hf_factor, rel_tol=1e-12)
    # Sensitivity: the ramp matters (neither the plain nor the fully interpolated frequencies).
    plain = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
    assert not torch.allclose(ours.inv_freq, plain)
    assert not torch.allclose(ours.inv_freq, plain / factor)
    angles, scale = ours(5, offset=3)
    assert angles.shape == (5, 1, 1, dim) and scale == ours.mscale
    torch.testing.assert_close(angles[1, 0, 0, : dim // 2], 4 * ours.inv_freq)


@pytest.mark.parametrize('factor,dim,base', [(8.0, 64, 500000.0), (32.0, 32, 500000.0)])
def test_llama3_rope_scaling_matches_hf(factor, dim, base):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    hf_inv, hf_factor = _hf_rope(
        'llama3',
        dim,
        dict(
            base=base,
            factor=factor,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    ours = RotaryEmbedding(
        dim,
        1.0,
        rotary_base=base,
        use_cpu_initialization=True,
        rope_scaling=True,
        rope_scaling_factor=factor,
    )
    torch.testing.assert_close(ours.inv_freq, hf_inv, atol=0, rtol=1e-6)
    assert hf_factor == 1.0
    plain = RotaryEmbedding(dim, 1.0, rotary_base=base, use_cpu_initialization=True)
    assert not torch.allclose(plain.inv_freq, hf_inv)


def test_yarn_cos_sin_tables_kept_and_rotation_exact():
    """The cos / sin tables are computed once per (length, offset, dtype) and reused; the
    rotation equals interleaved RoPE (pair (2j, 2j + 1) turned by angle j, times mscale),
    written evens then odds."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        rotate_deinterleaved,
    )

    emb = YarnRotaryEmbedding(8, 10000.0, 4.0, 16, mscale=1.0, mscale_all_dim=0.5)
    cos, sin = emb.cos_sin(6, offset=2)
    assert emb.cos_sin(6, offset=2)[0] is cos  # kept
    assert cos.shape == (6, 1, 1, 4)
    angles = (torch.arange(6.0) + 2)[:, None] * emb.inv_freq  # [s, d/2]
    torch.testing.assert_close(cos[:, 0, 0], torch.cos(angles) * emb.mscale)
    other, _ = emb.cos_sin(6, offset=3)  # another offset: new tables
    torch.testing.assert_close(other[:-1], cos[1:])

    t = torch.randn(6, 2, 3, 8)
    out = rotate_deinterleaved(t, cos, sin)
    # Interleaved RoPE as a complex product: pair j is the number t[2j] + i t[2j+1].
    turn = torch.polar(torch.full_like(angles, emb.mscale), angles)[:, None, None]  # [s, 1, 1, 4]
    expected = torch.view_as_complex(t.view(6, 2, 3, 4, 2)) * turn
    torch.testing.assert_close(out, torch.cat((expected.real, expected.imag), dim=-1))
