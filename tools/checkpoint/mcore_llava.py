"""--model-type LLAVA: Hugging Face `LlavaForConditionalGeneration` (a Llama-family language model
with a CLIP vision tower) <-> the `LLaVAModel` checkpoints pretrain_vlm.py writes and loads, at
any tensor-parallel size (not a plugin: loader_hf, saver_mcore, loader_mcore and saver_hf call
it).

The whole model travels as one state dict, so the protocol is short:

    metadata              model_type 'LLAVA', checkpoint_args (pretrain_vlm.py's args for the
                          whole architecture, with the Hugging Face config as `hf_llava_config`),
                          true_vocab_size
    "llava model"         "state dict": the full (TP = PP = 1) LLaVAModel state dict, the
                          vocabulary at its true size
    "done"

The weights are mapped by megatron.core.models.multimodal.hf_weight_mapping: the language model
as a Llama (fused per-group QKV, fused gate/up fc1), the tower as a CLIP ViT, the projector's
linear_1 / linear_2 as vision_projection.encoder.linear_fc1 / linear_fc2. Each part is split over
TP with its own rules (the language model's fc1 is gated, the ViT's and projector's are not).

Hugging Face's `vision_feature_layer` (-2 for LLaVA-1.5) selects a hidden state before the
tower's last layer; LLaVAModel builds only the layers up to it, so the checkpoint records that
many (`--vision-num-layers`) and an export writes a tower of that depth read with -1.

Pipeline stages (pretrain_vlm.py at PP > 1): stage 0 holds the vision tower, the projector, the
word (and position) embeddings and the first language-model layers, the last stage the final
norm and the output layer; each stage numbers its decoder layers from 0. A source checkpoint's
stages are renumbered by the layers of the stages before them; a target's split is even.
"""

import argparse
import contextlib
import io
import json
import os
import re
import types

import torch
import utils

utils.add_megatron_path()

import pretrain_vlm  # noqa: E402
from megatron.core.models.multimodal import hf_weight_mapping as lmap  # noqa: E402
from megatron.core.models.multimodal.llava_model import (  # noqa: E402
    vision_layers_for_feature_layer,
)
from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint as hfc  # noqa: E402

_ARCHITECTURE = 'LlavaForConditionalGeneration'
#: Parallel linears of a LLaVAModel: each lists an `_extra_state` entry (None) in its state dict.
_EXTRA_STATE_MODULES = ('linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2', 'output_layer')
_WORD = 'language_model.embedding.word_embeddings.weight'
_OUTPUT = 'language_model.output_layer.weight'


def is_llava_keys(keys) -> bool:
    """Whether a checkpoint's model keys are a LLaVAModel's."""
    return any(k.startswith('language_model.') for k in keys)


def _full_hf_config(load_dir: str) -> dict:
    """config.json with transformers' defaults filled in (hub LLaVA configs list only what
    differs from them), when transformers is installed."""
    config = hfc.read_hf_config(load_dir)
    if config.get('model_type') != 'llava':
        raise ValueError(
            f'--model-type LLAVA: {os.path.join(load_dir, hfc.CONFIG_NAME)} has model_type '
            f'{config.get("model_type")!r}; expected \'llava\' (a {_ARCHITECTURE})'
        )
    try:
        from transformers import AutoConfig
    except ImportError:
        return config
    with contextlib.redirect_stderr(io.StringIO()):
        full = AutoConfig.from_pretrained(load_dir).to_dict()
    return json.loads(json.dumps(full, default=str))


