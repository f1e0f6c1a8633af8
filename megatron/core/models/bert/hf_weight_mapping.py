"""Weight mapping between Hugging Face `MegatronBertForPreTraining` and megatron-core BertModel
state dicts (full, i.e. TP=1 / PP=1 names as `BertModel.state_dict()` gives them).

Pure functions on `{name: tensor}` dicts (no `transformers` import). HF's MegatronBert has the
same architecture as megatron-core BERT (pre-LN layers, final LayerNorm, no embedding LayerNorm,
tied decoder with a bias); only the names and the fused QKV differ:

- megatron-core fuses q, k, v into `linear_qkv` with rows grouped per head, `[nh, 3, hd]`
  (grouped-query layout with ng = nh); HF keeps `query`, `key`, `value` separate.
- HF has no "no token types" option: a BertModel without a token-type table maps to a zero table.
- The MLP of a megatron-core model trained with the CLI defaults uses the tanh GeLU (bias-GeLU
  fusion) while the LM head uses the exact GeLU; HF has one `hidden_act` for both, so exact parity
  needs a model built with the exact GeLU in the MLP (`bias_activation_fusion=False`, the
  `TransformerConfig` default).
"""

from typing import Dict, Optional

import torch

from megatron.core.models.gpt.hf_weight_mapping import (
    _num_layers,
    _pad_vocab,
    _unpad_vocab,
    grouped_to_qkv,
    qkv_to_grouped,
)

Tensor = torch.Tensor
StateDict = Dict[str, Tensor]

# megatron-core name -> HF name, per layer ("{}" = layer index) and for the rest of the model.
_LAYER_NAMES = {
    'input_layernorm': 'attention.ln',
    'self_attention.linear_proj': 'attention.output.dense',
    'pre_mlp_layernorm': 'ln',
    'mlp.linear_fc1': 'intermediate.dense',
    'mlp.linear_fc2': 'output.dense',
}
_OTHER_NAMES = {
    'embedding.word_embeddings.weight': 'bert.embeddings.word_embeddings.weight',
    'embedding.position_embeddings.weight': 'bert.embeddings.position_embeddings.weight',
    'embedding.tokentype_embeddings.weight': 'bert.embeddings.token_type_embeddings.weight',
    'encoder.final_layernorm.weight': 'bert.encoder.ln.weight',
    'encoder.final_layernorm.bias': 'bert.encoder.ln.bias',
    'lm_head.dense.weight': 'cls.predictions.transform.dense.weight',
    'lm_head.dense.bias': 'cls.predictions.transform.dense.bias',
    'lm_head.layer_norm.weight': 'cls.predictions.transform.LayerNorm.weight',
    'lm_head.layer_norm.bias': 'cls.predictions.transform.LayerNorm.bias',
    'output_layer.bias': 'cls.predictions.bias',
    'binary_head.weight': 'cls.seq_relationship.weight',
    'binary_head.bias': 'cls.seq_relationship.bias',
    'pooler.dense.weight': 'bert.pooler.dense.weight',
    'pooler.dense.bias': 'bert.pooler.dense.bias',
}
_VOCAB_ROWS = ('embedding.word_embeddings.weight', 'output_layer.weight', 'output_layer.bias')


def megatron_bert_config_kwargs(hf_config) -> dict:
    """TransformerConfig and BertModel keyword arguments equivalent to a HF MegatronBertConfig.

    Returns:
        {'config': {...TransformerConfig kwargs}, 'model': {...BertModel kwargs except config and
        spec}}. The vocabulary size is the HF one (pad it for TP yourself).
    """
    if hf_config.hidden_act != 'gelu':
        raise ValueError(
            f"MegatronBert hidden_act {hf_config.hidden_act!r}: only the exact 'gelu' of "
            "megatron-core's BERT head is supported"
        )
    return {
        'config': dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_attention_heads=hf_config.num_attention_heads,
            ffn_hidden_size=hf_config.intermediate_size,
            layernorm_epsilon=hf_config.layer_norm_eps,
            activation_func=torch.nn.functional.gelu,
            bias_activation_fusion=False,
            add_bias_linear=True,
            hidden_dropout=hf_config.hidden_dropout_prob,
            attention_dropout=hf_config.attention_probs_dropout_prob,
            init_method_std=hf_config.initializer_range,
        ),
        'model': dict(
            num_tokentypes=hf_config.type_vocab_size,
            vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            share_embeddings_and_output_weights=True,
        ),
    }


