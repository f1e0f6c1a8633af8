"""Hugging Face <-> megatron-core state dicts of Mamba / hybrid models (tensor-parallel size 1).

- `Mamba2ForCausalLM` (pure Mamba, keys `backbone.*`);
- `NemotronHForCausalLM` (hybrid; keys `backbone.*` on disk, `model.*` in memory in
  transformers 5.x: both are read, `prefix` chooses what is written).

Megatron keys (plain state dict of MambaModel with mamba_stack_spec): a Mamba layer's pre-norm
is `decoder.layers.{i}.mixer.in_proj.layer_norm_weight`; the mixer's other tensors have the
same names and layouts as HF's (in_proj rows z | x | B | C | dt in both). Attention layers fuse
q, k, v per query group (`linear_qkv`), MLP layers are non-gated fc1 / fc2. The vocabulary is
padded on import and trimmed on export.
"""

import math
import re
from typing import Dict, List, Optional

import torch

from megatron.core.models.gpt.hf_weight_mapping import (
    _pad_vocab,
    _unpad_vocab,
    grouped_to_qkv,
    qkv_to_grouped,
)
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols

Tensor = torch.Tensor
StateDict = Dict[str, Tensor]

#: HF `layers_block_type` names of the pattern symbols (the older short names are read too).
HF_BLOCK_TYPES = {
    Symbols.MAMBA: 'mamba',
    Symbols.ATTENTION: 'attention',
    Symbols.MLP: 'mlp',
}
_HF_TO_SYMBOL = {
    'mamba': Symbols.MAMBA,
    'linear_attention': Symbols.MAMBA,
    'attention': Symbols.ATTENTION,
    'full_attention': Symbols.ATTENTION,
    'mlp': Symbols.MLP,
}
_MIXER_KEYS = (
    'conv1d.weight',
    'conv1d.bias',
    'A_log',
    'D',
    'dt_bias',
    'norm.weight',
    'out_proj.weight',
    'in_proj.weight',
)


def pattern_from_hf_config(hf_config) -> str:
    """The hybrid pattern of an HF config ('M' * L for Mamba2)."""
    block_types = getattr(hf_config, 'layers_block_type', None)
    if block_types is None:
        return Symbols.MAMBA * hf_config.num_hidden_layers
    unknown = sorted({t for t in block_types if t not in _HF_TO_SYMBOL})
    if unknown:
        raise ValueError(f"layers_block_type {unknown} are not supported (MoE is not)")
    return ''.join(_HF_TO_SYMBOL[t] for t in block_types)


def mamba_config_kwargs(hf_config) -> dict:
    """{'config': TransformerConfig kwargs, 'model': MambaModel kwargs} of an HF
    Mamba2Config / NemotronHConfig (fp32, no dropout)."""
    pattern = pattern_from_hf_config(hf_config)
    hidden = hf_config.hidden_size
    is_nemotron = hasattr(hf_config, 'layers_block_type')
    if is_nemotron:
        mamba = dict(
            mamba_num_heads=hf_config.mamba_num_heads,
            mamba_head_dim=hf_config.mamba_head_dim,
            mamba_state_dim=hf_config.ssm_state_size,
        )
        heads = hf_config.num_attention_heads
        act = hf_config.mlp_hidden_act
        if act == 'relu2':
            from megatron.core.transformer.utils import squared_relu

            activation = squared_relu
        elif act == 'gelu':
            activation = torch.nn.functional.gelu
        else:
            raise ValueError(f"mlp_hidden_act {act!r} is not supported (relu2 or gelu)")
        extra = dict(
            num_query_groups=hf_config.num_key_value_heads,
            kv_channels=hf_config.head_dim,
            ffn_hidden_size=hf_config.intermediate_size,
            activation_func=activation,
        )
    else:
        mamba = dict(
            mamba_num_heads=hf_config.num_heads,
            mamba_head_dim=hf_config.head_dim,
            mamba_state_dim=hf_config.state_size,
        )
        heads = math.gcd(hidden, hf_config.num_heads)  # unused: no attention layer
        extra = {}
    config = dict(
        num_layers=len(pattern),
        hidden_size=hidden,
        num_attention_heads=heads,
        mamba_num_groups=hf_config.n_groups,
        normalization='RMSNorm',
        layernorm_epsilon=hf_config.layer_norm_epsilon,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **mamba,
        **extra,
    )
    model = dict(
        vocab_size=hf_config.vocab_size,
        max_sequence_length=getattr(hf_config, 'max_position_embeddings', 4096),
        hybrid_override_pattern=pattern,
        position_embedding_type='none',
        share_embeddings_and_output_weights=bool(getattr(hf_config, 'tie_word_embeddings', False)),
    )
    return dict(config=config, model=model)


def _hf_prefix(hf_sd: StateDict) -> str:
    for prefix in ('backbone.', 'model.'):
        if f'{prefix}embeddings.weight' in hf_sd:
            return prefix
    raise ValueError("not a Mamba2 / NemotronH state dict (no backbone. or model. embeddings)")