def _check_hf_config(config: dict) -> None:
    """What LLaVAModel cannot express, refused in one line each."""
    vision = config['vision_config']
    acts = pretrain_vlm.VISION_ACTIVATIONS
    checks = (
        (vision.get('model_type') == 'clip_vision_model', f'vision_config model_type '
         f'{vision.get("model_type")!r} (only a CLIP tower, clip_vision_model)'),
        (isinstance(config.get('vision_feature_layer'), int), f'vision_feature_layer '
         f'{config.get("vision_feature_layer")!r} (a list of layers; only one layer)'),
        (config.get('vision_feature_select_strategy') in ('default', 'full'),
         f'vision_feature_select_strategy {config.get("vision_feature_select_strategy")!r}'),
        (vision.get('hidden_act') in acts, f'vision hidden_act {vision.get("hidden_act")!r} '
         f'(supported: {", ".join(sorted(acts))})'),
        (config.get('projector_hidden_act') in acts, f'projector_hidden_act '
         f'{config.get("projector_hidden_act")!r} (supported: {", ".join(sorted(acts))})'),
        (config.get('multimodal_projector_bias', True), 'multimodal_projector_bias false'),
        (vision.get('num_channels', 3) == 3, f'num_channels {vision.get("num_channels")}'),
    )  # fmt: skip
    for ok, what in checks:
        if not ok:
            raise ValueError(f'--model-type LLAVA: Hugging Face config: {what} is not supported')


def _vlm_flags(config: dict) -> list:
    """pretrain_vlm.py's flags for the vision tower, the projector and the image geometry."""
    v = config['vision_config']
    layers = vision_layers_for_feature_layer(v['num_hidden_layers'], config['vision_feature_layer'])
    flags = [
        '--vision-num-layers', layers, '--vision-hidden-size', v['hidden_size'],
        '--vision-ffn-hidden-size', v['intermediate_size'],
        '--vision-num-attention-heads', v['num_attention_heads'],
        '--vision-norm-epsilon', v.get('layer_norm_eps', 1e-5),
        '--vision-activation', v['hidden_act'],
        '--vision-projection-activation', config['projector_hidden_act'],
        '--img-h', v['image_size'], '--img-w', v['image_size'], '--patch-dim', v['patch_size'],
    ]  # fmt: skip
    if config['vision_feature_select_strategy'] == 'default':
        flags.append('--disable-vision-class-token')
    return [str(f) for f in flags]


def _parse(args_list, vocab_size: int) -> argparse.Namespace:
    """pretrain_vlm.py's validated args namespace at TP = PP = 1."""
    from megatron.training.arguments import parse_args
    from megatron.training.validation.argument_validation import validate_args

    args = parse_args(extra_args_provider=pretrain_vlm.add_vlm_extra_args, args_list=args_list)
    args.world_size, args.rank = 1, 0
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        validate_args(args)
    pretrain_vlm.check_vlm_args(args)
    args.padded_vocab_size = vocab_size
    return args


def _metadata(margs, iteration: int, tp: int, true_vocab, pp: int = 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        model_type='LLAVA',
        num_layers=margs.num_layers,
        hidden_size=margs.hidden_size,
        num_attention_heads=margs.num_attention_heads,
        iteration=iteration,
        params_dtype=margs.params_dtype,
        swiglu=margs.swiglu,
        true_vocab_size=true_vocab,
        previous_tensor_parallel_size=tp,
        previous_pipeline_parallel_size=pp,
        checkpoint_args=margs,
    )


def _lm_core(margs) -> types.SimpleNamespace:
    """What the Llama mapping needs of the language model's config."""
    heads = margs.num_attention_heads
    return types.SimpleNamespace(
        num_attention_heads=heads,
        num_query_groups=margs.num_query_groups if margs.group_query_attention else heads,
        kv_channels=margs.kv_channels or margs.hidden_size // heads,
        ffn_hidden_size=margs.ffn_hidden_size,
    )


def _vision_heads(margs) -> int:
    return margs.vision_num_attention_heads or margs.num_attention_heads


def _split_configs(margs):
    """(language, vision, projection) split rules: only a part built with the LM's layer
    settings has the LM's gated fc1."""
    gated = bool(margs.swiglu)
    return (
        types.SimpleNamespace(gated_linear_unit=gated),
        types.SimpleNamespace(gated_linear_unit=gated and margs.vision_activation is None),
        types.SimpleNamespace(
            gated_linear_unit=gated and margs.vision_projection_activation is None
        ),
    )


