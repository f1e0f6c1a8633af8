"""--model-type VISION: a CLIP / SigLIP vision encoder (`CLIPViTModel`) between Hugging Face
`CLIPVisionModel` / `SiglipVisionModel` directories and this project's checkpoint layout at any
tensor-parallel size (not a plugin: loader_hf, saver_mcore, loader_mcore and saver_hf call it);
and a pretrain_vision_classify.py checkpoint trained with `--vit-layout hf` exported to
`ViTForImageClassification` (export only).

The encoder is one pipeline stage, so the protocol is short:

    metadata              model_type 'VISION', checkpoint_args (vision_model_type, geometry and
                          the Hugging Face config as `hf_vision_config`)
    "vision model"        "state dict": the full (TP = 1) CLIPViTModel state dict
    "done"

The weights are mapped by megatron.core.models.vision.hf_weight_mapping; the TP split is the GPT
one (linear_qkv / linear_fc1 along dim 0, linear_proj / linear_fc2 weights along dim 1; the
convolution, class token, positions and outer norms replicated).
"""

import argparse
import os
import types

import torch
import utils

utils.add_megatron_path()

from megatron.core.models.vision import hf_weight_mapping as vmap  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint as hfc  # noqa: E402

_HF_ARCHITECTURES = {'clip': 'CLIPVisionModel', 'siglip': 'SiglipVisionModel'}
_HF_MODEL_TYPES = {'clip_vision_model': 'clip', 'siglip_vision_model': 'siglip'}


def _subtype_of_hf(config: dict, path: str) -> str:
    subtype = _HF_MODEL_TYPES.get(config.get('model_type'))
    if subtype is None:
        raise ValueError(
            f'--model-type VISION: {path} has model_type {config.get("model_type")!r}; expected '
            f'one of {sorted(_HF_MODEL_TYPES)} (a CLIPVisionModel or SiglipVisionModel)'
        )
    return subtype


def _checkpoint_args(config: dict, subtype: str, dtype) -> argparse.Namespace:
    """Our args for the encoder (Megatron's flag names), with the HF config kept for export."""
    hidden, heads = config['hidden_size'], config['num_attention_heads']
    return argparse.Namespace(
        vision_model_type=subtype,
        num_layers=config['num_hidden_layers'],
        hidden_size=hidden,
        ffn_hidden_size=config['intermediate_size'],
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=hidden // heads,
        norm_epsilon=config.get('layer_norm_eps', 1e-5),
        normalization='LayerNorm',
        add_bias_linear=True,
        add_qkv_bias=True,
        swiglu=False,
        patch_dim=config['patch_size'],
        img_h=config['image_size'],
        img_w=config['image_size'],
        num_channels=config.get('num_channels', 3),
        params_dtype=dtype,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        hf_vision_config=dict(config),
    )


def _metadata(margs, iteration: int, tp: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        model_type='VISION',
        num_layers=margs.num_layers,
        hidden_size=margs.hidden_size,
        num_attention_heads=margs.num_attention_heads,
        iteration=iteration,
        params_dtype=margs.params_dtype,
        swiglu=False,
        previous_tensor_parallel_size=tp,
        previous_pipeline_parallel_size=1,
        checkpoint_args=margs,
    )


def _send(queue, md, full):
    utils.send_whole_model(queue, md, 'vision model', full)


def _receive(queue, args):
    return utils.receive_whole_model(queue, 'vision model', args.checking)


# ---------------------------------------------------------------------------------------------
# Hugging Face directory -> queue (loader_hf)


def hf_metadata(args):
    config = hfc.read_hf_config(args.load_dir)
    subtype = _subtype_of_hf(config, os.path.join(args.load_dir, hfc.CONFIG_NAME))
    hfc.check_hf_files(args.load_dir)
    dtype = {'float16': torch.float16, 'bfloat16': torch.bfloat16}.get(
        config.get('torch_dtype') or config.get('dtype'), torch.float32
    )
    return _metadata(_checkpoint_args(config, subtype, dtype), iteration=1, tp=1)


def load_hf(queue, args):
    md = hf_metadata(args)
    hf_sd = hfc.load_hf_state_dict(args.load_dir)
    full = vmap.hf_to_mcore_vision_state_dict(hf_sd, md.num_attention_heads)
    _send(queue, md, full)


# ---------------------------------------------------------------------------------------------
# our checkpoint -> queue (loader_mcore)


def is_vision_checkpoint(load_dir: str) -> bool:
    reader = cc.CheckpointReader(load_dir)
    return getattr(reader.args, 'vision_model_type', None) is not None


def _is_classifier(margs) -> bool:
    """A pretrain_vision_classify.py checkpoint (its args record the pretraining type)."""
    return bool(getattr(margs, 'vision_pretraining', False)) and (
        getattr(margs, 'vision_pretraining_type', None) == 'classify'
    )


def mcore_metadata(args):
    reader = cc.CheckpointReader(args.load_dir)
    if _is_classifier(reader.args):
        layout = getattr(reader.args, 'vit_layout', 'megatron')
        if layout != 'hf':
            raise ValueError(
                f'--model-type VISION: {args.load_dir} holds Megatron\'s ViT classifier '
                f'(--vit-layout {layout}: 8 class tokens, ln_pre and an MLP head), which '
                'ViTForImageClassification cannot hold; train with --vit-layout hf to export it'
            )
        md = _metadata(reader.args, reader.iteration, reader.tp)
        md.vit_classifier = True
        return reader, md
    if getattr(reader.args, 'vision_model_type', None) is None:
        raise ValueError(f'--model-type VISION, but {args.load_dir} holds no vision encoder')
    return reader, _metadata(reader.args, reader.iteration, reader.tp)


