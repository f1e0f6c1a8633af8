"""`convert.py --model-type mamba`: MambaModel checkpoints (pretrain_mamba.py) through the hf
and mcore plugins (Megatron's own convert.py has no Mamba support; its hybrid_conversion.py
handles the legacy format only).

    python tools/checkpoint/convert.py --model-type mamba --loader hf --saver mcore \\
        --load-dir hf_nemotron_h --save-dir ckpt_tp2 --target-tensor-parallel-size 2
    python tools/checkpoint/convert.py --model-type mamba --loader mcore --saver hf \\
        --load-dir ckpt_tp2 --save-dir hf_back

Messages after the metadata: "embeddings" ({"word embeddings"}), one "mamba layer N" per layer
whatever its kind (its layer-local megatron-core tensors, full size), "final norm"
({"weight"}), "output layer" ({"weight"}, untied models only), then "done". The metadata
carries the source's args and the Hugging Face config (a dict) when the source is Hugging Face.
"""

import contextlib
import io
import os
import types

import torch
import utils

utils.add_megatron_path()

from megatron.core.models.mamba import hf_weight_mapping as hfm  # noqa: E402
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion_mamba as ccm  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint as hfc  # noqa: E402

MODEL_TYPE = 'mamba'


def is_mamba(args_or_md) -> bool:
    return getattr(args_or_md, 'model_type', None) == MODEL_TYPE


# ---------------------------------------------------------------------------------------------
# args, pattern and mapping config


def pattern_of_args(margs) -> str:
    """The hybrid layer pattern a pretrain_mamba.py run builds."""
    with contextlib.redirect_stdout(io.StringIO()):
        return ''.join(
            allocate_layers(
                margs.num_layers,
                getattr(margs, 'hybrid_attention_ratio', 0.0) or 0.0,
                getattr(margs, 'hybrid_mlp_ratio', 0.0) or 0.0,
                getattr(margs, 'hybrid_override_pattern', None),
            )
        )


def mapping_config(margs) -> types.SimpleNamespace:
    """The attention sizes hf_weight_mapping needs, from the args."""
    heads = margs.num_attention_heads
    groups = margs.num_query_groups if getattr(margs, 'group_query_attention', False) else heads
    return types.SimpleNamespace(
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=margs.kv_channels or margs.hidden_size // heads,
    )


def args_list_from_hf(hf_config, tokenizer_type: str, seq_length=None, **files):
    """pretrain_mamba.py flags that build a Hugging Face Mamba2 / NemotronH architecture."""
    kw = hfm.mamba_config_kwargs(hf_config)
    c, m = kw['config'], kw['model']
    max_pos = m['max_sequence_length']
    args = [
        '--num-layers', c['num_layers'], '--hidden-size', c['hidden_size'],
        '--num-attention-heads', c['num_attention_heads'],
        '--hybrid-override-pattern', m['hybrid_override_pattern'],
        '--mamba-state-dim', c['mamba_state_dim'], '--mamba-head-dim', c['mamba_head_dim'],
        '--mamba-num-groups', c['mamba_num_groups'], '--mamba-num-heads', c['mamba_num_heads'],
        '--normalization', 'RMSNorm', '--norm-epsilon', c['layernorm_epsilon'],
        '--disable-bias-linear', '--no-bias-gelu-fusion', '--position-embedding-type', 'none',
        '--max-position-embeddings', max_pos, '--seq-length', seq_length or min(max_pos, 4096),
        '--hidden-dropout', 0.0, '--attention-dropout', 0.0, '--is-hybrid-model',
        '--tokenizer-type', tokenizer_type, '--micro-batch-size', 1, '--mock-data',
    ]  # fmt: skip
    if 'kv_channels' in c:
        args += ['--kv-channels', c['kv_channels'], '--ffn-hidden-size', c['ffn_hidden_size']]
        if c['num_query_groups'] != c['num_attention_heads']:
            args += ['--group-query-attention', '--num-query-groups', c['num_query_groups']]
        if hf_config.mlp_hidden_act == 'relu2':
            args.append('--squared-relu')
    if not m['share_embeddings_and_output_weights']:
        args.append('--untie-embeddings-and-output-weights')
    for flag, value in files.items():
        if value is not None:
            args += [f'--{flag.replace("_", "-")}', value]
    return [str(a) for a in args]


def megatron_args_from_hf(hf_config, tokenizer_type: str, **kwargs):
    """Our validated args namespace for a Hugging Face Mamba2 / NemotronH config (TP = PP = 1)."""
    from megatron.training.arguments import parse_args
    from megatron.training.validation.argument_validation import validate_args

    args = parse_args(args_list=args_list_from_hf(hf_config, tokenizer_type, **kwargs))
    args.world_size, args.rank = 1, 0
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args)
    args.padded_vocab_size = hf_config.vocab_size
    return args


