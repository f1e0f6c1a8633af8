"""Hugging Face `LlavaForConditionalGeneration` state dict <-> `LLaVAModel` (unsharded).

The language model goes through the Llama mapping, the vision tower through the CLIP mapping
(layers past the selected `vision_feature_layer` are dropped: LLaVAModel does not build them),
and the projector's `linear_1` / `linear_2` become `encoder.linear_fc1` / `encoder.linear_fc2`.
Both transformers 5.x keys (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`) and the hub's 4.x keys (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`) are read.
"""

from typing import Dict, Optional

import torch

from megatron.core.models.gpt.hf_weight_mapping import (
    llama_hf_to_mcore_state_dict,
    mcore_to_llama_hf_state_dict,
    merge_tensor_parallel_state_dicts,
    split_state_dict_for_tensor_parallel,
)
from megatron.core.models.vision.hf_weight_mapping import (
    hf_to_mcore_vision_state_dict,
    mcore_to_hf_vision_state_dict,
)

StateDict = Dict[str, torch.Tensor]

_PREFIXES = (
    # (HF prefix, part, prefix inside the part's own HF model)
    ('model.language_model.', 'lm', 'model.'),
    ('language_model.model.', 'lm', 'model.'),
    ('language_model.lm_head.', 'lm', 'lm_head.'),
    ('lm_head.', 'lm', 'lm_head.'),
    ('model.vision_tower.', 'vision', ''),
    ('vision_tower.', 'vision', ''),
    ('model.multi_modal_projector.', 'projector', ''),
    ('multi_modal_projector.', 'projector', ''),
)


def _split_parts(hf_sd: StateDict) -> Dict[str, StateDict]:
    parts: Dict[str, StateDict] = {'lm': {}, 'vision': {}, 'projector': {}}
    for key, value in hf_sd.items():
        for prefix, part, inner in _PREFIXES:
            if key.startswith(prefix):
                parts[part][inner + key[len(prefix) :]] = value
                break
    return parts


def llava_hf_to_mcore_state_dict(
    hf_sd: StateDict,
    language_config,
    vision_num_heads: int,
    vision_num_layers: int,
    padded_vocab_size: Optional[int] = None,
) -> StateDict:
    """HF LLaVA weights -> LLaVAModel keys; `vision_num_layers` is the number of ViT layers the
    model builds (`vision_layers_for_feature_layer`)."""
    parts = _split_parts(hf_sd)
    out: StateDict = {}
    lm = llama_hf_to_mcore_state_dict(parts['lm'], language_config, padded_vocab_size)
    out.update({f'language_model.{k}': v for k, v in lm.items()})
    vision = hf_to_mcore_vision_state_dict(parts['vision'], vision_num_heads)
    for key, value in vision.items():
        if key.startswith('decoder.layers.') and int(key.split('.')[2]) >= vision_num_layers:
            continue
        out[f'vision_model.{key}'] = value
    for hf_name, mc_name in (('linear_1', 'linear_fc1'), ('linear_2', 'linear_fc2')):
        for suffix in ('weight', 'bias'):
            key = f'{hf_name}.{suffix}'
            if key in parts['projector']:
                out[f'vision_projection.encoder.{mc_name}.{suffix}'] = parts['projector'][key]
    return out


_PARTS = ('language_model.', 'vision_model.', 'vision_projection.')


def _by_part(sd: StateDict) -> Dict[str, StateDict]:
    """{part prefix: {inner key: tensor}}; the projector's `encoder.` becomes `mlp.` so that the
    GPT split rules (fc1 column-, fc2 row-parallel) apply to it."""
    parts: Dict[str, StateDict] = {p: {} for p in _PARTS}
    for key, value in sd.items():
        part = next(p for p in _PARTS if key.startswith(p))
        inner = key[len(part) :]
        if part == 'vision_projection.':
            inner = 'mlp.' + inner[len('encoder.') :]
        parts[part][inner] = value
    return parts


def _join(part: str, inner: str) -> str:
    if part == 'vision_projection.':
        inner = 'encoder.' + inner[len('mlp.') :]
    return part + inner


def split_llava_state_dict_for_tensor_parallel(full: StateDict, configs, tp_size: int):
    """A full LLaVAModel state dict -> `tp_size` per-rank ones. `configs`: the language, vision
    and projection TransformerConfigs (each part is split with its own, e.g. a gated LM fc1 and
    plain ViT / projector fc1)."""
    out = [{} for _ in range(tp_size)]
    for part, config in zip(_PARTS, configs):
        shards = split_state_dict_for_tensor_parallel(_by_part(full)[part], config, tp_size)
        for rank, shard in enumerate(shards):
            out[rank].update({_join(part, k): v for k, v in shard.items()})
    return out


def merge_llava_tensor_parallel_state_dicts(shards, configs) -> StateDict:
    """Inverse of `split_llava_state_dict_for_tensor_parallel`."""
    out: StateDict = {}
    by_rank = [_by_part(s) for s in shards]
    for part, config in zip(_PARTS, configs):
        merged = merge_tensor_parallel_state_dicts([r[part] for r in by_rank], config)
        out.update({_join(part, k): v for k, v in merged.items()})
    return out


def mcore_to_hf_llava_state_dict(
    mc_sd: StateDict,
    language_config,
    vision_num_heads: int,
    true_vocab_size: Optional[int] = None,
) -> StateDict:
    """A full LLaVAModel state dict -> `LlavaForConditionalGeneration` weights (transformers 5.x
    keys). The vision tower gets the layers the model has (a model built for
    `vision_feature_layer=-2` exports a tower one layer shorter, to be read with -1); CLIP's
    pooler-only `post_layernorm` is written as identity."""
    parts = _by_part({k: v for k, v in mc_sd.items() if isinstance(v, torch.Tensor)})
    out: StateDict = {}
    lm = mcore_to_llama_hf_state_dict(parts['language_model.'], language_config, true_vocab_size)
    for key, value in lm.items():
        out[key if key.startswith('lm_head.') else 'model.language_' + key] = value
    vision = mcore_to_hf_vision_state_dict(parts['vision_model.'], vision_num_heads)
    out.update({f'model.vision_tower.{k}': v for k, v in vision.items()})
    for hf_name, mc_name in (('linear_1', 'linear_fc1'), ('linear_2', 'linear_fc2')):
        for suffix in ('weight', 'bias'):
            key = f'mlp.{mc_name}.{suffix}'
            if key in parts['vision_projection.']:
                value = parts['vision_projection.'][key]
                out[f'model.multi_modal_projector.{hf_name}.{suffix}'] = value
    return out
