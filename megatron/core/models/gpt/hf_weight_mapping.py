"""Weight mapping between Hugging Face GPT-2 / Llama state dicts and megatron-core GPTModel ones,
and the tensor-parallel split / merge of a megatron-core state dict.

Pure functions on `{name: tensor}` dicts (no `transformers` import): the checkpoint converter
(tools/checkpoint, through megatron/training/checkpoint/hf_checkpoint.py and
checkpoint_conversion.py) and the parity tests use them. "Full" megatron-core state dicts are
TP=1, PP=1 state dicts (`GPTModel.state_dict()` names, as megatron-core core_r0.8.0 writes them).

Layouts handled here:
- HF GPT-2 uses Conv1D, whose weights are stored [in, out]: they are transposed.
- The fused QKV rows of megatron-core are grouped by query group, `[ng, np/ng + 2, hn]`: for each
  group its query heads, then its key head, then its value head. HF stores q, k, v separately
  (Llama) or as [q_all; k_all; v_all] (GPT-2 c_attn).
- SwiGLU `linear_fc1` is [gate; up] on one rank; under TP each rank holds [gate_r; up_r].
- RoPE: HF Llama weights already use the rotate-half convention of megatron-core's
  non-interleaved RoPE, so q/k need no permutation.
"""

import re
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
StateDict = Dict[str, Tensor]


# --------------------------------------------------------------------------------------------
# QKV layout helpers
# --------------------------------------------------------------------------------------------
def qkv_to_grouped(
    q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_query_groups: int, head_dim: int
) -> Tensor:
    """Fuse separate q [np*hn, ...], k and v [ng*hn, ...] into megatron-core's grouped layout
    [ng * (np/ng + 2) * hn, ...] (works for weights [., h] and biases [.])."""
    rest = q.shape[1:]
    heads_per_group = num_heads // num_query_groups
    q = q.reshape(num_query_groups, heads_per_group * head_dim, *rest)  # [ng, np/ng*hn, ...]
    k = k.reshape(num_query_groups, head_dim, *rest)  # [ng, hn, ...]
    v = v.reshape(num_query_groups, head_dim, *rest)  # [ng, hn, ...]
    fused = torch.cat([q, k, v], dim=1)  # [ng, (np/ng + 2) * hn, ...]
    return fused.reshape(num_query_groups * (heads_per_group + 2) * head_dim, *rest)


def grouped_to_qkv(fused: Tensor, num_heads: int, num_query_groups: int, head_dim: int):
    """Inverse of `qkv_to_grouped`: returns (q [np*hn, ...], k [ng*hn, ...], v [ng*hn, ...])."""
    rest = fused.shape[1:]
    heads_per_group = num_heads // num_query_groups
    fused = fused.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(fused, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest),
        k.reshape(num_query_groups * head_dim, *rest),
        v.reshape(num_query_groups * head_dim, *rest),
    )