def hf_config_from_args(margs, vocab_size: int, dtype: torch.dtype) -> dict:
    """config.json of the Hugging Face model of our args: Mamba2 for a pure Mamba stack, else
    NemotronH."""
    pattern = pattern_of_args(margs)
    heads = margs.mamba_num_heads or 2 * margs.hidden_size // margs.mamba_head_dim
    common = dict(
        vocab_size=vocab_size,
        hidden_size=margs.hidden_size,
        n_groups=margs.mamba_num_groups,
        conv_kernel=4,
        layer_norm_epsilon=margs.norm_epsilon,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=not margs.untie_embeddings_and_output_weights,
        dtype=str(dtype).replace('torch.', ''),
    )
    if set(pattern) == {Symbols.MAMBA}:
        return dict(
            common,
            model_type='mamba2',
            architectures=['Mamba2ForCausalLM'],
            num_hidden_layers=len(pattern),
            num_heads=heads,
            head_dim=margs.mamba_head_dim,
            state_size=margs.mamba_state_dim,
            expand=heads * margs.mamba_head_dim // margs.hidden_size,
            residual_in_fp32=False,
        )
    if not margs.squared_relu or margs.swiglu:
        raise ValueError(
            'NemotronH export needs the squared-ReLU non-gated MLP (--squared-relu, no --swiglu)'
        )
    m = mapping_config(margs)
    return dict(
        common,
        model_type='nemotron_h',
        architectures=['NemotronHForCausalLM'],
        layers_block_type=[hfm.HF_BLOCK_TYPES[s] for s in pattern],
        mamba_num_heads=heads,
        mamba_head_dim=margs.mamba_head_dim,
        ssm_state_size=margs.mamba_state_dim,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        head_dim=m.kv_channels,
        intermediate_size=margs.ffn_hidden_size,
        mlp_hidden_act='relu2',
        attention_bias=False,
        mlp_bias=False,
        max_position_embeddings=margs.max_position_embeddings,
    )


def _hf_config_object(config: dict):
    from transformers import AutoConfig

    config = dict(config)
    return AutoConfig.for_model(config.pop('model_type'), **config)


# ---------------------------------------------------------------------------------------------
# messages


def send_full_model(queue, md, full):
    queue.put(md)
    layers, rest = cc.split_chunk_by_layer(full, 0)
    utils.queue_put(
        queue, 'embeddings', {'word embeddings': rest.pop('embedding.word_embeddings.weight')}
    )
    for index, layer in layers.items():
        utils.queue_put(queue, f'mamba layer {index}', dict(layer))
    utils.queue_put(queue, 'final norm', {'weight': rest.pop('decoder.final_norm.weight')})
    if 'output_layer.weight' in rest:
        utils.queue_put(queue, 'output layer', {'weight': rest.pop('output_layer.weight')})
    utils.queue_put(queue, 'done')


def receive_full_model(queue, args):
    """(metadata, full state dict with global layer numbers)."""
    md = utils.queue_get(queue)
    if md == 'exit':
        raise SystemExit(1)
    full = {}
    msg = utils.queue_get(queue, 'embeddings', args.checking)
    full['embedding.word_embeddings.weight'] = msg.pop('word embeddings')
    utils.check_message(msg, args.checking)
    for index in range(md.num_layers):
        msg = utils.queue_get(queue, f'mamba layer {index}', args.checking)
        msg.pop('name')
        full.update({f'decoder.layers.{index}.{k}': v for k, v in msg.items()})
    msg = utils.queue_get(queue, 'final norm', args.checking)
    full['decoder.final_norm.weight'] = msg.pop('weight')
    utils.check_message(msg, args.checking)
    if md.output_layer:
        msg = utils.queue_get(queue, 'output layer', args.checking)
        full['output_layer.weight'] = msg.pop('weight')
        utils.check_message(msg, args.checking)
    done = utils.queue_get(queue)
    if done != 'done':
        print(f'ERROR: got some more data ({done}) but was expecting to be done')
        raise SystemExit(1)
    return md, full


def _metadata(margs, iteration, true_vocab_size, tp, pp, hf_config=None):
    return types.SimpleNamespace(
        model_type=MODEL_TYPE,
        num_layers=margs.num_layers,
        hidden_size=margs.hidden_size,
        num_attention_heads=margs.num_attention_heads,
        iteration=iteration,
        output_layer=bool(margs.untie_embeddings_and_output_weights),
        params_dtype=margs.params_dtype,
        previous_tensor_parallel_size=tp,
        previous_pipeline_parallel_size=pp,
        true_vocab_size=true_vocab_size,
        make_vocab_size_divisible_by=margs.make_vocab_size_divisible_by,
        checkpoint_args=margs,
        hf_config=hf_config,
    )


# ---------------------------------------------------------------------------------------------
# loaders


def hf_metadata(args):
    """(HF config object, metadata) of --load-dir; every check runs here."""
    import loader_hf
    from transformers import AutoConfig

    hfc.check_hf_files(args.load_dir)
    config_dict = hfc.read_hf_config(args.load_dir)
    if config_dict.get('model_type') not in ('mamba2', 'nemotron_h'):
        raise ValueError(
            f'--model-type mamba: {args.load_dir} holds a {config_dict.get("model_type")!r} '
            f'model, not mamba2 or nemotron_h'
        )
    hf_config = AutoConfig.from_pretrained(args.load_dir)
    kind, files = loader_hf.tokenizer_args(args.load_dir, 'mamba', args.hf_tokenizer_type)
    margs = megatron_args_from_hf(hf_config, kind, seq_length=args.seq_length, **files)
    margs.params_dtype = loader_hf._config_dtype(config_dict)
    md = _metadata(margs, 1, hf_config.vocab_size, 1, 1, hf_config=config_dict)
    return hf_config, md