def _send(queue, md, full):
    utils.send_whole_model(queue, md, 'llava model', full)


def _receive(queue, args):
    return utils.receive_whole_model(queue, 'llava model', args.checking)


# ---------------------------------------------------------------------------------------------
# Hugging Face directory -> queue (loader_hf)


def hf_metadata(args, tokenizer_args):
    """Every check of the source (config, files, tokenizer) before any tensor is read."""
    config = _full_hf_config(args.load_dir)
    _check_hf_config(config)
    hfc.check_hf_files(args.load_dir)
    text = config['text_config']
    family = hfc.hf_family(text)
    if family != 'llama':
        raise ValueError(
            f'--model-type LLAVA: text_config model_type {text.get("model_type")!r}: only a '
            f'Llama-family language model'
        )
    vocab = hfc.hf_config_namespace(text).vocab_size
    kind, files = tokenizer_args(args.load_dir, family, args.hf_tokenizer_type)
    lm_flags = hfc.megatron_args_list(text, kind, seq_length=args.seq_length, **files)
    if kind == 'NullTokenizer':  # its ids are 0..vocab_size, the last one its eod
        lm_flags += ['--vocab-size', str(vocab - 1)]
    margs = _parse(lm_flags + _vlm_flags(config), vocab)
    margs.params_dtype = {'float16': torch.float16, 'bfloat16': torch.bfloat16}.get(
        config.get('dtype') or config.get('torch_dtype'), torch.float32
    )
    margs.hf_llava_config = config
    return _metadata(margs, iteration=1, tp=1, true_vocab=vocab)


def load_hf(queue, args, tokenizer_args):
    md = hf_metadata(args, tokenizer_args)
    margs = md.checkpoint_args
    hf_sd = hfc.load_hf_state_dict(args.load_dir)
    try:
        full = lmap.llava_hf_to_mcore_state_dict(
            hf_sd, _lm_core(margs), _vision_heads(margs), margs.vision_num_layers
        )
    except KeyError as exc:
        raise ValueError(
            f'--load-dir {args.load_dir}: the {_ARCHITECTURE} weights lack {exc.args[0]} (as the '
            f'language model or vision tower names it)'
        ) from None
    missing = [
        f'multi_modal_projector.{k}'
        for k in ('linear_1.weight', 'linear_1.bias', 'linear_2.weight', 'linear_2.bias')
        if f'vision_projection.encoder.{k.replace("linear_", "linear_fc")}' not in full
    ]
    if missing:
        raise ValueError(f'--load-dir {args.load_dir}: the {_ARCHITECTURE} weights lack {missing}')
    _send(queue, md, full)


# ---------------------------------------------------------------------------------------------
# our checkpoint -> queue (loader_mcore)


def mcore_metadata(args):
    reader = cc.CheckpointReader(args.load_dir)
    if not is_llava_keys(reader.model_keys):
        raise ValueError(f'--model-type LLAVA, but {args.load_dir} holds no LLaVA model')
    margs = reader.args
    true_vocab = cc.recorded_true_vocab_size(margs)
    return reader, _metadata(margs, reader.iteration, reader.tp, true_vocab, reader.pp)


#: A language-model decoder layer's key: (prefix, stage-local index, rest).
_LAYER_KEY = re.compile(r'^(language_model\.decoder\.layers\.)(\d+)(\..*)$')


def _renumber_layers(state: dict, offset: int) -> dict:
    """The decoder layer indices of `state` shifted by `offset` (other keys kept)."""
    out = {}
    for key, value in state.items():
        m = _LAYER_KEY.match(key)
        out[f'{m[1]}{int(m[2]) + offset}{m[3]}' if m else key] = value
    return out


