"""Hugging Face `CLIPVisionModel` / `SiglipVisionModel` <-> `CLIPViTModel` state dicts, and
the ViT classifier (`--vit-layout hf`) -> `ViTForImageClassification`.

Every weight is [out, in] on both sides, so nothing is transposed. The separate q/k/v
projections are fused into megatron-core's grouped QKV layout (per head: [q_h; k_h; v_h]). HF's
CLIP `post_layernorm` only feeds its `pooler_output` and has no counterpart (it is dropped on
import and written as identity on export); SigLIP's is the encoder's `ln_post`; SigLIP's
attention-pooling `head.*` is dropped. Keys are transformers 5.x's (no `vision_model.` prefix);
4.x / hub files with the prefix are accepted on import.
"""

from typing import Dict

import torch

from megatron.core.models.gpt.hf_weight_mapping import grouped_to_qkv, qkv_to_grouped

Tensor = torch.Tensor
StateDict = Dict[str, Tensor]

_LAYER_MAP = {
    'self_attn.out_proj': 'self_attention.linear_proj',
    'layer_norm1': 'input_layernorm',
    'layer_norm2': 'pre_mlp_layernorm',
    'mlp.fc1': 'mlp.linear_fc1',
    'mlp.fc2': 'mlp.linear_fc2',
}


def vision_config_kwargs(hf_config) -> dict:
    """The CLIPViTModel geometry and TransformerConfig fields of an HF CLIP/SigLIP vision config."""
    subtype = 'siglip' if 'siglip' in type(hf_config).__name__.lower() else 'clip'
    return {
        'model_subtype': subtype,
        'num_layers': hf_config.num_hidden_layers,
        'hidden_size': hf_config.hidden_size,
        'ffn_hidden_size': hf_config.intermediate_size,
        'num_attention_heads': hf_config.num_attention_heads,
        'layernorm_epsilon': hf_config.layer_norm_eps,
        'patch_dim': hf_config.patch_size,
        'img_h': hf_config.image_size,
        'img_w': hf_config.image_size,
        'num_channels': hf_config.num_channels,
        'hidden_act': hf_config.hidden_act,
    }


def _strip_prefix(sd: StateDict) -> StateDict:
    prefix = 'vision_model.'
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in sd.items()}


def _num_layers(sd: StateDict) -> int:
    ids = {int(k.split('.')[2]) for k in sd if k.startswith('encoder.layers.')}
    return max(ids) + 1 if ids else 0


def hf_to_mcore_vision_state_dict(hf_sd: StateDict, num_heads: int) -> StateDict:
    """HF CLIP / SigLIP vision weights -> CLIPViTModel keys (unsharded)."""
    sd = _strip_prefix(hf_sd)
    hidden = sd['embeddings.patch_embedding.weight'].shape[0]
    head_dim = hidden // num_heads
    out: StateDict = {
        'conv1.weight': sd['embeddings.patch_embedding.weight'],
        'position_embeddings.weight': sd['embeddings.position_embedding.weight'],
    }
    if 'embeddings.patch_embedding.bias' in sd:  # SigLIP
        out['conv1.bias'] = sd['embeddings.patch_embedding.bias']
        for suffix in ('weight', 'bias'):
            out[f'ln_post.{suffix}'] = sd[f'post_layernorm.{suffix}']
    else:  # CLIP
        out['class_token'] = sd['embeddings.class_embedding'].reshape(1, 1, hidden)
        for suffix in ('weight', 'bias'):
            out[f'ln_pre.{suffix}'] = sd[f'pre_layrnorm.{suffix}']
    for i in range(_num_layers(sd)):
        src, dst = f'encoder.layers.{i}.', f'decoder.layers.{i}.'
        for suffix in ('weight', 'bias'):
            q, k, v = (sd[f'{src}self_attn.{n}_proj.{suffix}'] for n in 'qkv')
            out[f'{dst}self_attention.linear_qkv.{suffix}'] = qkv_to_grouped(
                q, k, v, num_heads, num_heads, head_dim
            )
            for hf_name, mc_name in _LAYER_MAP.items():
                out[f'{dst}{mc_name}.{suffix}'] = sd[f'{src}{hf_name}.{suffix}']
    return out