def load_hf(queue, args):
    hf_config, md = hf_metadata(args)
    margs = md.checkpoint_args
    full = hfm.hf_to_mcore_state_dict(
        hfc.load_hf_state_dict(args.load_dir),
        mapping_config(margs),
        pattern_of_args(margs),
        tied=not md.output_layer,
    )
    send_full_model(queue, md, full)


def mcore_metadata(args):
    reader = ccm.MambaCheckpointReader(args.load_dir)
    margs = reader.args
    if not getattr(margs, 'is_hybrid_model', False):
        raise ValueError(
            f'--model-type mamba: {args.load_dir} was not written by pretrain_mamba.py '
            f'(its args have no is_hybrid_model)'
        )
    true_vocab = cc.recorded_true_vocab_size(margs)
    md = _metadata(margs, reader.iteration, true_vocab, reader.tp, reader.pp)
    return reader, md


def load_mcore(queue, args):
    reader, md = mcore_metadata(args)
    full, _ = ccm.full_state_dict(reader)
    if not md.output_layer:
        full.pop('output_layer.weight', None)  # the last stage's copy of tied embeddings
    send_full_model(queue, md, full)


# ---------------------------------------------------------------------------------------------
# savers


def check_mcore_target(args, md):
    import saver_mcore

    tp, pp = saver_mcore.target_sizes(args, md)
    if md.num_layers % pp:
        raise ValueError(
            f'--target-pipeline-parallel-size {pp} does not divide the number of layers '
            f'({md.num_layers})'
        )
    from megatron.core.ssm.mamba_mixer import check_mamba_dims

    margs = md.checkpoint_args
    config = types.SimpleNamespace(
        mamba_head_dim=margs.mamba_head_dim,
        mamba_num_heads=margs.mamba_num_heads,
        mamba_num_groups=margs.mamba_num_groups,
        mamba_state_dim=margs.mamba_state_dim,
    )
    try:
        check_mamba_dims(config, margs.hidden_size, tp)
    except ValueError as exc:
        raise ValueError(f'--target-tensor-parallel-size {tp}: {exc}') from None
    if Symbols.ATTENTION in pattern_of_args(margs):
        m = mapping_config(margs)
        if m.num_attention_heads % tp or m.num_query_groups % tp:
            raise ValueError(
                f'--target-tensor-parallel-size {tp} does not divide the attention heads '
                f'({m.num_attention_heads}) and query groups ({m.num_query_groups})'
            )
    return tp, pp


def save_mcore(queue, args):
    md, full = receive_full_model(queue, args)
    tp, pp = check_mcore_target(args, md)
    word = full['embedding.word_embeddings.weight']
    padded = word.shape[0]
    if md.true_vocab_size is not None:
        padded = cc.padded_vocab_size(
            md.true_vocab_size, md.make_vocab_size_divisible_by or 128, tp
        )
    for name in ('embedding.word_embeddings.weight', 'output_layer.weight'):
        if name in full:
            full[name] = cc.repad_vocab(full[name], padded)
    margs = cc.args_for_target(
        md.checkpoint_args, tp, pp, padded, args.save_dir, md.iteration, md.true_vocab_size
    )
    writer = ccm.MambaCheckpointWriter(
        args.save_dir, md.iteration, tp, pp, margs, ccm.swiglu_of(margs).gated_linear_unit
    )
    for pp_rank, (stage, _) in enumerate(ccm.stage_state_dicts(full, md.num_layers, pp)):
        writer.write_stage(pp_rank, stage, has_output_layer='output_layer.weight' in stage)
        print(f'saved stage {pp_rank + 1}/{pp} at TP{tp}', flush=True)
    writer.finish()


def save_hf(queue, args):
    md, full = receive_full_model(queue, args)
    margs = md.checkpoint_args
    true_vocab = md.true_vocab_size or full['embedding.word_embeddings.weight'].shape[0]
    config = md.hf_config or hf_config_from_args(margs, true_vocab, md.params_dtype)
    config = dict(config, vocab_size=true_vocab)
    hf_sd = hfm.mcore_to_hf_state_dict(
        full,
        mapping_config(margs),
        pattern_of_args(margs),
        prefix='backbone.',
        true_vocab_size=true_vocab,
    )
    if config.get('tie_word_embeddings', False):
        hf_sd.pop('lm_head.weight')
    _hf_config_object(config)  # refuses a config transformers cannot build, before writing
    hfc.save_hf_dir(args.save_dir, config, hf_sd, args.hf_tokenizer_dir)
    print(f'saved {os.path.join(args.save_dir, hfc.SAFETENSORS_NAME)}', flush=True)