def load_mcore(queue, args):
    reader, md = mcore_metadata(args)
    full, offset = {}, 0
    for p in range(reader.pp):
        files = [cc.torch_load_weights_only(reader.rank_file(t, p)) for t in range(reader.tp)]
        shards = [f['model'] for f in files]
        stage = lmap.merge_llava_tensor_parallel_state_dicts(
            shards, _split_configs(md.checkpoint_args)
        )
        stage = {
            k: v
            for k, v in stage.items()
            if isinstance(v, torch.Tensor) and '_extra_state' not in k
        }
        layers = {int(m[2]) for m in map(_LAYER_KEY.match, stage) if m}
        full.update(_renumber_layers(stage, offset))
        offset += len(layers)
    if md.true_vocab_size is not None:
        for key in (_WORD, _OUTPUT):
            if key in full:
                full[key] = full[key][: md.true_vocab_size].clone()
    _send(queue, md, full)


# ---------------------------------------------------------------------------------------------
# queue -> our checkpoint (saver_mcore) / Hugging Face directory (saver_hf)


def check_target(md, tp: int, pp: int) -> None:
    """The target layout fits every part (ValueError naming the flag and the numbers)."""
    m = md.checkpoint_args
    if m.num_layers % pp:
        raise ValueError(
            f"--target-pipeline-parallel-size {pp} does not divide the language model's "
            f'{m.num_layers} layers (the vision tower stays whole on stage 0)'
        )
    lm = _lm_core(m)
    sizes = (
        ("language model's attention heads", lm.num_attention_heads),
        ("language model's query groups", lm.num_query_groups),
        ("language model's ffn_hidden_size", m.ffn_hidden_size),
        ("vision tower's attention heads", _vision_heads(m)),
        ("vision tower's ffn_hidden_size", m.vision_ffn_hidden_size or m.ffn_hidden_size),
        ("projector's inner size (the LM hidden size)", m.hidden_size),
    )
    if md.true_vocab_size is None:  # the table keeps its rows: they must split evenly
        sizes += (('vocabulary (unknown true size; padded rows)', m.padded_vocab_size),)
    for name, size in sizes:
        if size % tp:
            raise ValueError(
                f'--target-tensor-parallel-size {tp} does not divide the {name} {size}'
            )


class _LlavaWriter(cc.CheckpointWriter):
    """Megatron's file layout; each part split with its own rules, the `_extra_state` entries
    of the parallel linears listed as a LLaVAModel state dict lists them."""

    def __init__(self, *args, split_configs, **kwargs):
        super().__init__(*args, **kwargs)
        self.split_configs = split_configs

    def _split_consuming(self, stage):
        shards = lmap.split_llava_state_dict_for_tensor_parallel(stage, self.split_configs, self.tp)
        stage.clear()
        for shard in shards:
            for key in [k for k in shard if k.endswith('.weight')]:
                module = key[: -len('.weight')]
                if module.rsplit('.', 1)[-1] in _EXTRA_STATE_MODULES:
                    shard[f'{module}._extra_state'] = None
        return shards


def _stages(full: dict, num_layers: int, pp: int) -> list:
    """The full state dict as `pp` stage state dicts with stage-local layer numbers: the
    vision parts and the embedding on stage 0, the final norm and output layer on the last."""
    per_stage = num_layers // pp
    stages = [{} for _ in range(pp)]
    tail = ('language_model.decoder.final_layernorm.', 'language_model.output_layer.')
    for key in list(full):
        m = _LAYER_KEY.match(key)
        if m:
            p = int(m[2]) // per_stage
            stages[p][f'{m[1]}{int(m[2]) - p * per_stage}{m[3]}'] = full.pop(key)
        else:
            stages[-1 if key.startswith(tail) else 0][key] = full.pop(key)
    return stages


