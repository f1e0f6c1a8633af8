"""MLASelfAttention against transformers' DeepseekV3Attention (tiny random config built here).

- Forward output and the gradients of the input and of every weight equal Hugging Face's, with
  q-LoRA and YaRN (factor 4, mscale = mscale_all_dim = 1) and without q-LoRA (plain rope).
- The same at TP=2 (heads split, down projections duplicated) and TP=2 with sequence
  parallelism, after `finalize_model_grads`' TP all-reduce of the norm/duplicated gradients.
- Decoding over the latent KV cache, one token at a time, equals the full forward.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

S, B, H, N = 8, 2, 32, 4
Q_LORA, KV_LORA, DN, DR, DV = 16, 12, 8, 4, 6

# our name -> (HF name, how the TP split cuts it: 0 rows, 1 columns, None duplicated)
_NAMES = {
    'linear_q_proj.weight': ('q_proj.weight', 0),
    'linear_q_down_proj.weight': ('q_a_proj.weight', None),
    'q_layernorm.weight': ('q_a_layernorm.weight', None),
    'linear_q_up_proj.weight': ('q_b_proj.weight', 0),
    'linear_kv_down_proj.weight': ('kv_a_proj_with_mqa.weight', None),
    'kv_layernorm.weight': ('kv_a_layernorm.weight', None),
    'linear_kv_up_proj.weight': ('kv_b_proj.weight', 0),
    'linear_proj.weight': ('o_proj.weight', 1),
}


def _hf_config(q_lora, yarn):
    from transformers import DeepseekV3Config

    rope = {'rope_type': 'default', 'rope_theta': 10000.0}
    if yarn:
        rope = dict(
            rope_type='yarn',
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        )
    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=H,
        num_attention_heads=N,
        num_key_value_heads=N,
        q_lora_rank=q_lora,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=DN,
        qk_rope_head_dim=DR,
        v_head_dim=DV,
        max_position_embeddings=64,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=False,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
    )
    config._attn_implementation = 'eager'
    return config


def _our_config(q_lora, yarn, tp, sp):
    from megatron.core.transformer.mla_transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=N,
        q_lora_rank=q_lora,
        kv_lora_rank=KV_LORA,
        qk_head_dim=DN,
        qk_pos_emb_head_dim=DR,
        v_head_dim=DV,
        rope_type='yarn' if yarn else 'rope',
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=16,
        mscale=1.0,
        mscale_all_dim=1.0,
        qk_layernorm=True,
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
    )


def _hf_run(q_lora, yarn, x):
    """HF attention output and gradients on x [b, s, h] (seeded weights, norms perturbed)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    torch.manual_seed(7)
    config = _hf_config(q_lora, yarn)
    attn = hf.DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if 'layernorm' in name:
                param.uniform_(0.5, 1.5)
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    x = x.clone().requires_grad_(True)
    position_ids = torch.arange(S).unsqueeze(0).expand(B, S)
    cos, sin = rotary(x, position_ids)
    mask = torch.full((S, S), float('-inf')).triu(1).expand(B, 1, S, S)
    out, _ = attn(x, position_embeddings=(cos, sin), attention_mask=mask)
    (out * torch.linspace(-1, 1, H)).sum().backward()
    grads = {name: p.grad for name, p in attn.named_parameters()}
    weights = {name: p.detach().clone() for name, p in attn.named_parameters()}
    return out.detach(), x.grad, weights, grads


def _mla_vs_hf(q_lora, yarn, sp):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed.finalize_model_grads import _allreduce_layernorm_grads
    from megatron.core.models.gpt.gpt_layer_specs_mla import get_gpt_mla_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3))
    hf_out, hf_xgrad, hf_weights, hf_grads = _hf_run(q_lora, yarn, x)

    config = _our_config(q_lora, yarn, tp, sp)
    spec = get_gpt_mla_layer_local_spec(qk_layernorm=True).submodules.self_attention
    attn = build_module(spec, config=config, layer_number=1)
    params = dict(attn.named_parameters())
    with torch.no_grad():
        for ours, param in params.items():
            hf_name, dim = _NAMES[ours]
            full = hf_weights[hf_name]
            param.copy_(full if dim is None else full.chunk(tp, dim=dim)[rank])
    xs = x.transpose(0, 1).contiguous()  # [s, b, h]
    if sp:
        xs = xs.chunk(tp, dim=0)[rank]
    xs = xs.clone().requires_grad_(True)
    out, bias = attn(xs, attention_mask=None)
    assert bias is None
    if sp:
        out = tensor_parallel.gather_from_sequence_parallel_region(out, False)
    (out * torch.linspace(-1, 1, H)).sum().backward()
    _allreduce_layernorm_grads([attn], config)
    x_grad = xs.grad
    if sp:
        x_grad = tensor_parallel.gather_from_sequence_parallel_region(x_grad, False)
    grads = {}
    for ours, param in params.items():
        hf_name, dim = _NAMES[ours]
        ref = hf_grads[hf_name]
        grads[ours] = (param.grad, ref if dim is None else ref.chunk(tp, dim=dim)[rank])
    return dict(
        out=out.detach().transpose(0, 1),
        hf_out=hf_out,
        x_grad=x_grad.transpose(0, 1),
        hf_x_grad=hf_xgrad,
        grads=grads,
    )


def _check(results):
    for res in results:
        torch.testing.assert_close(res['out'], res['hf_out'], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(res['x_grad'], res['hf_x_grad'], atol=2e-6, rtol=1e-5)
        for name, (ours, ref) in res['grads'].items():
            torch.testing.assert_close(ours, ref, atol=5e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize('q_lora,yarn', [(Q_LORA, True), (None, False)])
def test_mla_equals_hf_deepseek_v3_attention(q_lora, yarn):
    _check(run_distributed(_mla_vs_hf, 2, tp=1, args=(q_lora, yarn, False)))


@pytest.mark.parametrize('sp', [False, True])
def test_mla_tp2_equals_hf(sp):
    _check(run_distributed(_mla_vs_hf, 2, tp=2, args=(Q_LORA, True, sp)))


def _decode_with_latent_cache():
    from megatron.core.inference_params import InferenceParams
    from megatron.core.models.gpt.gpt_layer_specs_mla import get_gpt_mla_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    config = _our_config(Q_LORA, True, 1, False)
    spec = get_gpt_mla_layer_local_spec(qk_layernorm=True).submodules.self_attention
    attn = build_module(spec, config=config, layer_number=1).eval()
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full, _ = attn(x, attention_mask=None)
        params = InferenceParams(B, S)
        prefill, _ = attn(x[:3], attention_mask=None, inference_params=params)
        steps = [prefill]
        params.sequence_len_offset = 3
        for i in range(3, S):
            out, _ = attn(x[i : i + 1], attention_mask=None, inference_params=params)
            steps.append(out)
            params.sequence_len_offset += 1
    latent, k_pos = params.key_value_memory_dict[1]
    return dict(full=full, steps=torch.cat(steps), cache_shapes=(latent.shape, k_pos.shape))


def test_mla_latent_kv_cache_decode_equals_full_forward():
    (res,) = run_distributed(_decode_with_latent_cache, 1)
    torch.testing.assert_close(res['steps'], res['full'], atol=1e-6, rtol=1e-5)
    # The cache holds the latent and the shared rotary key, not per-head keys and values.
    assert res['cache_shapes'] == (torch.Size([S, B, KV_LORA]), torch.Size([S, B, 1, DR]))
