"""Loader plugin: checkpoints this project writes (megatron-core GPT, BERT and T5 models, torch
format).

Any TP x PP (x EP for MoE models) layout, interleaved (virtual) pipelines, T5's encoder/decoder
pipeline split, with or without the distributed optimizer: only the weights are read (optimizer
state is not converted). The checkpoint's own args decide the architecture;
--position-embedding-type is overridden by them.
"""

import types

import mamba_checkpoint
import mcore_llava
import mcore_t5
import mcore_vision
import utils

utils.add_megatron_path()

from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion_moe as cc_moe  # noqa: E402

DEFAULT_TRANSFORMER_IMPL = 'transformer_engine'


def add_arguments(parser, default_impl=DEFAULT_TRANSFORMER_IMPL):
    group = parser.add_argument_group(title='Megatron loader')
    group.add_argument(
        '--true-vocab-size',
        type=int,
        default=None,
        help='Vocabulary size before padding: the embedding rows past it are dropped.',
    )
    group.add_argument(
        '--vocab-file',
        type=str,
        default=None,
        help='Vocabulary file whose size trims the padded embedding rows (instead of '
        '--true-vocab-size).',
    )
    group.add_argument(
        '--megatron-path',
        type=str,
        default=None,
        help='Repository root to import megatron from (default: this checkout).',
    )
    group.add_argument(
        '--position-embedding-type',
        type=str,
        default='learned_absolute',
        choices=['learned_absolute', 'rope'],
        help='Position embedding type (the checkpoint\'s own value wins).',
    )
    group.add_argument(
        '--loader-transformer-impl',
        default=default_impl,
        choices=['local', 'transformer_engine'],
        help='Which Transformer implementation the checkpoint was written with '
        '(both name the same layout here).',
    )


def _true_vocab_size(args, checkpoint_args):
    """--true-vocab-size, else the size of --vocab-file, else what the checkpoint records;
    checked against the checkpoint's table."""
    from_flag = args.true_vocab_size
    from_file = cc.true_vocab_size_from_file(args.vocab_file) if args.vocab_file else None
    if from_flag is not None and from_file is not None and from_flag != from_file:
        raise ValueError(
            f'--true-vocab-size ({from_flag}) disagrees with --vocab-file {args.vocab_file} '
            f'({from_file} entries)'
        )
    true_vocab = from_flag if from_flag is not None else from_file
    if true_vocab is None:
        true_vocab = cc.recorded_true_vocab_size(checkpoint_args)
    if true_vocab is None:
        return None
    padded = checkpoint_args.padded_vocab_size
    expected = cc.padded_vocab_size(
        true_vocab,
        checkpoint_args.make_vocab_size_divisible_by,
        checkpoint_args.tensor_model_parallel_size,
    )
    if expected != padded:
        flag = (
            '--true-vocab-size'
            if from_flag is not None
            else f'--vocab-file {args.vocab_file}'
            if from_file is not None
            else 'the checkpoint\'s recorded vocabulary'
        )
        raise ValueError(
            f'{flag} gives a vocabulary of {true_vocab}, which pads to {expected} at TP '
            f'{checkpoint_args.tensor_model_parallel_size} (--make-vocab-size-divisible-by '
            f'{checkpoint_args.make_vocab_size_divisible_by}), but the checkpoint\'s embedding '
            f'table has {padded} rows'
        )
    return true_vocab


def check_arguments(args):
    """Read the source's layout and args (no tensors); returns the metadata namespace."""
    if mamba_checkpoint.is_mamba(args):
        return mamba_checkpoint.mcore_metadata(args)[1]
    if args.model_type == 'LLAVA':
        return mcore_llava.mcore_metadata(args)[1]
    reader = cc_moe.MoECheckpointReader(args.load_dir)
    if mcore_llava.is_llava_keys(reader.model_keys):
        raise ValueError(f'{args.load_dir} holds a LLaVA model: pass --model-type LLAVA')
    if args.model_type == 'VISION':
        return mcore_vision.mcore_metadata(args)[1]
    if getattr(reader.args, 'vision_model_type', None) is not None:
        raise ValueError(f'{args.load_dir} holds a vision encoder: pass --model-type VISION')
    if reader.model_type != args.model_type:
        raise ValueError(
            f'--model-type {args.model_type}, but {args.load_dir} holds a {reader.model_type} model'
        )
    md = _metadata(args, reader, _true_vocab_size(args, reader.args))
    if md.model_type == 'T5':
        mcore_t5.check_source(md)
    return md


def _metadata(args, reader, true_vocab_size):
    margs = reader.args
    normalization = getattr(margs, 'normalization', 'LayerNorm')
    md = types.SimpleNamespace(
        model_type=args.model_type,
        num_layers=margs.num_layers,
        hidden_size=margs.hidden_size,
        seq_length=margs.seq_length,
        num_attention_heads=margs.num_attention_heads,
        max_position_embeddings=margs.max_position_embeddings,
        tokenizer_type=margs.tokenizer_type,
        iteration=reader.iteration,
        params_dtype=margs.params_dtype,
        bert_binary_head=getattr(margs, 'bert_binary_head', False),
        output_layer=margs.untie_embeddings_and_output_weights,
        position_embedding_type=margs.position_embedding_type,
        linear_bias=margs.add_bias_linear,
        norm_has_bias=normalization == 'LayerNorm',
        swiglu=margs.swiglu,
        previous_tensor_parallel_size=reader.tp,
        previous_pipeline_parallel_size=reader.pp,
        previous_expert_parallel_size=reader.ep,
        num_experts=getattr(margs, 'num_experts', None),
        true_vocab_size=true_vocab_size,
        make_vocab_size_divisible_by=margs.make_vocab_size_divisible_by,
        checkpoint_args=margs,
        consumed_train_samples=None,
        consumed_valid_samples=None,
        use_legacy_models=False,
    )
    if args.model_type == 'T5':
        vars(md).update(mcore_t5.metadata_fields(margs))
    return md


