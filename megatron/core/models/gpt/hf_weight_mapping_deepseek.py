"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`) weights -> megatron-core GPT keys with
multi-latent attention (TP = EP = PP = 1 full state dicts).

Attention (per layer `model.layers.{i}.self_attn.` -> `decoder.layers.{i}.self_attention.`):
q_proj / q_a_proj / q_a_layernorm / q_b_proj / kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj /
o_proj are linear_q_proj / linear_q_down_proj / q_layernorm / linear_q_up_proj /
linear_kv_down_proj / kv_layernorm / linear_kv_up_proj / linear_proj. The first
`first_k_dense_replace` layers have a dense MLP (`mlp.linear_fc1` = [gate_proj; up_proj]); the
others are MoE: `mlp.gate.weight` is `mlp.router.weight`, `mlp.gate.e_score_correction_bias` is
`mlp.router.expert_bias`, the routed experts are `mlp.experts.local_experts.{j}.*` and
`mlp.shared_experts.*` keeps its name. Experts come either per expert (`mlp.experts.{j}.gate_proj`
..., the files on disk) or fused as transformers 5 holds them in memory (`gate_up_proj`
[E, 2f, h], `down_proj` [E, h, f]).
"""

from typing import Dict

import torch
from torch import Tensor

StateDict = Dict[str, Tensor]

_ATTENTION = {
    'q_proj.weight': 'linear_q_proj.weight',
    'q_a_proj.weight': 'linear_q_down_proj.weight',
    'q_a_layernorm.weight': 'q_layernorm.weight',
    'q_b_proj.weight': 'linear_q_up_proj.weight',
    'kv_a_proj_with_mqa.weight': 'linear_kv_down_proj.weight',
    'kv_a_layernorm.weight': 'kv_layernorm.weight',
    'kv_b_proj.weight': 'linear_kv_up_proj.weight',
    'o_proj.weight': 'linear_proj.weight',
}


def _experts(sd: StateDict, p: str, num_experts: int):
    """[(gate, up, down)] per expert from either HF layout."""
    fused = p + 'mlp.experts.gate_up_proj'
    if fused in sd:
        gate_up, down = sd[fused], sd[p + 'mlp.experts.down_proj']
        return [(*gate_up[j].chunk(2, dim=0), down[j]) for j in range(num_experts)]
    e = p + 'mlp.experts.'
    return [
        (
            sd[f'{e}{j}.gate_proj.weight'],
            sd[f'{e}{j}.up_proj.weight'],
            sd[f'{e}{j}.down_proj.weight'],
        )
        for j in range(num_experts)
    ]


def deepseek_v3_hf_to_mcore_state_dict(
    sd: StateDict, num_layers: int, first_k_dense_replace: int, num_experts: int
) -> StateDict:
    """Full megatron-core state dict of the main model (MTP layers beyond num_layers are left
    out)."""
    out = {
        'embedding.word_embeddings.weight': sd['model.embed_tokens.weight'],
        'decoder.final_layernorm.weight': sd['model.norm.weight'],
        'output_layer.weight': sd['lm_head.weight'],
    }
    for i in range(num_layers):
        p, m = f'model.layers.{i}.', f'decoder.layers.{i}.'
        out[m + 'input_layernorm.weight'] = sd[p + 'input_layernorm.weight']
        out[m + 'pre_mlp_layernorm.weight'] = sd[p + 'post_attention_layernorm.weight']
        for hf_name, name in _ATTENTION.items():
            if p + 'self_attn.' + hf_name in sd:
                out[m + 'self_attention.' + name] = sd[p + 'self_attn.' + hf_name]
        if i < first_k_dense_replace:
            _dense(sd, p + 'mlp.', m + 'mlp.', out)
            continue
        out[m + 'mlp.router.weight'] = sd[p + 'mlp.gate.weight']
        out[m + 'mlp.router.expert_bias'] = sd[p + 'mlp.gate.e_score_correction_bias'].float()
        for j, (gate, up, down) in enumerate(_experts(sd, p, num_experts)):
            local = f'{m}mlp.experts.local_experts.{j}.'
            out[local + 'linear_fc1.weight'] = torch.cat([gate, up], dim=0)
            out[local + 'linear_fc2.weight'] = down
        _dense(sd, p + 'mlp.shared_experts.', m + 'mlp.shared_experts.', out)
    return out


def _dense(sd: StateDict, hf_prefix: str, prefix: str, out: StateDict) -> None:
    out[prefix + 'linear_fc1.weight'] = torch.cat(
        [sd[hf_prefix + 'gate_proj.weight'], sd[hf_prefix + 'up_proj.weight']], dim=0
    )
    out[prefix + 'linear_fc2.weight'] = sd[hf_prefix + 'down_proj.weight']
