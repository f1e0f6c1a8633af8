"""Helpers of the vision encoder tests: tiny HF CLIP / SigLIP towers, the matching CLIPViTModel,
and TP gathering of its parameters. Imported inside spawned ranks (tests.unit_tests.dist_utils)."""

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.hf_weight_mapping import (
    merge_tensor_parallel_state_dicts,
    split_state_dict_for_tensor_parallel,
    tensor_parallel_partition_dim,
)
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import fast_gelu, quick_gelu
from tests.unit_tests.models.gpt_test_utils import _all_gather_tp

HIDDEN, HEADS, FFN, LAYERS, IMG, PATCH = 32, 4, 64, 2, 16, 4

_ACTIVATIONS = {'quick_gelu': quick_gelu, 'gelu_pytorch_tanh': fast_gelu}


def hf_tower(subtype: str, seed: int = 1):
    """A tiny random HF vision tower (eager attention, every weight randomised)."""
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        image_size=IMG,
        patch_size=PATCH,
        attention_dropout=0.0,
        attn_implementation='eager',
    )
    if subtype == 'clip':
        model = CLIPVisionModel(CLIPVisionConfig(hidden_act='quick_gelu', **common))
    else:
        model = SiglipVisionModel(SiglipVisionConfig(hidden_act='gelu_pytorch_tanh', **common))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            is_norm_weight = p.dim() == 1 and 'norm' in name and name.endswith('weight')
            p.copy_(1.0 + noise if is_norm_weight else noise)
    return model.eval()


def vit_config(subtype: str, **overrides) -> TransformerConfig:
    """The TransformerConfig of the tiny tower for the current parallel state."""
    kw = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        add_bias_linear=True,
        add_qkv_bias=True,
        activation_func=_ACTIVATIONS['quick_gelu' if subtype == 'clip' else 'gelu_pytorch_tanh'],
        bias_activation_fusion=False,
        layernorm_epsilon=1e-5 if subtype == 'clip' else 1e-6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_vit(subtype: str, class_token_len: int = 1, **config_overrides):
    config = vit_config(subtype, **config_overrides)
    model = CLIPViTModel(
        config,
        get_vit_layer_with_local_spec(),
        add_class_token=subtype == 'clip',
        class_token_len=class_token_len,
        patch_dim=PATCH,
        img_h=IMG,
        img_w=IMG,
        model_subtype=subtype,
    )
    return model, config


def load_full(model, config, full_sd):
    """Load a TP=1 state dict into this rank's (possibly TP-sharded) model."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = split_state_dict_for_tensor_parallel(full_sd, config, tp)[rank]
    missing, unexpected = model.load_state_dict(shard, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith('_extra_state') for k in missing), missing


def gather_full(named, config):
    """This rank's TP shards of {name: tensor} -> the full TP=1 dict."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    shards = [dict() for _ in range(tp)]
    for name, t in named.items():
        pieces = [t] * tp if tensor_parallel_partition_dim(name) is None else _all_gather_tp(t)
        for r in range(tp):
            shards[r][name] = pieces[r].detach()
    return merge_tensor_parallel_state_dicts(shards, config)


def images(batch: int = 2, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, IMG, IMG, generator=g)
