"""QK-clip caps the logits it should and nothing else, for grouped-query attention and MLA.

One query group (MHA/GQA) or one head (MLA) is pushed above the threshold. After `clip_qk`:
its largest logit equals the threshold, every other head's maxima are unchanged, the value rows
(and MLA's shared rotary key / down projections) are untouched.
"""

import torch

from tests.unit_tests.dist_utils import run_distributed

S, B, H = 8, 2, 32


def _maxima(attn, x):
    attn.max_attention_logit = None
    attn(x, attention_mask=None)
    return attn.max_attention_logit.clone()


def _gqa():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer.qk_clip import clip_qk
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        num_query_groups=2,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        qk_clip=True,
        use_cpu_initialization=True,
    )
    attn = build_module(
        get_gpt_layer_local_spec().submodules.self_attention, config=config, layer_number=1
    ).train()
    hn, per_group = 8, 2
    with torch.no_grad():
        attn.linear_qkv.weight[: per_group * hn] *= 8.0  # group 0's query rows
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0))
    before = _maxima(attn, x)
    threshold = float(before[2:].max() + before[:2].max()) / 2
    value_rows = attn.linear_qkv.weight.view(2, 4, hn, H)[:, 3].clone()
    attn.max_attention_logit = before
    clipped = clip_qk([attn], threshold, alpha=0.5)
    after = _maxima(attn, x)
    return dict(
        before=before,
        after=after,
        threshold=threshold,
        clipped=clipped,
        values_kept=torch.equal(attn.linear_qkv.weight.view(2, 4, hn, H)[:, 3], value_rows),
    )


def test_qk_clip_gqa():
    (res,) = run_distributed(_gqa, 1)
    before, after, tau = res['before'], res['after'], res['threshold']
    assert before[:2].max() > tau > before[2:].max()
    assert res['clipped'] == 2  # both heads of group 0
    torch.testing.assert_close(after[:2].max(), torch.tensor(tau), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[2:], before[2:], rtol=0, atol=0)  # other group untouched
    eta = tau / before[:2].max()
    torch.testing.assert_close(after[:2], before[:2] * eta, rtol=1e-5, atol=1e-6)
    assert res['values_kept']


def _mla():
    from megatron.core.models.gpt.gpt_layer_specs_mla import get_gpt_mla_layer_local_spec
    from megatron.core.optimizer.qk_clip import clip_qk
    from megatron.core.transformer.mla_transformer_config import MLATransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=16,
        mscale_all_dim=1.0,
        qk_layernorm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        qk_clip=True,
        use_cpu_initialization=True,
    )
    attn = build_module(
        get_gpt_mla_layer_local_spec(qk_layernorm=True).submodules.self_attention,
        config=config,
        layer_number=1,
    ).train()
    with torch.no_grad():
        attn.linear_q_up_proj.weight[12:24] *= 10.0  # head 1
        attn.linear_kv_down_proj.weight.mul_(3.0)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    before = _maxima(attn, x)
    others = torch.cat([before[:1], before[2:]])
    threshold = float(before[1] + others.max()) / 2
    kept = {
        'kv_down': attn.linear_kv_down_proj.weight.clone(),
        'values': attn.linear_kv_up_proj.weight.view(4, 14, 12)[:, 8:].clone(),
    }
    attn.max_attention_logit = before
    clipped = clip_qk([attn], threshold, alpha=0.5)
    after = _maxima(attn, x)
    return dict(
        before=before,
        after=after,
        threshold=threshold,
        clipped=clipped,
        kept=torch.equal(kept['kv_down'], attn.linear_kv_down_proj.weight)
        and torch.equal(kept['values'], attn.linear_kv_up_proj.weight.view(4, 14, 12)[:, 8:]),
    )


def test_qk_clip_mla():
    (res,) = run_distributed(_mla, 1)
    before, after, tau = res['before'], res['after'], res['threshold']
    assert before[1] > tau and res['clipped'] == 1
    torch.testing.assert_close(after[1], torch.tensor(tau), rtol=1e-5, atol=0)
    for h in (0, 2, 3):
        torch.testing.assert_close(after[h], before[h], rtol=0, atol=0)
    assert res['kept']