def megatron_bert_hf_to_mcore_state_dict(
    hf_state_dict: StateDict, config, padded_vocab_size: Optional[int] = None
) -> StateDict:
    """HF MegatronBertForPreTraining state dict -> full megatron-core BertModel state dict.

    The output layer is tied: `cls.predictions.decoder.weight` is dropped (it is the word table).

    Args:
        hf_state_dict: HF names.
        config: the TransformerConfig (num_attention_heads, kv_channels).
        padded_vocab_size: pad the vocabulary rows (word table, output bias) with zeros.
    """
    nh, hd = config.num_attention_heads, config.kv_channels
    out: StateDict = {}
    for mc_name, hf_name in _OTHER_NAMES.items():
        if hf_name in hf_state_dict:
            out[mc_name] = hf_state_dict[hf_name]
    num_layers = _num_layers(hf_state_dict, r'bert\.encoder\.layer\.(\d+)\.')
    for i in range(num_layers):
        hf_prefix, mc_prefix = f'bert.encoder.layer.{i}.', f'encoder.layers.{i}.'
        for mc_sub, hf_sub in _LAYER_NAMES.items():
            for kind in ('weight', 'bias'):
                out[f'{mc_prefix}{mc_sub}.{kind}'] = hf_state_dict[f'{hf_prefix}{hf_sub}.{kind}']
        for kind in ('weight', 'bias'):
            q, k, v = (
                hf_state_dict[f'{hf_prefix}attention.self.{n}.{kind}']
                for n in ('query', 'key', 'value')
            )
            fused = qkv_to_grouped(q, k, v, nh, nh, hd)  # [nh * 3 * hd, ...]
            out[f'{mc_prefix}self_attention.linear_qkv.{kind}'] = fused
    for name in _VOCAB_ROWS:
        if name in out:
            out[name] = _pad_vocab(out[name], padded_vocab_size)
    return {k: v.clone() for k, v in out.items()}


def mcore_to_megatron_bert_hf_state_dict(
    mcore_state_dict: StateDict,
    config,
    true_vocab_size: Optional[int] = None,
    num_tokentypes_if_absent: int = 2,
) -> StateDict:
    """Full megatron-core BertModel state dict -> HF MegatronBertForPreTraining state dict.

    Args:
        mcore_state_dict: `BertModel.state_dict()` names (TP=1); `_extra_state` entries ignored.
        config: the TransformerConfig (num_attention_heads, kv_channels, hidden_size).
        true_vocab_size: drop the padded vocabulary rows beyond this size.
        num_tokentypes_if_absent: rows of the zero token-type table written when the model has
            none (HF always has one).
    """
    nh, hd = config.num_attention_heads, config.kv_channels
    sd = {k: v for k, v in mcore_state_dict.items() if isinstance(v, torch.Tensor)}
    out: StateDict = {}
    for mc_name, hf_name in _OTHER_NAMES.items():
        if mc_name in sd:
            tensor = sd[mc_name]
            if mc_name in _VOCAB_ROWS:
                tensor = _unpad_vocab(tensor, true_vocab_size)
            out[hf_name] = tensor
    if 'embedding.tokentype_embeddings.weight' not in sd:
        word = sd['embedding.word_embeddings.weight']
        out['bert.embeddings.token_type_embeddings.weight'] = word.new_zeros(
            num_tokentypes_if_absent, word.shape[1]
        )
    decoder = sd.get('output_layer.weight', sd['embedding.word_embeddings.weight'])
    out['cls.predictions.decoder.weight'] = _unpad_vocab(decoder, true_vocab_size)
    out['cls.predictions.decoder.bias'] = out['cls.predictions.bias']
    num_layers = _num_layers(sd, r'encoder\.layers\.(\d+)\.')
    for i in range(num_layers):
        hf_prefix, mc_prefix = f'bert.encoder.layer.{i}.', f'encoder.layers.{i}.'
        for mc_sub, hf_sub in _LAYER_NAMES.items():
            for kind in ('weight', 'bias'):
                out[f'{hf_prefix}{hf_sub}.{kind}'] = sd[f'{mc_prefix}{mc_sub}.{kind}']
        for kind in ('weight', 'bias'):
            fused = sd[f'{mc_prefix}self_attention.linear_qkv.{kind}']
            q, k, v = grouped_to_qkv(fused, nh, nh, hd)
            for n, t in zip(('query', 'key', 'value'), (q, k, v)):
                out[f'{hf_prefix}attention.self.{n}.{kind}'] = t
    return {k: v.clone() for k, v in out.items()}
