"""Weight mapping between Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE state dicts and full
(TP = EP = PP = 1) megatron-core GPTModel state dicts with MoE layers.

Pure functions on `{name: tensor}` dicts (no `transformers` import), in the on-disk key names that
`save_pretrained` writes (transformers 4.36 to 5.x):

- Mixtral: `model.layers.{i}.block_sparse_moe.gate.weight` [E, h] is the router;
  `block_sparse_moe.experts.{j}.w1` (gate) and `w3` (up) [f, h] form
  `mlp.experts.local_experts.{j}.linear_fc1.weight` = [w1; w3], `w2` [h, f] is `linear_fc2`.
- Qwen2-MoE: `mlp.gate.weight` is the router; `mlp.experts.{j}.gate_proj / up_proj / down_proj`
  the experts; `mlp.shared_expert.*` the shared experts (`mlp.shared_experts.linear_fc1` =
  [gate_proj; up_proj]); `mlp.shared_expert_gate.weight` [1, h] is `mlp.shared_experts.gate_weight`.
  Layers listed in `mlp_only_layers` (or skipped by `decoder_sparse_step`) have a dense
  `mlp.gate_proj / up_proj / down_proj`. Attention has q/k/v biases (`qkv_bias`).
- Qwen3-MoE: Qwen2-MoE's expert names without the shared expert; `self_attn.q_norm` / `k_norm`
  [head_dim] are `self_attention.q_layernorm` / `k_layernorm`.

Attention, norms, embeddings and the output layer map as for Llama (the grouped QKV layout of
`hf_weight_mapping`). Every expert weight is checked: a missing or mis-shaped one raises
ValueError naming it (a converter must never leave random experts behind).
"""

import re
from typing import Dict, List, Optional

import torch

from megatron.core.models.gpt.hf_weight_mapping import (
    _pad_vocab,
    _same_storage,
    _unpad_vocab,
    grouped_to_qkv,
    qkv_to_grouped,
)

Tensor = torch.Tensor
StateDict = Dict[str, Tensor]

#: HF key fragments of the routed experts: (router, expert prefix, gate, up, down).
_EXPERT_KEYS = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.", "w1", "w3", "w2"),
    "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{j}.", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{j}.", "gate_proj", "up_proj", "down_proj"),
}
#: Qwen3-MoE's per-head query / key RMSNorms: HF name -> megatron-core name (under the layer).
_QK_NORMS = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}


def _take(sd: StateDict, key: str, shape: tuple) -> Tensor:
    """sd[key], checked to exist with `shape` (ValueError in one line otherwise)."""
    if key not in sd:
        raise ValueError(f"Hugging Face checkpoint: {key} is missing")
    tensor = sd[key]
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(
            f"Hugging Face checkpoint: {key} has shape {tuple(tensor.shape)}, expected "
            f"{tuple(shape)}"
        )
    return tensor


def _num_layers(sd: StateDict, pattern: str) -> int:
    layers = {int(m.group(1)) for key in sd for m in [re.match(pattern, key)] if m}
    return max(layers) + 1 if layers else 0


