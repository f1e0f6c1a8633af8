"""SelfAttention / DotProductAttention on tensor-parallel gloo ranks against plain-torch references.

- Grouped-query attention: the fused QKV rows are grouped by query group ([ng, np/ng + 2, hn]);
  a TP rank's slice holds whole groups. The TP=2 output equals an unsharded reference, and a
  weight laid out the ungrouped way ([q_all; k_all; v_all]) does not (so the test sees wrong head
  interleaving).
- Attention dropout runs under the model-parallel RNG tracker: TP rank r draws its heads' masks
  from the stream seeded with seed + 2718 + r, and the default generator is left untouched (so
  hidden dropout stays identical across TP ranks).
- The scaled_dot_product_attention fast path equals the explicit softmax path.
"""

import math

import torch

from tests.unit_tests.dist_utils import run_distributed

WORLD = 4  # TP=2 x DP=2
SQ, B, H, NP, NG = 8, 2, 64, 8, 4
HN = H // NP


def _weights():
    g = torch.Generator().manual_seed(21)
    q = torch.randn(NP * HN, H, generator=g) * 0.2
    k = torch.randn(NG * HN, H, generator=g) * 0.2
    v = torch.randn(NG * HN, H, generator=g) * 0.2
    o = torch.randn(H, NP * HN, generator=g) * 0.2
    x = torch.randn(SQ, B, H, generator=g)
    return q, k, v, o, x


