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
[E, 2f, h], `down_proj` [E, h, f]); the export writes them per expert.

Multi-token prediction module k (DeepSeek's files: the extra layer `model.layers.{L + k}.`) is
`mtp.layers.{k}.`: its decoder layer maps as above under `transformer_layer.`, enorm / hnorm /
eh_proj keep their names, `shared_head.norm` is `final_layernorm`; `shared_head.head` and
`embed_tokens` are copies of the main output layer and embedding (not imported, written back).
"""

from typing import Dict, Optional

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


def _hf_layer_to_mcore(sd: StateDict, p: str, m: str, moe: bool, num_experts: int, out) -> None:
    """One decoder layer `p` (HF prefix) -> `m` (megatron-core prefix)."""
    out[m + 'input_layernorm.weight'] = sd[p + 'input_layernorm.weight']
    out[m + 'pre_mlp_layernorm.weight'] = sd[p + 'post_attention_layernorm.weight']
    for hf_name, name in _ATTENTION.items():
        if p + 'self_attn.' + hf_name in sd:
            out[m + 'self_attention.' + name] = sd[p + 'self_attn.' + hf_name]
    if not moe:
        _dense(sd, p + 'mlp.', m + 'mlp.', out)
        return
    out[m + 'mlp.router.weight'] = sd[p + 'mlp.gate.weight']
    out[m + 'mlp.router.expert_bias'] = sd[p + 'mlp.gate.e_score_correction_bias'].float()
    for j, (gate, up, down) in enumerate(_experts(sd, p, num_experts)):
        local = f'{m}mlp.experts.local_experts.{j}.'
        out[local + 'linear_fc1.weight'] = torch.cat([gate, up], dim=0)
        out[local + 'linear_fc2.weight'] = down
    if p + 'mlp.shared_experts.gate_proj.weight' in sd:
        _dense(sd, p + 'mlp.shared_experts.', m + 'mlp.shared_experts.', out)


#: MTP module parts besides its decoder layer: HF `model.layers.{L + k}.` name -> ours under
#: `mtp.layers.{k}.` (`shared_head.head` and `embed_tokens` are copies of the main tables).
_MTP = {
    'enorm.weight': 'enorm.weight',
    'hnorm.weight': 'hnorm.weight',
    'eh_proj.weight': 'eh_proj.weight',
    'shared_head.norm.weight': 'final_layernorm.weight',
}


def deepseek_v3_hf_to_mcore_state_dict(
    sd: StateDict,
    num_layers: int,
    first_k_dense_replace: int,
    num_experts: int,
    mtp_layers: int = 0,
) -> StateDict:
    """Full megatron-core state dict of the main model and its first `mtp_layers` MTP modules
    (HF layers num_layers + k; further ones are left out)."""
    out = {
        'embedding.word_embeddings.weight': sd['model.embed_tokens.weight'],
        'decoder.final_layernorm.weight': sd['model.norm.weight'],
    }
    if 'lm_head.weight' in sd:
        out['output_layer.weight'] = sd['lm_head.weight']
    for i in range(num_layers):
        p, m = f'model.layers.{i}.', f'decoder.layers.{i}.'
        _hf_layer_to_mcore(sd, p, m, i >= first_k_dense_replace, num_experts, out)
    for k in range(mtp_layers):
        p, m = f'model.layers.{num_layers + k}.', f'mtp.layers.{k}.'
        _hf_layer_to_mcore(sd, p, m + 'transformer_layer.', True, num_experts, out)
        for hf_name, name in _MTP.items():
            out[m + name] = sd[p + hf_name]
    return out


def _dense(sd: StateDict, hf_prefix: str, prefix: str, out: StateDict) -> None:
    out[prefix + 'linear_fc1.weight'] = torch.cat(
        [sd[hf_prefix + 'gate_proj.weight'], sd[hf_prefix + 'up_proj.weight']], dim=0
    )
    out[prefix + 'linear_fc2.weight'] = sd[hf_prefix + 'down_proj.weight']


def _mcore_layer_to_hf(sd: StateDict, m: str, p: str, moe: bool, out: StateDict) -> None:
    """Inverse of `_hf_layer_to_mcore` (per-expert names, as the files on disk)."""
    out[p + 'input_layernorm.weight'] = sd[m + 'input_layernorm.weight']
    out[p + 'post_attention_layernorm.weight'] = sd[m + 'pre_mlp_layernorm.weight']
    for hf_name, name in _ATTENTION.items():
        if m + 'self_attention.' + name in sd:
            out[p + 'self_attn.' + hf_name] = sd[m + 'self_attention.' + name]

    def dense(prefix, hf_prefix):
        gate, up = sd[prefix + 'linear_fc1.weight'].chunk(2, dim=0)
        out[hf_prefix + 'gate_proj.weight'], out[hf_prefix + 'up_proj.weight'] = gate, up
        out[hf_prefix + 'down_proj.weight'] = sd[prefix + 'linear_fc2.weight']

    if not moe:
        dense(m + 'mlp.', p + 'mlp.')
        return
    out[p + 'mlp.gate.weight'] = sd[m + 'mlp.router.weight']
    out[p + 'mlp.gate.e_score_correction_bias'] = sd[m + 'mlp.router.expert_bias'].float()
    j = 0
    while f'{m}mlp.experts.local_experts.{j}.linear_fc1.weight' in sd:
        dense(f'{m}mlp.experts.local_experts.{j}.', f'{p}mlp.experts.{j}.')
        j += 1
    if m + 'mlp.shared_experts.linear_fc1.weight' in sd:
        dense(m + 'mlp.shared_experts.', p + 'mlp.shared_experts.')


def mcore_to_deepseek_v3_hf_state_dict(
    sd: StateDict,
    num_layers: int,
    first_k_dense_replace: int,
    num_experts: int,
    true_vocab_size: Optional[int] = None,
    mtp_layers: int = 0,
) -> StateDict:
    """Full megatron-core state dict -> DeepSeek-V3 tensors as DeepSeek's files hold them: the
    experts per expert, MTP module k as layer num_layers + k with copies of the embedding and
    output tables. Every routed expert 0 .. num_experts - 1 must be present (ValueError)."""
    emb = sd['embedding.word_embeddings.weight']
    emb = emb[:true_vocab_size] if true_vocab_size is not None else emb
    head = sd.get('output_layer.weight', emb)
    head = head[:true_vocab_size] if true_vocab_size is not None else head
    out = {
        'model.embed_tokens.weight': emb,
        'model.norm.weight': sd['decoder.final_layernorm.weight'],
        'lm_head.weight': head,
    }
    layers = [
        (f'decoder.layers.{i}.', f'model.layers.{i}.', i >= first_k_dense_replace)
        for i in range(num_layers)
    ]
    layers += [
        (f'mtp.layers.{k}.transformer_layer.', f'model.layers.{num_layers + k}.', True)
        for k in range(mtp_layers)
    ]
    for m, p, moe in layers:
        _mcore_layer_to_hf(sd, m, p, moe, out)
        if moe and f'{m}mlp.experts.local_experts.{num_experts - 1}.linear_fc1.weight' not in sd:
            raise ValueError(f'{m}mlp: fewer than the {num_experts} routed experts')
    for k in range(mtp_layers):
        p, m = f'model.layers.{num_layers + k}.', f'mtp.layers.{k}.'
        for hf_name, name in _MTP.items():
            out[p + hf_name] = sd[m + name]
        out[p + 'shared_head.head.weight'] = head
        out[p + 'embed_tokens.weight'] = emb
    return {k: v.contiguous().clone() for k, v in out.items()}
