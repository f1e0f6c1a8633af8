"""A tiny DeepSeek-V3 (MLA + group-limited sigmoid MoE with expert bias and shared experts +
first-k dense layers + YaRN) as our GPTModel against transformers' DeepseekV3ForCausalLM.

The config is built here with random weights (no download). Logits agree at TP=1, TP=2 and EP=2;
the group-limited router alone agrees with DeepseekV3TopkRouter's choices and weights, and
differs once the groups are ignored (so the test sees the group limit).
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

V, S, B, H, N, L = 64, 12, 2, 32, 4, 3
E, TOPK, GROUPS, GROUP_TOPK = 8, 4, 4, 2


def _hf_model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(11)
    config = DeepseekV3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=N,
        n_shared_experts=1,
        n_routed_experts=E,
        num_experts_per_tok=TOPK,
        n_group=GROUPS,
        topk_group=GROUP_TOPK,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        max_position_embeddings=64,
        rope_parameters=dict(
            rope_type='yarn',
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    config._attn_implementation = 'eager'
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if 'e_score_correction_bias' in name:
                tensor.copy_(torch.rand(E) * 0.2)
            elif name.endswith('gate.weight'):
                tensor.normal_(0, 0.5)
            elif 'layernorm' in name or name.endswith('norm.weight'):
                tensor.uniform_(0.5, 1.5)
    return model


def _our_config(tp, ep):
    import torch.nn.functional as F

    from megatron.core.transformer.mla_transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=N,
        ffn_hidden_size=48,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=16,
        mscale=1.0,
        mscale_all_dim=1.0,
        qk_layernorm=True,
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=E,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16,
        moe_layer_freq=[0, 1, 1],
        moe_router_topk=TOPK,
        moe_router_score_function='sigmoid',
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=GROUPS,
        moe_router_group_topk=GROUP_TOPK,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type='none',
        moe_router_dtype='fp32',
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        use_cpu_initialization=True,
    )


def _local_experts(sd, ep, ep_rank):
    """Keep this EP rank's experts, renumbered from 0."""
    per = E // ep
    out = {}
    for name, tensor in sd.items():
        if '.local_experts.' in name:
            head, rest = name.split('.local_experts.')
            j, tail = rest.split('.', 1)
            if int(j) // per != ep_rank:
                continue
            name = f'{head}.local_experts.{int(j) % per}.{tail}'
        out[name] = tensor
    return out


def _logits_vs_hf():
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs_mla import get_gpt_mla_decoder_block_spec
    from megatron.core.models.gpt.hf_weight_mapping import split_state_dict_for_tensor_parallel
    from megatron.core.models.gpt.hf_weight_mapping_deepseek import (
        deepseek_v3_hf_to_mcore_state_dict,
    )

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    hf = _hf_model()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf_logits = hf(ids).logits

    config = _our_config(tp, ep)
    model = GPTModel(
        config,
        get_gpt_mla_decoder_block_spec(config),
        vocab_size=V,
        max_sequence_length=64,
        position_embedding_type='rope',
        parallel_output=False,
    ).eval()
    full = deepseek_v3_hf_to_mcore_state_dict(hf.state_dict(), L, 1, E)
    shard = split_state_dict_for_tensor_parallel(full, config, tp)[
        parallel_state.get_tensor_model_parallel_rank()
    ]
    shard = _local_experts(shard, ep, parallel_state.get_expert_model_parallel_rank())
    missing, unexpected = model.load_state_dict(shard, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith('_extra_state') for k in missing), missing
    with torch.no_grad():
        logits = model(ids, None, None)
    return dict(logits=logits, hf_logits=hf_logits)


@pytest.mark.parametrize('tp,ep', [(1, 1), (2, 1), (1, 2)])
def test_deepseek_v3_logits_equal_hf(tp, ep):
    world = max(tp, ep, 1) if tp * ep > 1 else 1
    for res in run_distributed(_logits_vs_hf, world, tp=tp, ep=ep):
        torch.testing.assert_close(res['logits'], res['hf_logits'], atol=2e-5, rtol=1e-4)


def test_group_limited_routing_equals_hf_gate():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from megatron.core.transformer.moe.moe_utils import topk_softmax_with_capacity

    gate = DeepseekV3TopkRouter(_hf_model().config)
    torch.manual_seed(3)
    with torch.no_grad():
        gate.weight.normal_(0, 1.0)
        gate.e_score_correction_bias.copy_(torch.rand(E) * 0.3)
    x = torch.randn(64, H)
    logits, hf_weights, hf_indices = gate(x)
    kwargs = dict(score_function='sigmoid', expert_bias=gate.e_score_correction_bias)
    probs, indices, _ = topk_softmax_with_capacity(
        logits, TOPK, scaling_factor=2.5, num_groups=GROUPS, group_topk=GROUP_TOPK, **kwargs
    )
    order, hf_order = indices.sort(dim=1), hf_indices.sort(dim=1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(
        probs.gather(1, order.indices), hf_weights.gather(1, hf_order.indices)
    )
    # Without the group limit some tokens choose experts of a third group.
    _, free, _ = topk_softmax_with_capacity(logits, TOPK, scaling_factor=2.5, **kwargs)
    assert not torch.equal(free.sort(dim=1).values, hf_order.values)


@pytest.mark.parametrize(
    'change,message',
    [
        (dict(moe_router_num_groups=3), 'must divide num_moe_experts'),
        (dict(moe_router_group_topk=5), 'must be between 1 and moe_router_num_groups'),
        (dict(moe_router_group_topk=None), 'must be set together'),
    ],
)
def test_group_limited_routing_config_errors(change, message):
    import dataclasses

    base = _our_config(1, 1)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields.update(change, init_method=None, output_layer_init_method=None, kv_channels=None)
    with pytest.raises(ValueError, match=message):
        type(base)(**fields)