def _pad_vocab(weight: Tensor, padded_vocab_size: Optional[int]) -> Tensor:
    if padded_vocab_size is None or padded_vocab_size == weight.shape[0]:
        return weight
    if padded_vocab_size < weight.shape[0]:
        raise ValueError(
            f"padded_vocab_size ({padded_vocab_size}) is smaller than the checkpoint vocabulary "
            f"({weight.shape[0]})"
        )
    pad = weight.new_zeros(padded_vocab_size - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def _unpad_vocab(weight: Tensor, true_vocab_size: Optional[int]) -> Tensor:
    return weight if true_vocab_size is None else weight[:true_vocab_size]


def _num_layers(sd: StateDict, pattern: str) -> int:
    layers = {int(m.group(1)) for key in sd for m in [re.match(pattern, key)] if m}
    return max(layers) + 1 if layers else 0


# --------------------------------------------------------------------------------------------
# GPT-2
# --------------------------------------------------------------------------------------------
def gpt2_config_kwargs(hf_config) -> dict:
    """TransformerConfig and GPTModel keyword arguments equivalent to a HF GPT2Config.

    Returns:
        {'config': {...TransformerConfig kwargs}, 'model': {...GPTModel kwargs except config and
        spec}}. The vocabulary size is the HF one (pad it for TP yourself).
    """
    from megatron.core.transformer.utils import openai_gelu

    act = hf_config.activation_function
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        activation = openai_gelu
    elif act == "gelu":
        activation = F.gelu
    else:
        raise ValueError(f"GPT-2 activation_function {act!r} has no megatron-core equivalent here")
    if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or getattr(
        hf_config, "reorder_and_upcast_attn", False
    ):
        raise ValueError(
            "scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported"
        )
    return {
        "config": dict(
            num_layers=hf_config.n_layer,
            hidden_size=hf_config.n_embd,
            num_attention_heads=hf_config.n_head,
            ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
            layernorm_epsilon=hf_config.layer_norm_epsilon,
            activation_func=activation,
            normalization="LayerNorm",
            add_bias_linear=True,
            hidden_dropout=hf_config.resid_pdrop,
            attention_dropout=hf_config.attn_pdrop,
            init_method_std=hf_config.initializer_range,
        ),
        "model": dict(
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.n_positions,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=True,
        ),
    }


def gpt2_hf_to_mcore_state_dict(
    hf_state_dict: StateDict, config, padded_vocab_size: Optional[int] = None
) -> StateDict:
    """HF GPT2LMHeadModel / GPT2Model state dict -> full megatron-core GPTModel state dict.

    Args:
        hf_state_dict: HF names (with or without the "transformer." prefix).
        config: the TransformerConfig (num_attention_heads, kv_channels).
        padded_vocab_size: pad the embedding rows with zeros to this size.
    """
    sd = {
        k[len("transformer.") :] if k.startswith("transformer.") else k: v
        for k, v in hf_state_dict.items()
    }
    np_, hn = config.num_attention_heads, config.kv_channels
    out: StateDict = {}
    out["embedding.word_embeddings.weight"] = _pad_vocab(sd["wte.weight"], padded_vocab_size)
    out["embedding.position_embeddings.weight"] = sd["wpe.weight"]
    for i in range(_num_layers(sd, r"h\.(\d+)\.")):
        p, m = f"h.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = sd[p + "ln_1.weight"]
        out[m + "input_layernorm.bias"] = sd[p + "ln_1.bias"]
        # Conv1D [h, 3h] -> [3h, h] = [q_all; k_all; v_all] -> grouped by head.
        w = sd[p + "attn.c_attn.weight"].t()
        b = sd[p + "attn.c_attn.bias"]
        out[m + "self_attention.linear_qkv.weight"] = qkv_to_grouped(
            *w.chunk(3, dim=0), np_, np_, hn
        )
        out[m + "self_attention.linear_qkv.bias"] = qkv_to_grouped(*b.chunk(3, dim=0), np_, np_, hn)
        out[m + "self_attention.linear_proj.weight"] = sd[p + "attn.c_proj.weight"].t()
        out[m + "self_attention.linear_proj.bias"] = sd[p + "attn.c_proj.bias"]
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "ln_2.weight"]
        out[m + "pre_mlp_layernorm.bias"] = sd[p + "ln_2.bias"]
        out[m + "mlp.linear_fc1.weight"] = sd[p + "mlp.c_fc.weight"].t()
        out[m + "mlp.linear_fc1.bias"] = sd[p + "mlp.c_fc.bias"]
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.c_proj.weight"].t()
        out[m + "mlp.linear_fc2.bias"] = sd[p + "mlp.c_proj.bias"]
    out["decoder.final_layernorm.weight"] = sd["ln_f.weight"]
    out["decoder.final_layernorm.bias"] = sd["ln_f.bias"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def mcore_to_gpt2_hf_state_dict(
    mcore_state_dict: StateDict, config, true_vocab_size: Optional[int] = None
) -> StateDict:
    """Full megatron-core GPTModel state dict -> HF GPT2LMHeadModel state dict (tied lm_head)."""
    sd = mcore_state_dict
    np_, hn = config.num_attention_heads, config.kv_channels
    out: StateDict = {}
    wte = _unpad_vocab(sd["embedding.word_embeddings.weight"], true_vocab_size)
    out["transformer.wte.weight"] = wte
    out["transformer.wpe.weight"] = sd["embedding.position_embeddings.weight"]
    for i in range(_num_layers(sd, r"decoder\.layers\.(\d+)\.")):
        p, m = f"transformer.h.{i}.", f"decoder.layers.{i}."
        out[p + "ln_1.weight"] = sd[m + "input_layernorm.weight"]
        out[p + "ln_1.bias"] = sd[m + "input_layernorm.bias"]
        q, k, v = grouped_to_qkv(sd[m + "self_attention.linear_qkv.weight"], np_, np_, hn)
        out[p + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t()
        q, k, v = grouped_to_qkv(sd[m + "self_attention.linear_qkv.bias"], np_, np_, hn)
        out[p + "attn.c_attn.bias"] = torch.cat([q, k, v], dim=0)
        out[p + "attn.c_proj.weight"] = sd[m + "self_attention.linear_proj.weight"].t()
        out[p + "attn.c_proj.bias"] = sd[m + "self_attention.linear_proj.bias"]
        out[p + "ln_2.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        out[p + "ln_2.bias"] = sd[m + "pre_mlp_layernorm.bias"]
        out[p + "mlp.c_fc.weight"] = sd[m + "mlp.linear_fc1.weight"].t()
        out[p + "mlp.c_fc.bias"] = sd[m + "mlp.linear_fc1.bias"]
        out[p + "mlp.c_proj.weight"] = sd[m + "mlp.linear_fc2.weight"].t()
        out[p + "mlp.c_proj.bias"] = sd[m + "mlp.linear_fc2.bias"]
    out["transformer.ln_f.weight"] = sd["decoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = sd["decoder.final_layernorm.bias"]
    out["lm_head.weight"] = _unpad_vocab(sd.get("output_layer.weight", wte), true_vocab_size)
    return {k: v.contiguous().clone() for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Llama
# --------------------------------------------------------------------------------------------
def llama_config_kwargs(hf_config) -> dict:
    """TransformerConfig and GPTModel keyword arguments equivalent to a HF LlamaConfig
    (same return format as `gpt2_config_kwargs`)."""
    if hf_config.hidden_act != "silu":
        raise ValueError(
            f"Llama hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')"
        )
    rope_scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    scaling = {}
    if rope_type == "llama3":
        # Megatron's --use-rope-scaling fixes the other Llama-3.1 constants.
        fixed = dict(
            low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        )
        other = {k: rope_scaling.get(k) for k in fixed if rope_scaling.get(k) != fixed[k]}
        if other:
            raise ValueError(
                f"Llama-3.1 rope scaling with {other} is not supported (Megatron's "
                f"--use-rope-scaling fixes {fixed})"
            )
        scaling = dict(rope_scaling=True, rope_scaling_factor=float(rope_scaling["factor"]))
    elif rope_type != "default":
        raise ValueError(f"Llama rope_scaling {rope_scaling} is not supported")
    rope_theta = getattr(hf_config, "rope_theta", None)
    if rope_theta is None:
        rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    return {
        "config": dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=hf_config.num_key_value_heads,
            kv_channels=head_dim,
            ffn_hidden_size=hf_config.intermediate_size,
            layernorm_epsilon=hf_config.rms_norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=getattr(hf_config, "mlp_bias", False),
            add_qkv_bias=getattr(hf_config, "attention_bias", False),
            hidden_dropout=0.0,
            attention_dropout=getattr(hf_config, "attention_dropout", 0.0),
            init_method_std=hf_config.initializer_range,
        ),
        "model": dict(
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=rope_theta,
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            **scaling,
        ),
    }


def llama_hf_to_mcore_state_dict(
    hf_state_dict: StateDict, config, padded_vocab_size: Optional[int] = None
) -> StateDict:
    """HF LlamaForCausalLM state dict -> full megatron-core GPTModel state dict (biasless Llama;
    attention/MLP biases are mapped when present)."""
    sd = hf_state_dict
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    out: StateDict = {}
    out["embedding.word_embeddings.weight"] = _pad_vocab(
        sd["model.embed_tokens.weight"], padded_vocab_size
    )
    for i in range(_num_layers(sd, r"model\.layers\.(\d+)\.")):
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
        for norm in ("q", "k"):  # Qwen3's per-head query / key RMSNorm
            if f"{p}self_attn.{norm}_norm.weight" in sd:
                out[f"{m}self_attention.{norm}_layernorm.weight"] = sd[
                    f"{p}self_attn.{norm}_norm.weight"
                ]
        if p + "self_attn.o_proj.bias" in sd:
            out[m + "self_attention.linear_proj.bias"] = sd[p + "self_attn.o_proj.bias"]
        out[m + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]], dim=0
        )
        if p + "mlp.gate_proj.bias" in sd:
            out[m + "mlp.linear_fc1.bias"] = torch.cat(
                [sd[p + "mlp.gate_proj.bias"], sd[p + "mlp.up_proj.bias"]], dim=0
            )
        out[m + "mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
        if p + "mlp.down_proj.bias" in sd:
            out[m + "mlp.linear_fc2.bias"] = sd[p + "mlp.down_proj.bias"]
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    if "lm_head.weight" in sd and not _same_storage(
        sd["lm_head.weight"], sd["model.embed_tokens.weight"]
    ):
        out["output_layer.weight"] = _pad_vocab(sd["lm_head.weight"], padded_vocab_size)
    return {k: v.contiguous().clone() for k, v in out.items()}


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def mcore_to_llama_hf_state_dict(
    mcore_state_dict: StateDict, config, true_vocab_size: Optional[int] = None
) -> StateDict:
    """Full megatron-core GPTModel state dict -> HF LlamaForCausalLM state dict."""
    sd = mcore_state_dict
    np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
    ffn = config.ffn_hidden_size
    out: StateDict = {}
    emb = _unpad_vocab(sd["embedding.word_embeddings.weight"], true_vocab_size)
    out["model.embed_tokens.weight"] = emb
    for i in range(_num_layers(sd, r"decoder\.layers\.(\d+)\.")):
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
        for norm in ("q", "k"):
            if f"{m}self_attention.{norm}_layernorm.weight" in sd:
                out[f"{p}self_attn.{norm}_norm.weight"] = sd[
                    f"{m}self_attention.{norm}_layernorm.weight"
                ]
        if m + "self_attention.linear_proj.bias" in sd:
            out[p + "self_attn.o_proj.bias"] = sd[m + "self_attention.linear_proj.bias"]
        out[p + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        fc1 = sd[m + "mlp.linear_fc1.weight"]
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1[:ffn], fc1[ffn:]
        if m + "mlp.linear_fc1.bias" in sd:
            fc1_b = sd[m + "mlp.linear_fc1.bias"]
            out[p + "mlp.gate_proj.bias"], out[p + "mlp.up_proj.bias"] = fc1_b[:ffn], fc1_b[ffn:]
        out[p + "mlp.down_proj.weight"] = sd[m + "mlp.linear_fc2.weight"]
        if m + "mlp.linear_fc2.bias" in sd:
            out[p + "mlp.down_proj.bias"] = sd[m + "mlp.linear_fc2.bias"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = _unpad_vocab(sd.get("output_layer.weight", emb), true_vocab_size)
    return {k: v.contiguous().clone() for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Tensor-parallel split / merge of full megatron-core state dicts
# --------------------------------------------------------------------------------------------
_COLUMN_PARALLEL = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "output_layer.bias",  # BERT's output layer has a bias, split along the vocabulary too
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_q.weight",
    "self_attention.linear_q.bias",
    "self_attention.linear_kv.weight",
    "self_attention.linear_kv.bias",
    # Multi-latent attention: the query and up projections are split by heads (the down
    # projections are duplicated).
    "self_attention.linear_q_proj.weight",
    "self_attention.linear_q_up_proj.weight",
    "self_attention.linear_kv_up_proj.weight",
    # Multi-token prediction: eh_proj [h, 2h] is split along its output.
    "eh_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    # T5's decoder cross attention: column-parallel q and kv (whole heads per rank, kv rows
    # grouped per head as [k_h; v_h]), row-parallel output projection.
    "cross_attention.linear_q.weight",
    "cross_attention.linear_q.bias",
    "cross_attention.linear_kv.weight",
    "cross_attention.linear_kv.bias",
)
_ROW_PARALLEL = (
    "self_attention.linear_proj.weight",
    "cross_attention.linear_proj.weight",
    "mlp.linear_fc2.weight",
)


# An MoE layer's experts and shared experts are MLPs split like the dense one.
_MOE_MLP = re.compile(r"mlp\.(?:experts\.local_experts\.\d+\.|shared_experts\.)(linear_fc[12]\.)")


def _as_dense_mlp_name(name: str) -> str:
    """`...mlp.experts.local_experts.{i}.linear_fc1.weight` (or shared_experts) ->
    `...mlp.linear_fc1.weight`: the same split rules apply."""
    return _MOE_MLP.sub(r"mlp.\1", name)


def tensor_parallel_partition_dim(name: str) -> Optional[int]:
    """The dimension a megatron-core GPT / BERT / T5 parameter is split along under TP (None =
    replicated)."""
    name = _as_dense_mlp_name(name)
    if name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def _is_gated_fc1(name: str, config) -> bool:
    return config.gated_linear_unit and _as_dense_mlp_name(name).endswith(
        ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
    )


def split_state_dict_for_tensor_parallel(
    full_state_dict: StateDict, config, tp_size: int
) -> List[StateDict]:
    """Split a full (TP=1) megatron-core state dict into `tp_size` per-rank state dicts.

    Column-parallel tensors are cut along dim 0 (the grouped QKV layout hands each rank whole
    query groups; a gated fc1 is cut per half so each rank holds [gate_r; up_r]), row-parallel
    ones along dim 1, everything else is replicated.
    """
    shards: List[StateDict] = [{} for _ in range(tp_size)]
    for name, tensor in full_state_dict.items():
        if not isinstance(tensor, torch.Tensor):  # e.g. `_extra_state` entries (None)
            for shard in shards:
                shard[name] = tensor
            continue
        dim = tensor_parallel_partition_dim(name)
        if dim is None or tp_size == 1:
            for shard in shards:
                shard[name] = tensor.clone()
            continue
        if tensor.shape[dim] % tp_size != 0:
            raise ValueError(
                f"{name}: size {tensor.shape[dim]} of dim {dim} is not divisible by tp_size "
                f"{tp_size}"
            )
        if _is_gated_fc1(name, config):
            gate, up = tensor.chunk(2, dim=0)
            pieces = [
                torch.cat([g, u], dim=0)
                for g, u in zip(gate.chunk(tp_size, 0), up.chunk(tp_size, 0))
            ]
        else:
            pieces = tensor.chunk(tp_size, dim=dim)
        for shard, piece in zip(shards, pieces):
            shard[name] = piece.contiguous().clone()
    return shards


def merge_tensor_parallel_state_dicts(shards: List[StateDict], config) -> StateDict:
    """Inverse of `split_state_dict_for_tensor_parallel` (replicated tensors are taken from rank
    0)."""
    merged: StateDict = {}
    for name, tensor in shards[0].items():
        if not isinstance(tensor, torch.Tensor):  # e.g. `_extra_state` entries (None)
            merged[name] = tensor
            continue
        dim = tensor_parallel_partition_dim(name)
        if dim is None or len(shards) == 1:
            merged[name] = tensor.clone()
        elif _is_gated_fc1(name, config):
            halves = [s[name].chunk(2, dim=0) for s in shards]
            merged[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            merged[name] = torch.cat([s[name] for s in shards], dim=dim)
    return merged