def _consumed(others, key):
    values = {o['args'].__dict__.get(key, 0) for o in others if 'args' in o}
    assert len(values) <= 1, f'{key} differs between tensor-parallel ranks: {values}'
    return values.pop() if values else 0


def _load(queue, args):
    reader = cc_moe.MoECheckpointReader(args.load_dir)
    md = _metadata(args, reader, _true_vocab_size(args, reader.args))
    stages = {}

    def stage(pp_rank):
        if pp_rank not in stages:
            print(
                f'loading pipeline stage {pp_rank + 1}/{reader.pp} '
                f'({reader.tp} tensor-parallel files)',
                flush=True,
            )
            stages[pp_rank], others = reader.load_stage(pp_rank)
            for tp_rank in range(reader.tp):
                utils.print_memory_usage('stage %d' % pp_rank, tp_rank, reader.tp)
            if pp_rank == 0:
                md.consumed_train_samples = _consumed(others, 'consumed_train_samples')
                md.consumed_valid_samples = _consumed(others, 'consumed_valid_samples')
        return stages[pp_rank]

    stage(0)
    queue.put(md)

    if md.model_type == 'T5':

        def take_stage(pp_rank):
            ((_, chunk),) = stage(pp_rank)
            del stages[pp_rank]
            return chunk

        mcore_t5.send_model(queue, md, reader.pp, take_stage, embeddings_message)
        return

    _, first_rest = cc.split_chunk_by_layer(stage(0)[0][1], 0)
    utils.queue_put(queue, 'embeddings', embeddings_message(md, first_rest))

    # Chunk-major walk: chunk 0 of every stage, then chunk 1, ... is the global layer order.
    num_chunks = reader.vp or 1
    rest = None
    for vp_rank in range(num_chunks):
        for pp_rank in range(reader.pp):
            offset, chunk = stage(pp_rank)[vp_rank]
            stages[pp_rank][vp_rank] = (offset, None)  # sent once: let it go
            layers, rest = cc.split_chunk_by_layer(chunk, offset)
            del chunk
            for index, layer in layers.items():
                message = cc_moe.moe_layer_to_message(layer, md.swiglu, md.num_experts)
                utils.queue_put(queue, f'transformer layer {index}', message)

    send_tail(queue, md, rest)


def embeddings_message(md, rest):
    """'embeddings': the word table, learned positions, and BERT's token types (which
    Megatron's converter drops; sent here so they survive)."""
    message = {'word embeddings': rest['embedding.word_embeddings.weight']}
    if md.position_embedding_type == 'learned_absolute':
        message['position embeddings'] = rest['embedding.position_embeddings.weight']
    if 'embedding.tokentype_embeddings.weight' in rest:
        message['tokentype embeddings'] = rest['embedding.tokentype_embeddings.weight']
    return message


def send_tail(queue, md, rest):
    """'final norm', 'output layer' (untied), a GPT's 'mtp layer k', BERT's 'pooler', 'lm head',
    'binary head', 'done'.

    BERT's output-layer bias travels in 'lm head' as 'output bias' (Megatron's converter leaves
    it at zero).
    """
    block = cc.block_name(md.model_type)
    message = {'weight': rest[f'{block}.final_layernorm.weight']}
    if md.norm_has_bias:
        message['bias'] = rest[f'{block}.final_layernorm.bias']
    utils.queue_put(queue, 'final norm', message)
    if md.output_layer:
        utils.queue_put(queue, 'output layer', {'weight': rest['output_layer.weight']})
    if md.model_type == 'GPT':
        for name, message in cc_moe.mtp_layer_messages(
            rest, md.swiglu, getattr(md, 'num_experts', None)
        ):
            utils.queue_put(queue, name, message)
    if md.model_type == 'BERT':
        if 'pooler.dense.weight' in rest:
            utils.queue_put(
                queue,
                'pooler',
                {'weight': rest['pooler.dense.weight'], 'bias': rest['pooler.dense.bias']},
            )
        message = {
            'dense weight': rest['lm_head.dense.weight'],
            'dense bias': rest['lm_head.dense.bias'],
            'norm weight': rest['lm_head.layer_norm.weight'],
        }
        if md.norm_has_bias:
            message['norm bias'] = rest['lm_head.layer_norm.bias']
        if 'output_layer.bias' in rest:
            message['output bias'] = rest['output_layer.bias']
        utils.queue_put(queue, 'lm head', message)
        if md.bert_binary_head:
            utils.queue_put(
                queue,
                'binary head',
                {'weight': rest['binary_head.weight'], 'bias': rest['binary_head.bias']},
            )
    utils.queue_put(queue, 'done')


def load_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    if mamba_checkpoint.is_mamba(args):
        body = mamba_checkpoint.load_mcore
    elif args.model_type == 'VISION':
        body = mcore_vision.load_mcore
    elif args.model_type == 'LLAVA':
        body = mcore_llava.load_mcore
    else:
        body = _load
    utils.run_loader(queue, body, args)