def load_mcore(queue, args):
    reader, md = mcore_metadata(args)
    ((_, chunk),), _ = reader.load_stage(0)
    full = {k: v for k, v in chunk.items() if isinstance(v, torch.Tensor)}
    _send(queue, md, full)


# ---------------------------------------------------------------------------------------------
# queue -> our checkpoint (saver_mcore) / Hugging Face directory (saver_hf)


def check_target(md, tp: int, pp: int) -> None:
    """The target layout fits the encoder (ValueError naming the flag and the numbers)."""
    if getattr(md, 'vit_classifier', False):
        raise ValueError(
            'a ViT classifier checkpoint converts to Hugging Face ViTForImageClassification '
            'only (--saver hf); pretrain_vision_classify.py resumes it at any TP itself'
        )
    if pp != 1:
        raise ValueError(
            f'--target-pipeline-parallel-size {pp}: a vision encoder is one pipeline stage (1)'
        )
    margs = md.checkpoint_args
    for name, size in (
        ('num_attention_heads', margs.num_attention_heads),
        ('ffn_hidden_size', margs.ffn_hidden_size),
    ):
        if size % tp:
            raise ValueError(
                f'--target-tensor-parallel-size {tp} does not divide the encoder\'s {name} {size}'
            )


def save_mcore(queue, md, args, tp: int):
    full = _receive(queue, args)
    margs = cc.args_for_target(md.checkpoint_args, tp, 1, 0, args.save_dir, md.iteration)
    writer = cc.CheckpointWriter(args.save_dir, md.iteration, tp, 1, margs, swiglu=False)
    writer.write_stage(0, full, has_output_layer=False)
    writer.finish()
    print(f'saver: wrote the vision encoder at TP{tp} to {args.save_dir}', flush=True)


def hf_config_from_args(margs, dtype) -> dict:
    """The HF vision config of an encoder: the recorded one, with our geometry written over it."""
    config = dict(getattr(margs, 'hf_vision_config', None) or {})
    subtype = margs.vision_model_type
    config.update(
        architectures=[_HF_ARCHITECTURES[subtype]],
        model_type=f'{subtype}_vision_model',
        hidden_size=margs.hidden_size,
        intermediate_size=margs.ffn_hidden_size,
        num_hidden_layers=margs.num_layers,
        num_attention_heads=margs.num_attention_heads,
        layer_norm_eps=margs.norm_epsilon,
        patch_size=margs.patch_dim,
        image_size=margs.img_h,
        num_channels=margs.num_channels,
        torch_dtype=str(dtype).replace('torch.', ''),
    )
    config.setdefault('hidden_act', 'quick_gelu' if subtype == 'clip' else 'gelu_pytorch_tanh')
    return config


def _hf_activation(margs) -> str:
    """The HF `hidden_act` of the classifier's MLP (the fused bias-GeLU is the tanh form)."""
    if getattr(margs, 'swiglu', False) or getattr(margs, 'squared_relu', False):
        raise ValueError(
            'ViTForImageClassification has a GeLU MLP; this checkpoint uses '
            f'{"--swiglu" if margs.swiglu else "--squared-relu"}'
        )
    if getattr(margs, 'openai_gelu', False):
        return 'gelu_new'
    return 'gelu_pytorch_tanh' if getattr(margs, 'bias_gelu_fusion', False) else 'gelu'


def check_hf_target(md) -> None:
    """Refuse, before any work, a classifier Hugging Face's ViT cannot hold."""
    if getattr(md, 'vit_classifier', False):
        _hf_activation(md.checkpoint_args)


def vit_classifier_hf_config(margs, dtype) -> dict:
    """ViTConfig of a `--vit-layout hf` classifier (no dropout: an exported model for use)."""
    labels = {str(i): f'LABEL_{i}' for i in range(margs.num_classes)}
    return dict(
        architectures=['ViTForImageClassification'],
        model_type='vit',
        hidden_size=margs.hidden_size,
        intermediate_size=margs.ffn_hidden_size,
        num_hidden_layers=margs.num_layers,
        num_attention_heads=margs.num_attention_heads,
        hidden_act=_hf_activation(margs),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        layer_norm_eps=margs.norm_epsilon,
        image_size=margs.img_h,
        patch_size=margs.patch_dim,
        num_channels=margs.num_channels,
        qkv_bias=True,
        id2label=labels,
        label2id={name: int(i) for i, name in labels.items()},
        torch_dtype=str(dtype).replace('torch.', ''),
    )


def save_hf(queue, md, args):
    full = _receive(queue, args)
    margs = md.checkpoint_args
    if getattr(md, 'vit_classifier', False):
        state_dict = vmap.mcore_to_hf_vit_classifier_state_dict(full, margs.num_attention_heads)
        config = vit_classifier_hf_config(margs, full['backbone.conv1.weight'].dtype)
        hfc.save_hf_dir(args.save_dir, config, state_dict)
        print(f'saver: wrote ViTForImageClassification to {args.save_dir}', flush=True)
        return
    state_dict = vmap.mcore_to_hf_vision_state_dict(full, margs.num_attention_heads)
    dtype = full['conv1.weight'].dtype
    config = hf_config_from_args(margs, dtype)
    hfc.save_hf_dir(args.save_dir, config, state_dict)
    print(f'saver: wrote {config["architectures"][0]} to {args.save_dir}', flush=True)