def mcore_to_hf_vision_state_dict(mc_sd: StateDict, num_heads: int) -> StateDict:
    """CLIPViTModel keys (unsharded) -> HF CLIP / SigLIP vision weights (transformers 5.x keys).

    CLIP's `post_layernorm` (not part of CLIPViTModel) is written as identity (weight 1, bias 0).
    """
    sd = {k: v for k, v in mc_sd.items() if isinstance(v, torch.Tensor)}
    hidden = sd['conv1.weight'].shape[0]
    head_dim = hidden // num_heads
    out: StateDict = {
        'embeddings.patch_embedding.weight': sd['conv1.weight'],
        'embeddings.position_embedding.weight': sd['position_embeddings.weight'],
    }
    if 'conv1.bias' in sd:  # SigLIP
        out['embeddings.patch_embedding.bias'] = sd['conv1.bias']
        for suffix in ('weight', 'bias'):
            out[f'post_layernorm.{suffix}'] = sd[f'ln_post.{suffix}']
    else:
        out['embeddings.class_embedding'] = sd['class_token'].reshape(hidden)
        for suffix in ('weight', 'bias'):
            out[f'pre_layrnorm.{suffix}'] = sd[f'ln_pre.{suffix}']
        out['post_layernorm.weight'] = torch.ones(hidden, dtype=sd['conv1.weight'].dtype)
        out['post_layernorm.bias'] = torch.zeros(hidden, dtype=sd['conv1.weight'].dtype)
    layers = {int(k.split('.')[2]) for k in sd if k.startswith('decoder.layers.')}
    for i in sorted(layers):
        src, dst = f'decoder.layers.{i}.', f'encoder.layers.{i}.'
        for suffix in ('weight', 'bias'):
            fused = sd[f'{src}self_attention.linear_qkv.{suffix}']
            q, k, v = grouped_to_qkv(fused, num_heads, num_heads, head_dim)
            for name, tensor in zip('qkv', (q, k, v)):
                out[f'{dst}self_attn.{name}_proj.{suffix}'] = tensor.contiguous()
            for hf_name, mc_name in _LAYER_MAP.items():
                out[f'{dst}{hf_name}.{suffix}'] = sd[f'{src}{mc_name}.{suffix}']
    return out


_VIT_LAYER_MAP = {
    'attention.o_proj': 'self_attention.linear_proj',
    'layernorm_before': 'input_layernorm',
    'layernorm_after': 'pre_mlp_layernorm',
    'mlp.fc1': 'mlp.linear_fc1',
    'mlp.fc2': 'mlp.linear_fc2',
}


def mcore_to_hf_vit_classifier_state_dict(mc_sd: StateDict, num_heads: int) -> StateDict:
    """VitClassificationModel with `layout='hf'` (unsharded) -> ViTForImageClassification
    weights (transformers 5.x keys).

    The backbone's one class token, positions [s, h] (HF keeps [1, s, h]), biased patch
    convolution and final norm (`ln_post` = HF's `vit.layernorm`) and the linear head map one to
    one; the fused QKV is split back into q/k/v.
    """
    sd = {k: v for k, v in mc_sd.items() if isinstance(v, torch.Tensor)}
    hidden = sd['backbone.conv1.weight'].shape[0]
    head_dim = hidden // num_heads
    out: StateDict = {
        'vit.embeddings.cls_token': sd['backbone.class_token'].reshape(1, 1, hidden),
        'vit.embeddings.position_embeddings': sd['backbone.position_embeddings.weight'][None],
        'vit.embeddings.patch_embeddings.projection.weight': sd['backbone.conv1.weight'],
        'vit.embeddings.patch_embeddings.projection.bias': sd['backbone.conv1.bias'],
        'vit.layernorm.weight': sd['backbone.ln_post.weight'],
        'vit.layernorm.bias': sd['backbone.ln_post.bias'],
        'classifier.weight': sd['head.weight'],
        'classifier.bias': sd['head.bias'],
    }
    prefix = 'backbone.decoder.layers.'
    layers = {int(k[len(prefix) :].split('.')[0]) for k in sd if k.startswith(prefix)}
    for i in sorted(layers):
        src, dst = f'{prefix}{i}.', f'vit.layers.{i}.'
        for suffix in ('weight', 'bias'):
            fused = sd[f'{src}self_attention.linear_qkv.{suffix}']
            q, k, v = grouped_to_qkv(fused, num_heads, num_heads, head_dim)
            for name, tensor in zip('qkv', (q, k, v)):
                out[f'{dst}attention.{name}_proj.{suffix}'] = tensor.contiguous()
            for hf_name, mc_name in _VIT_LAYER_MAP.items():
                out[f'{dst}{hf_name}.{suffix}'] = sd[f'{src}{mc_name}.{suffix}']
    return out
