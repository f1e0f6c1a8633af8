"""Plain-torch fused-op fallbacks, norms and RoPE against direct PyTorch formulas; Float16Module."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.torch_norm import LayerNorm, RMSNorm, WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import attention_mask_func
from tests.unit_tests.dist_utils import run_distributed


def test_bias_gelu_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    out = bias_gelu_impl(x, b)
    out.sum().backward()
    # Reference: Megatron's elementwise tanh-GeLU formula, in float64, differentiated by autograd.
    x2 = x.detach().double().requires_grad_(True)
    b2 = b.detach().double().requires_grad_(True)
    z = x2 + b2
    ref = z * 0.5 * (1.0 + torch.tanh(0.7978845608028654 * z * (1 + 0.044715 * z * z)))
    ref.sum().backward()
    ref, ref_x_grad, ref_b_grad = ref.float(), x2.grad.float(), b2.grad.float()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad, ref_x_grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.grad, ref_b_grad, atol=1e-5, rtol=1e-5)


def test_bias_swiglu_and_bias_dropout_add():
    g = torch.Generator().manual_seed(1)
    y, b = torch.randn(5, 8, generator=g), torch.randn(8, generator=g)
    torch.testing.assert_close(bias_swiglu_impl(y, b), F.silu((y + b)[:, :4]) * (y + b)[:, 4:])
    x, bias, res = (
        torch.randn(5, 4, generator=g),
        torch.randn(4, generator=g),
        torch.randn(5, 4, generator=g),
    )
    for fused in (False, True):
        torch.testing.assert_close(
            get_bias_dropout_add(False, fused)((x, bias), res, 0.5), res + x + bias
        )
        torch.testing.assert_close(get_bias_dropout_add(True, fused)((x, None), res, 0.0), res + x)


def test_scale_mask_softmax_fp16_in_fp32():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 6, 6, generator=g)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    sm = FusedScaleMaskSoftmax(
        False, True, AttnMaskType.causal, False, attention_mask_func, True, 2.0
    )
    out = sm(scores.bfloat16(), None)
    ref = (scores.bfloat16().float() * 2.0).masked_fill(mask, -10000.0).softmax(-1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="input_in_fp16 and input_in_bf16"):
        FusedScaleMaskSoftmax(
            True, True, AttnMaskType.causal, False, attention_mask_func, True, None
        )


def test_norms():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2, 16, generator=g)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, normalization="RMSNorm"
    )
    rms = WrappedTorchNorm(cfg, 16, eps=1e-6)
    assert isinstance(rms, RMSNorm)
    with torch.no_grad():
        rms.weight.copy_(torch.randn(16, generator=g))
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * rms.weight
    torch.testing.assert_close(rms(x), ref)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, layernorm_zero_centered_gamma=True
    )
    ln = WrappedTorchNorm(cfg, 16)
    assert isinstance(ln, LayerNorm) and torch.count_nonzero(ln.weight) == 0
    torch.testing.assert_close(ln(x), F.layer_norm(x, (16,)))
    assert ln.weight.sequence_parallel is False and rms.weight.sequence_parallel is False


def test_rope_interleaved_equals_permuted_halves():
    """Interleaved RoPE on x equals half-split RoPE on x with channels de-interleaved."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(4)
    t = torch.randn(5, 1, 2, 8, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(5).float(), inv)
    half = torch.cat([freqs, freqs], -1)[:, None, None, :]
    inter = torch.stack([freqs, freqs], -1).view(5, -1)[:, None, None, :]
    perm = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    out_i = apply_rotary_pos_emb(t, inter, config=SimpleNamespace(rotary_interleaved=True))
    out_h = apply_rotary_pos_emb(
        t[..., perm], half, config=SimpleNamespace(rotary_interleaved=False)
    )
    torch.testing.assert_close(out_i[..., perm], out_h)
    # Rotation keeps norms.
    torch.testing.assert_close(out_h.norm(dim=-1), t.norm(dim=-1))


def _float16_module():
    from megatron.core.transformer.module import Float16Module
    from tests.unit_tests.models import gpt_test_utils as U

    model, _ = U.build_gpt(U.gpt2_like_kwargs())
    tokens, labels = U.batch()
    loss32 = model(tokens, None, None, labels=labels).detach()
    model16, config16 = U.build_gpt(U.gpt2_like_kwargs(bf16=True, params_dtype=torch.bfloat16))
    model16.load_state_dict(model.state_dict())
    wrapped = Float16Module(config16, model16)
    loss16 = wrapped(tokens, None, None, labels=labels)
    loss16.mean().backward()
    param_dtypes = {p.dtype for p in wrapped.parameters()}
    return loss32, loss16.detach(), param_dtypes


def test_float16_module_bf16():
    loss32, loss16, param_dtypes = run_distributed(_float16_module, 1)[0]
    assert param_dtypes == {torch.bfloat16}
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32, atol=5e-2, rtol=2e-2)