def save_mcore(queue, md, args, tp: int, pp: int = 1):
    full = _receive(queue, args)
    source = md.checkpoint_args
    padded = full[_WORD].shape[0]
    if md.true_vocab_size is not None:
        padded = cc.padded_vocab_size(md.true_vocab_size, source.make_vocab_size_divisible_by, tp)
    for key in (_WORD, _OUTPUT):
        if key in full:
            full[key] = cc.repad_vocab(full[key], padded)
    margs = cc.args_for_target(
        source, tp, pp, padded, args.save_dir, md.iteration, md.true_vocab_size
    )
    writer = _LlavaWriter(
        args.save_dir, md.iteration, tp, pp, margs, margs.swiglu,
        split_configs=_split_configs(margs),
    )  # fmt: skip
    for p, stage in enumerate(_stages(full, margs.num_layers, pp)):
        writer.write_stage(p, stage, has_output_layer=False)
    writer.finish()
    print(f'saver: wrote the LLaVA model at TP{tp} x PP{pp} to {args.save_dir}', flush=True)


def check_hf_target(md) -> None:
    """An export needs HF LLaVA's parts: a CLIP tower and projector, a Llama-family LM."""
    margs = md.checkpoint_args
    if margs.vision_activation is None or margs.vision_projection_activation is None:
        raise ValueError(
            'saver_hf: a LLaVA export needs a CLIP vision tower (--vision-activation) and Hugging '
            "Face's projector (--vision-projection-activation); this model copies the language "
            "model's layers into them"
        )
    if margs.img_h != margs.img_w:
        raise ValueError(
            f'saver_hf: CLIP takes square images, not --img-h {margs.img_h} --img-w {margs.img_w}'
        )
    if hfc.hf_family_of_args(margs) != 'llama':
        raise ValueError('saver_hf: a LLaVA export needs a Llama-family language model')


def hf_config_from_args(margs, vocab: int, dtype) -> dict:
    """LlavaConfig's config.json: the recorded Hugging Face config (if any), our architecture
    written over it."""
    recorded = dict(getattr(margs, 'hf_llava_config', None) or {})
    text = dict(recorded.get('text_config') or {})
    text.update(hfc.hf_config_from_args(margs, vocab, dtype))
    text.pop('architectures', None)
    drop_cls = margs.drop_vision_class_token or margs.disable_vision_class_token
    vision = dict(recorded.get('vision_config') or {})
    vision.update(
        model_type='clip_vision_model',
        hidden_size=margs.vision_hidden_size or margs.hidden_size,
        intermediate_size=margs.vision_ffn_hidden_size or margs.ffn_hidden_size,
        num_hidden_layers=margs.vision_num_layers or margs.encoder_num_layers,
        num_attention_heads=_vision_heads(margs),
        layer_norm_eps=margs.vision_norm_epsilon or margs.norm_epsilon,
        hidden_act=margs.vision_activation,
        image_size=margs.img_h,
        patch_size=margs.patch_dim,
        num_channels=3,
    )
    config = {k: v for k, v in recorded.items() if k not in ('text_config', 'vision_config')}
    config.update(
        architectures=[_ARCHITECTURE],
        model_type='llava',
        text_config=text,
        vision_config=vision,
        vision_feature_layer=-1,
        vision_feature_select_strategy='default' if drop_cls else 'full',
        projector_hidden_act=margs.vision_projection_activation,
        multimodal_projector_bias=True,
        image_seq_length=pretrain_vlm.image_token_count(margs),
        tie_word_embeddings=not margs.untie_embeddings_and_output_weights,
        dtype=text['torch_dtype'],
    )
    config.pop('torch_dtype', None)
    return config


def save_hf(queue, md, args):
    full = _receive(queue, args)
    margs = md.checkpoint_args
    vocab = md.true_vocab_size or full[_WORD].shape[0]
    state_dict = lmap.mcore_to_hf_llava_state_dict(
        full, _lm_core(margs), _vision_heads(margs), vocab
    )
    if not margs.untie_embeddings_and_output_weights:
        state_dict.pop('lm_head.weight', None)
    config = hf_config_from_args(margs, vocab, full[_WORD].dtype)
    hfc.save_hf_dir(args.save_dir, config, state_dict, args.hf_tokenizer_dir)
    print(f'saver: wrote {_ARCHITECTURE} to {args.save_dir}', flush=True)