def hf_to_mcore_state_dict(
    hf_sd: StateDict,
    config,
    pattern: str,
    padded_vocab_size: Optional[int] = None,
    tied: bool = False,
) -> StateDict:
    """HF Mamba2 / NemotronH tensors -> MambaModel's plain state dict (tp = 1); with `tied`
    the output layer reads the embedding, so lm_head.weight is not imported."""
    p = _hf_prefix(hf_sd)
    out = {
        'embedding.word_embeddings.weight': _pad_vocab(
            hf_sd[f'{p}embeddings.weight'], padded_vocab_size
        )
    }
    head_dim = config.kv_channels
    for i, symbol in enumerate(pattern):
        src, dst = f'{p}layers.{i}.', f'decoder.layers.{i}.'
        norm = hf_sd[f'{src}norm.weight']
        if symbol == Symbols.MAMBA:
            out[f'{dst}mixer.in_proj.layer_norm_weight'] = norm
            for key in _MIXER_KEYS:
                out[f'{dst}mixer.{key}'] = hf_sd[f'{src}mixer.{key}']
        elif symbol == Symbols.ATTENTION:
            out[f'{dst}input_layernorm.weight'] = norm
            out[f'{dst}self_attention.linear_qkv.weight'] = qkv_to_grouped(
                hf_sd[f'{src}mixer.q_proj.weight'],
                hf_sd[f'{src}mixer.k_proj.weight'],
                hf_sd[f'{src}mixer.v_proj.weight'],
                config.num_attention_heads,
                config.num_query_groups,
                head_dim,
            )
            out[f'{dst}self_attention.linear_proj.weight'] = hf_sd[f'{src}mixer.o_proj.weight']
        else:
            out[f'{dst}pre_mlp_layernorm.weight'] = norm
            out[f'{dst}mlp.linear_fc1.weight'] = hf_sd[f'{src}mixer.up_proj.weight']
            out[f'{dst}mlp.linear_fc2.weight'] = hf_sd[f'{src}mixer.down_proj.weight']
    out['decoder.final_norm.weight'] = hf_sd[f'{p}norm_f.weight']
    if 'lm_head.weight' in hf_sd and not tied:
        out['output_layer.weight'] = _pad_vocab(hf_sd['lm_head.weight'], padded_vocab_size)
    return out


def mcore_to_hf_state_dict(
    sd: StateDict,
    config,
    pattern: str,
    prefix: str = 'backbone.',
    true_vocab_size: Optional[int] = None,
) -> StateDict:
    """MambaModel's plain state dict (tp = 1) -> HF tensors under `prefix`; `lm_head.weight`
    is the embedding when the model is tied (NemotronH has no tying, so it gets a copy)."""
    out = {
        f'{prefix}embeddings.weight': _unpad_vocab(
            sd['embedding.word_embeddings.weight'], true_vocab_size
        )
    }
    for i, symbol in enumerate(pattern):
        src, dst = f'decoder.layers.{i}.', f'{prefix}layers.{i}.'
        if symbol == Symbols.MAMBA:
            out[f'{dst}norm.weight'] = sd[f'{src}mixer.in_proj.layer_norm_weight']
            for key in _MIXER_KEYS:
                out[f'{dst}mixer.{key}'] = sd[f'{src}mixer.{key}']
        elif symbol == Symbols.ATTENTION:
            out[f'{dst}norm.weight'] = sd[f'{src}input_layernorm.weight']
            q, k, v = grouped_to_qkv(
                sd[f'{src}self_attention.linear_qkv.weight'],
                config.num_attention_heads,
                config.num_query_groups,
                config.kv_channels,
            )
            out[f'{dst}mixer.q_proj.weight'] = q
            out[f'{dst}mixer.k_proj.weight'] = k
            out[f'{dst}mixer.v_proj.weight'] = v
            out[f'{dst}mixer.o_proj.weight'] = sd[f'{src}self_attention.linear_proj.weight']
        else:
            out[f'{dst}norm.weight'] = sd[f'{src}pre_mlp_layernorm.weight']
            out[f'{dst}mixer.up_proj.weight'] = sd[f'{src}mlp.linear_fc1.weight']
            out[f'{dst}mixer.down_proj.weight'] = sd[f'{src}mlp.linear_fc2.weight']
    out[f'{prefix}norm_f.weight'] = sd['decoder.final_norm.weight']
    head = sd.get('output_layer.weight', sd['embedding.word_embeddings.weight'])
    out['lm_head.weight'] = _unpad_vocab(head, true_vocab_size)
    return out


def layer_indices(sd: StateDict) -> List[int]:
    """The layer indices present in a MambaModel state dict."""
    found = {int(m.group(1)) for k in sd for m in [re.match(r'decoder\.layers\.(\d+)\.', k)] if m}
    return sorted(found)