def _reference_attention(x, q_w, k_w, v_w, o_w):
    q = (x @ q_w.t()).view(SQ, B, NP, HN).permute(1, 2, 0, 3)  # [b, np, s, hn]
    k = (x @ k_w.t()).view(SQ, B, NG, HN).permute(1, 2, 0, 3).repeat_interleave(NP // NG, dim=1)
    v = (x @ v_w.t()).view(SQ, B, NG, HN).permute(1, 2, 0, 3).repeat_interleave(NP // NG, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HN)
    scores = scores.masked_fill(torch.triu(torch.ones(SQ, SQ, dtype=torch.bool), 1), float("-inf"))
    ctx = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(SQ, B, NP * HN)
    return ctx @ o_w.t()


def _gqa_self_attention(layout):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.hf_weight_mapping import qkv_to_grouped
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=NP,
        num_query_groups=NG,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec().submodules.self_attention
    attn = build_module(spec, config=config, layer_number=1)
    q, k, v, o, x = _weights()
    if layout == "grouped":
        fused = qkv_to_grouped(q, k, v, NP, NG, HN)
    else:  # the wrong, ungrouped layout
        fused = torch.cat([q, k, v], dim=0)
    with torch.no_grad():
        attn.linear_qkv.weight.copy_(fused.chunk(tp, dim=0)[rank])
        attn.linear_proj.weight.copy_(o.chunk(tp, dim=1)[rank])
    x = x.clone().requires_grad_(True)
    out, bias = attn(x, attention_mask=None)
    assert bias is None
    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    ref = _reference_attention(x_ref, q, k, v, o)
    ref.sum().backward()
    return dict(out=out.detach(), ref=ref.detach(), x_grad=x.grad, x_grad_ref=x_ref.grad)


def test_gqa_self_attention_tp2_matches_reference():
    for out in run_distributed(_gqa_self_attention, WORLD, tp=2, args=("grouped",)):
        torch.testing.assert_close(out["out"], out["ref"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["x_grad"], out["x_grad_ref"], atol=1e-5, rtol=1e-5)
    # Sensitivity: the ungrouped layout puts key/value rows where query rows are expected.
    for out in run_distributed(_gqa_self_attention, WORLD, tp=2, args=("ungrouped",)):
        assert not torch.allclose(out["out"], out["ref"], atol=1e-3)


def _attention_dropout(seed, p):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    heads = 4
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=heads,
        attention_dropout=p,
        tensor_model_parallel_size=tp,
    )
    core = DotProductAttention(config, 1, AttnMaskType.causal, "self").train()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(SQ, B, heads, 8, generator=g) for _ in range(3))
    np_ = heads // tp
    sl = slice(rank * np_, (rank + 1) * np_)

    model_parallel_cuda_manual_seed(seed)
    default_state = torch.get_rng_state()
    out = core(q[:, :, sl], k[:, :, sl], v[:, :, sl], None)
    default_untouched = torch.equal(torch.get_rng_state(), default_state)

    # Reference: head block r uses the default-generator stream seeded with seed + 2718 + r.
    causal = torch.triu(torch.ones(SQ, SQ, dtype=torch.bool), 1)

    def reference(head_block, stream_seed):
        s = slice(head_block * np_, (head_block + 1) * np_)
        qb, kb, vb = (t[:, :, s].permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        scores = (qb @ kb.transpose(-1, -2) / math.sqrt(8)).masked_fill(causal, -10000.0)
        probs = scores.softmax(-1)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed)
            probs = torch.nn.functional.dropout(probs, p=p, training=True)
        return (probs @ vb).permute(2, 0, 1, 3).reshape(SQ, B, np_ * 8)  # [s, b, np * hn]

    return dict(
        out=out.detach(),
        ref=reference(rank, seed + 2718 + rank),
        # What this rank would compute if every TP rank shared TP rank 0's stream.
        shared_stream=reference(rank, seed + 2718),
        default_untouched=default_untouched,
        rank=rank,
    )


def test_attention_dropout_uses_model_parallel_rng_per_tp_rank():
    outs = run_distributed(_attention_dropout, WORLD, tp=2, args=(77, 0.5))
    for out in outs:
        assert out["default_untouched"], "attention dropout must not advance the default generator"
        torch.testing.assert_close(out["out"], out["ref"], atol=1e-6, rtol=1e-6)
        if out["rank"] == 1:
            # TP rank 1 did not reuse rank 0's stream.
            assert not torch.allclose(out["out"], out["shared_stream"], atol=1e-3)


def _sdpa_vs_explicit():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
    )
    core = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    masked_core = DotProductAttention(config, 1, AttnMaskType.arbitrary, "self")
    g = torch.Generator().manual_seed(9)
    q = torch.randn(SQ, B, 4, 8, generator=g)
    k, v = (torch.randn(SQ, B, 2, 8, generator=g) for _ in range(2))
    causal = torch.triu(torch.ones(SQ, SQ, dtype=torch.bool), 1).expand(B, 1, SQ, SQ)
    # Per-document mask: two documents of SQ // 2 tokens, causal within each.
    doc = causal.clone()
    doc[:, :, SQ // 2 :, : SQ // 2] = True
    fast = core(q, k, v, None)  # SDPA path
    fast_with_mask = core(q, k, v, causal)  # a causal layer ignores the dataloader's mask
    fast_ignoring_doc = core(q, k, v, doc)
    explicit = masked_core(q, k, v, causal)  # explicit masked-softmax path
    explicit_doc = masked_core(q, k, v, doc)
    # Reference for the per-document mask: each document attended alone.
    half = SQ // 2
    first = core(q[:half], k[:half], v[:half], None)
    second = core(q[half:], k[half:], v[half:], None)
    return fast, fast_with_mask, fast_ignoring_doc, explicit, explicit_doc, first, second


def test_sdpa_fast_path_matches_explicit_path():
    fast, fast_mask, fast_doc, explicit, explicit_doc, first, second = run_distributed(
        _sdpa_vs_explicit, WORLD, tp=1
    )[0]
    torch.testing.assert_close(fast, explicit, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fast_mask, fast, atol=0, rtol=0)
    torch.testing.assert_close(fast_doc, fast, atol=0, rtol=0)
    # The arbitrary-mask path (--reset-attention-mask) applies the per-document mask exactly.
    torch.testing.assert_close(explicit_doc, torch.cat([first, second]), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(explicit_doc, fast, atol=1e-3)