def moe_hf_to_mcore_state_dict(
    hf_state_dict: StateDict, family: str, config, padded_vocab_size: Optional[int] = None
) -> StateDict:
    """HF Mixtral / Qwen2-MoE state dict -> full megatron-core GPTModel state dict.

    Args:
        family: "mixtral" or "qwen2_moe".
        config: namespace with num_layers, hidden_size, num_attention_heads, num_query_groups,
            kv_channels, num_moe_experts, moe_ffn_hidden_size, ffn_hidden_size (dense layers),
            moe_shared_expert_intermediate_size and moe_layer_pattern ([num_layers] 0/1).
    """
    sd = hf_state_dict
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    h, num_experts, f = config.hidden_size, config.num_moe_experts, config.moe_ffn_hidden_size
    router_key, expert_prefix, gate, up, down = _EXPERT_KEYS[family]
    out: StateDict = {}
    out["embedding.word_embeddings.weight"] = _pad_vocab(
        sd["model.embed_tokens.weight"], padded_vocab_size
    )
    found = _num_layers(sd, r"model\.layers\.(\d+)\.")
    if found != config.num_layers:
        raise ValueError(
            f"Hugging Face checkpoint: {found} layers, the config has {config.num_layers}"
        )
    for i in range(config.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv_to_grouped(
            sd[p + "self_attn.q_proj.weight"],
            sd[p + "self_attn.k_proj.weight"],
            sd[p + "self_attn.v_proj.weight"],
            np_,
            ng,
            hn,
        )
        if p + "self_attn.q_proj.bias" in sd:
            out[m + "self_attention.linear_qkv.bias"] = qkv_to_grouped(
                sd[p + "self_attn.q_proj.bias"],
                sd[p + "self_attn.k_proj.bias"],
                sd[p + "self_attn.v_proj.bias"],
                np_,
                ng,
                hn,
            )
        out[m + "self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        for hf_name, name in _QK_NORMS.items():
            if family == "qwen3_moe":
                out[m + name] = _take(sd, p + hf_name, (hn,))
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        if not config.moe_layer_pattern[i]:
            dense_f = config.ffn_hidden_size
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [
                    _take(sd, p + "mlp.gate_proj.weight", (dense_f, h)),
                    _take(sd, p + "mlp.up_proj.weight", (dense_f, h)),
                ]
            )
            out[m + "mlp.linear_fc2.weight"] = _take(sd, p + "mlp.down_proj.weight", (h, dense_f))
            continue
        out[m + "mlp.router.weight"] = _take(sd, p + router_key, (num_experts, h))
        for j in range(num_experts):
            e = p + expert_prefix.format(j=j)
            local = f"{m}mlp.experts.local_experts.{j}."
            out[local + "linear_fc1.weight"] = torch.cat(
                [_take(sd, e + f"{gate}.weight", (f, h)), _take(sd, e + f"{up}.weight", (f, h))]
            )
            out[local + "linear_fc2.weight"] = _take(sd, e + f"{down}.weight", (h, f))
        extra = [k for k in sd if k.startswith(p + expert_prefix.split("{j}")[0])]
        expected = {
            p + expert_prefix.format(j=j) + f"{w}.weight"
            for j in range(num_experts)
            for w in (gate, up, down)
        }
        unexpected = sorted(set(extra) - expected)
        if unexpected:
            raise ValueError(
                f"Hugging Face checkpoint: {unexpected[0]} is not an expert of the "
                f"{num_experts}-expert config"
            )
        fs = config.moe_shared_expert_intermediate_size
        if fs is not None:
            s = p + "mlp.shared_expert."
            shared = m + "mlp.shared_experts."
            out[shared + "linear_fc1.weight"] = torch.cat(
                [
                    _take(sd, s + "gate_proj.weight", (fs, h)),
                    _take(sd, s + "up_proj.weight", (fs, h)),
                ]
            )
            out[shared + "linear_fc2.weight"] = _take(sd, s + "down_proj.weight", (h, fs))
            out[shared + "gate_weight"] = _take(sd, p + "mlp.shared_expert_gate.weight", (1, h))
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    if "lm_head.weight" in sd and not _same_storage(
        sd["lm_head.weight"], sd["model.embed_tokens.weight"]
    ):
        out["output_layer.weight"] = _pad_vocab(sd["lm_head.weight"], padded_vocab_size)
    return {k: v.contiguous().clone() for k, v in out.items()}


def mcore_to_moe_hf_state_dict(
    mcore_state_dict: StateDict, family: str, config, true_vocab_size: Optional[int] = None
) -> StateDict:
    """Full megatron-core GPTModel state dict -> HF Mixtral / Qwen2-MoE state dict (on-disk
    names), every expert checked to be present with its shape."""
    sd = mcore_state_dict
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    h, num_experts, f = config.hidden_size, config.num_moe_experts, config.moe_ffn_hidden_size
    router_key, expert_prefix, gate, up, down = _EXPERT_KEYS[family]
    out: StateDict = {}
    emb = _unpad_vocab(sd["embedding.word_embeddings.weight"], true_vocab_size)
    out["model.embed_tokens.weight"] = emb
    for i in range(config.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        q, k, v = grouped_to_qkv(sd[m + "self_attention.linear_qkv.weight"], np_, ng, hn)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
        out[p + "self_attn.v_proj.weight"] = v
        if m + "self_attention.linear_qkv.bias" in sd:
            q, k, v = grouped_to_qkv(sd[m + "self_attention.linear_qkv.bias"], np_, ng, hn)
            out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"] = q, k
            out[p + "self_attn.v_proj.bias"] = v
        out[p + "self_attn.o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        for hf_name, name in _QK_NORMS.items():
            if family == "qwen3_moe":
                out[p + hf_name] = _take(sd, m + name, (hn,))
        out[p + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        if not config.moe_layer_pattern[i]:
            dense_f = config.ffn_hidden_size
            fc1 = _take(sd, m + "mlp.linear_fc1.weight", (2 * dense_f, h))
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1.chunk(2)
            out[p + "mlp.down_proj.weight"] = _take(sd, m + "mlp.linear_fc2.weight", (h, dense_f))
            continue
        out[p + router_key] = _take(sd, m + "mlp.router.weight", (num_experts, h))
        for j in range(num_experts):
            e = p + expert_prefix.format(j=j)
            local = f"{m}mlp.experts.local_experts.{j}."
            fc1 = _take(sd, local + "linear_fc1.weight", (2 * f, h))
            out[e + f"{gate}.weight"], out[e + f"{up}.weight"] = fc1.chunk(2)
            out[e + f"{down}.weight"] = _take(sd, local + "linear_fc2.weight", (h, f))
        fs = config.moe_shared_expert_intermediate_size
        if fs is not None:
            s, shared = p + "mlp.shared_expert.", m + "mlp.shared_experts."
            fc1 = _take(sd, shared + "linear_fc1.weight", (2 * fs, h))
            out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = fc1.chunk(2)
            out[s + "down_proj.weight"] = _take(sd, shared + "linear_fc2.weight", (h, fs))
            out[p + "mlp.shared_expert_gate.weight"] = _take(sd, shared + "gate_weight", (1, h))
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = _unpad_vocab(sd.get("output_layer.weight", emb), true_vocab_size)
    return {k: v.contiguous().clone() for k, v in out.items()}


def qwen2_moe_layer_pattern(
    num_layers: int, decoder_sparse_step: int, mlp_only_layers
) -> List[int]:
    """Which Qwen2-MoE layers are sparse (1) or dense (0), as transformers decides."""
    only = set(mlp_only_layers or [])
    step = decoder_sparse_step or 1
    return [int(i not in only and (i + 1) % step == 0) for i in range(num_layers)]
