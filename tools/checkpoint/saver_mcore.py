"""Saver plugin: writes this project's checkpoint layout at any target TP x PP (x EP for MoE; for
a T5, any encoder/decoder pipeline split: --target-pipeline-parallel-split-rank).

Megatron's file layout (iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt and the tracker), the
source iteration and args (at the target layout), no optimizer / scheduler / RNG state. The
vocabulary padding is recomputed for the target TP by Megatron's rule when the true vocabulary
size is known (a larger table keeps its leading rows, a smaller one repeats its last row); the
untied output layer gets the same padding.
"""

import os
import sys

import mamba_checkpoint
import mcore_llava
import mcore_t5
import mcore_vision
import utils

utils.add_megatron_path()

from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion_moe as cc_moe  # noqa: E402
from megatron.training.checkpoint.checkpoint_layout import remove_stale_staging  # noqa: E402
from megatron.training.checkpointing import checkpoint_exists  # noqa: E402

DEFAULT_TRANSFORMER_IMPL = 'transformer_engine'


def add_arguments(parser, default_impl=DEFAULT_TRANSFORMER_IMPL, expert_flag=True):
    group = parser.add_argument_group(title='M-Core saver')
    group.add_argument(
        '--megatron-path',
        type=str,
        default=None,
        help='Repository root to import megatron from (default: this checkout).',
    )
    group.add_argument(
        '--target-tensor-parallel-size',
        type=int,
        help='Tensor parallel size to write (default: the source checkpoint\'s, else 1)',
    )
    group.add_argument(
        '--target-pipeline-parallel-size',
        type=int,
        help='Pipeline parallel size to write (default: the source checkpoint\'s, else 1)',
    )
    group.add_argument(
        '--target-pipeline-parallel-split-rank',
        type=int,
        default=None,
        help='T5 only: target --pipeline-model-parallel-split-rank (stages below it hold the '
        'encoder); defaults to the source\'s when the pipeline size is kept',
    )
    group.add_argument(
        '--saver-transformer-impl',
        default=default_impl,
        choices=['local', 'transformer_engine'],
        help='Which Transformer implementation to use (both write the same layout here).',
    )
    if expert_flag:
        group.add_argument(
            '--target-expert-parallel-size',
            type=int,
            default=1,
            help='Target expert model parallel size (MoE models; dense models: 1)',
        )


def target_sizes(args, md):
    """(tp, pp): the flags, else the source's sizes, else 1."""
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    if tp is None:
        tp = getattr(md, 'previous_tensor_parallel_size', None)
        if tp is None:
            print(
                'loader did not provide a tensor parallel size and '
                '--target-tensor-parallel-size not provided on command line. Default to 1.'
            )
            tp = 1
    if pp is None:
        pp = getattr(md, 'previous_pipeline_parallel_size', None)
        if pp is None:
            print(
                'loader did not provide a pipeline parallel size and '
                '--target-pipeline-parallel-size not provided on command line. Default to 1.'
            )
            pp = 1
    return tp, pp


def target_vocab_size(md, tp, source_rows):
    """Padded vocabulary at the target TP (Megatron's rule), or the source's when unknown."""
    if md.true_vocab_size is None:
        return source_rows
    divisible_by = md.make_vocab_size_divisible_by or 128
    return cc.padded_vocab_size(md.true_vocab_size, divisible_by, tp)


def check_arguments(args, md):
    """Target layout against the model, and the save directory; ValueError in one line."""
    if md is None:
        return
    if mamba_checkpoint.is_mamba(md):
        mamba_checkpoint.check_mcore_target(args, md)
        return
    tp, pp = target_sizes(args, md)
    for flag, size in (
        ('--target-tensor-parallel-size', tp),
        ('--target-pipeline-parallel-size', pp),
    ):
        if size < 1:
            raise ValueError(f'{flag} must be at least 1, got {size}')
    if md.model_type in ('VISION', 'LLAVA'):
        module = mcore_vision if md.model_type == 'VISION' else mcore_llava
        module.check_target(md, tp, pp)
        _check_save_dir(args)
        return
    margs = md.checkpoint_args
    _check_expert_parallel(args, md, tp)
    heads = md.num_attention_heads
    groups = margs.num_query_groups if getattr(margs, 'group_query_attention', False) else heads
    if heads % tp:
        raise ValueError(
            f'--target-tensor-parallel-size {tp} does not divide the number of '
            f'attention heads ({heads})'
        )
    if groups % tp:
        raise ValueError(
            f'--target-tensor-parallel-size {tp} does not divide the number of '
            f'query groups ({groups})'
        )
    ffn = getattr(margs, 'ffn_hidden_size', None)
    if ffn and ffn % tp:
        raise ValueError(
            f'--target-tensor-parallel-size {tp} does not divide ffn_hidden_size ({ffn})'
        )
    if md.model_type == 'T5':
        mcore_t5.check_target(args, md, pp)
    elif getattr(args, 'target_pipeline_parallel_split_rank', None) is not None:
        raise ValueError(
            f'--target-pipeline-parallel-split-rank is for --model-type T5 (encoder-decoder '
            f'models), not {md.model_type}'
        )
    elif md.num_layers % pp:
        raise ValueError(
            f'--target-pipeline-parallel-size {pp} does not divide the number of '
            f'layers ({md.num_layers})'
        )
    source_rows = getattr(margs, 'padded_vocab_size', None)
    if md.true_vocab_size is None and source_rows is not None and source_rows % tp:
        raise ValueError(
            f'--target-tensor-parallel-size {tp} does not divide the checkpoint\'s padded '
            f'vocabulary ({source_rows} rows) and the true vocabulary size is unknown: give the '
            f'loader --true-vocab-size or --vocab-file'
        )
    _check_save_dir(args)


def _check_save_dir(args):
    if checkpoint_exists(args.save_dir) and not args.overwrite:
        raise ValueError(
            f'--save-dir {args.save_dir} already holds a checkpoint '
            f'(latest_checkpointed_iteration.txt); pass --overwrite to replace it'
        )


def _target_ep(args) -> int:
    return getattr(args, 'target_expert_parallel_size', 1) or 1


def _check_expert_parallel(args, md, tp):
    ep, num_experts = _target_ep(args), getattr(md, 'num_experts', None)
    if ep < 1:
        raise ValueError(f'--target-expert-parallel-size must be >= 1, got {ep}')
    if ep > 1 and not num_experts:
        raise ValueError(
            f'--target-expert-parallel-size {ep}: the source model has no experts (only 1)'
        )
    if num_experts and num_experts % ep:
        raise ValueError(
            f'--target-expert-parallel-size {ep} does not divide the number of experts '
            f'({num_experts})'
        )
    if num_experts and getattr(md.checkpoint_args, 'moe_extended_tp', False):
        raise ValueError('--moe-extended-tp checkpoints cannot be converted')
    moe_ffn = getattr(md.checkpoint_args, 'moe_ffn_hidden_size', None)
    if num_experts and moe_ffn and moe_ffn % tp:
        raise ValueError(
            f'--target-tensor-parallel-size {tp} does not divide moe_ffn_hidden_size ({moe_ffn})'
        )


def _moe_target_args(margs, md, args, tp):
    """MoE layout in the saved args: the expert-parallel size, its data-parallel share, and
    sequence parallelism (required with tensor parallelism, as Megatron's saver forces)."""
    if not getattr(md, 'num_experts', None):
        return margs
    ep = _target_ep(args)
    margs.num_experts = md.num_experts
    margs.expert_model_parallel_size = ep
    margs.world_size *= ep
    margs.data_parallel_size = ep
    margs.sequence_parallel = tp > 1
    return margs


def _embeddings(queue, md, args, padded):
    msg = utils.queue_get(queue, 'embeddings', args.checking)
    word = msg.pop('word embeddings')
    if md.true_vocab_size is None:
        print(
            'Original vocab size not specified, leaving embedding table as-is. If you\'ve '
            'changed the tensor parallel size this could cause problems.'
        )
    stage = {'embedding.word_embeddings.weight': cc.repad_vocab(word, padded)}
    if md.position_embedding_type == 'learned_absolute':
        stage['embedding.position_embeddings.weight'] = msg.pop('position embeddings')
    if 'tokentype embeddings' in msg:
        stage['embedding.tokentype_embeddings.weight'] = msg.pop('tokentype embeddings')
    utils.check_message(msg, args.checking)
    return stage


def _layer(queue, md, args, index):
    msg = utils.queue_get(queue, f'transformer layer {index}', args.checking)
    if 'router weight' in msg:
        margs = md.checkpoint_args
        ffn = getattr(margs, 'moe_ffn_hidden_size', None) or margs.ffn_hidden_size
        try:
            cc_moe.check_expert_message(msg, md.num_experts, md.hidden_size, ffn, md.swiglu)
        except ValueError as exc:
            print(f'error: transformer layer {index}: {exc}')
            sys.exit(1)
    layer = cc_moe.message_to_moe_layer(msg, md.swiglu)
    utils.check_message(msg, args.checking)
    return layer


def _last_stage_tail(queue, md, args, padded, word, pp):
    block = cc.block_name(md.model_type)
    stage = {}
    msg = utils.queue_get(queue, 'final norm', args.checking)
    stage[f'{block}.final_layernorm.weight'] = msg.pop('weight')
    if md.norm_has_bias:
        stage[f'{block}.final_layernorm.bias'] = msg.pop('bias')
    utils.check_message(msg, args.checking)
    if md.output_layer:
        msg = utils.queue_get(queue, 'output layer', args.checking)
        stage['output_layer.weight'] = cc.repad_vocab(msg.pop('weight'), padded)
        utils.check_message(msg, args.checking)
    elif pp > 1:
        # Tied embeddings: the last stage keeps its own copy of the word embeddings.
        stage['output_layer.weight'] = word
    if pp > 1 and getattr(md.checkpoint_args, 'mtp_num_layers', None):
        # Multi-token prediction embeds the rolled ids on the last stage with a copy of the
        # table (the same tensor as the output layer's when tied).
        stage['embedding.word_embeddings.weight'] = word
    _bert_heads(queue, md, args, padded, stage)
    return stage


def _mtp_layer(msg, md, depth):
    """One 'mtp layer k' message -> its `mtp.layers.{k}.*` tensors (experts checked)."""
    if 'router weight' in msg:
        margs = md.checkpoint_args
        ffn = getattr(margs, 'moe_ffn_hidden_size', None) or margs.ffn_hidden_size
        try:
            cc_moe.check_expert_message(msg, md.num_experts, md.hidden_size, ffn, md.swiglu)
        except ValueError as exc:
            print(f'error: mtp layer {depth}: {exc}')
            sys.exit(1)
    return cc_moe.message_to_mtp_layer(msg, md.swiglu, depth)


def _bert_heads(queue, md, args, padded, stage):
    """Receive a GPT's 'mtp layer k' messages, or the optional 'pooler', 'lm head', 'binary
    head' of a BERT (in that order), until 'done'."""
    expected = ['pooler', 'lm head', 'binary head']
    while True:
        msg = utils.queue_get(queue, None, args.checking)
        if msg == 'done':
            return
        name = msg['name']
        if name.startswith('mtp layer ') and md.model_type == 'GPT':
            print(f'received {name}', flush=True)
            stage.update(_mtp_layer(msg, md, int(name.split()[-1])))
            utils.check_message(msg, args.checking)
            continue
        if name not in expected or md.model_type != 'BERT':
            print(f'ERROR: got some more data but was expecting to be done ({name})')
            sys.exit(1)
        expected = expected[expected.index(name) + 1 :]
        print(f'received {name}', flush=True)
        if name == 'pooler':
            stage['pooler.dense.weight'] = msg.pop('weight')
            stage['pooler.dense.bias'] = msg.pop('bias')
        elif name == 'lm head':
            stage['lm_head.dense.weight'] = msg.pop('dense weight')
            stage['lm_head.dense.bias'] = msg.pop('dense bias')
            stage['lm_head.layer_norm.weight'] = msg.pop('norm weight')
            if md.norm_has_bias:
                stage['lm_head.layer_norm.bias'] = msg.pop('norm bias')
            if 'output bias' in msg:
                stage['output_layer.bias'] = cc.repad_vocab(msg.pop('output bias'), padded)
        else:
            stage['binary_head.weight'] = msg.pop('weight')
            stage['binary_head.bias'] = msg.pop('bias')
        utils.check_message(msg, args.checking)


def _save(queue, args):
    md = utils.queue_get(queue)
    tp, pp = target_sizes(args, md)
    try:
        check_arguments(args, md)
    except ValueError as exc:
        print(f'error: {exc}')
        sys.exit(1)
    if md.model_type in ('VISION', 'LLAVA'):
        remove_stale_staging(args.save_dir)
        if md.model_type == 'VISION':
            mcore_vision.save_mcore(queue, md, args, tp)
        else:
            mcore_llava.save_mcore(queue, md, args, tp, pp)
        print('Done!')
        return
    source_rows = md.checkpoint_args.padded_vocab_size
    padded = target_vocab_size(md, tp, source_rows)
    split = mcore_t5.target_split_rank(args, md, pp) if md.model_type == 'T5' else None
    margs = cc.args_for_target(
        md.checkpoint_args, tp, pp, padded, args.save_dir, md.iteration, md.true_vocab_size, split
    )
    margs = _moe_target_args(margs, md, args, tp)
    margs.consumed_train_samples = md.consumed_train_samples or 0
    margs.consumed_valid_samples = md.consumed_valid_samples or 0
    print(
        f'Setting consumed_train_samples to {margs.consumed_train_samples} and '
        f'consumed_valid_samples to {margs.consumed_valid_samples}'
    )
    # Staging directories of conversions killed before they finished: never a checkpoint.
    remove_stale_staging(args.save_dir)
    if getattr(md, 'num_experts', None):
        writer = cc_moe.MoECheckpointWriter(
            args.save_dir, md.iteration, tp, pp, margs, md.swiglu, _target_ep(args)
        )
    else:
        writer = cc.CheckpointWriter(args.save_dir, md.iteration, tp, pp, margs, md.swiglu)
    if md.model_type == 'T5':
        mcore_t5.save_model(queue, md, args, writer, (pp, split), padded, _embeddings)
        writer.finish()
        print('Done!')
        return

    layers_per_stage = md.num_layers // pp
    block = cc.block_name(md.model_type)
    progress = utils.Progress('saver', md.num_layers)
    word = None
    for pp_rank in range(pp):
        stage = {}
        if pp_rank == 0:
            stage.update(_embeddings(queue, md, args, padded))
            word = stage['embedding.word_embeddings.weight']
        for local in range(layers_per_stage):
            layer = _layer(queue, md, args, pp_rank * layers_per_stage + local)
            stage.update({f'{block}.layers.{local}.{k}': v for k, v in layer.items()})
            progress.step('layer')
        last = pp_rank == pp - 1
        if last:
            stage.update(_last_stage_tail(queue, md, args, padded, word, pp))
        writer.write_stage(pp_rank, stage, has_output_layer=last)
        files = tp * (_target_ep(args) if getattr(md, 'num_experts', None) else 1)
        print(f'saver: wrote pipeline stage {pp_rank + 1}/{pp} ({files} files)', flush=True)
    writer.finish()
    print('Done!')


def save_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    os.environ.setdefault('WORLD_SIZE', '1')
    if mamba_checkpoint.is_mamba(args):
        mamba_checkpoint.save_mcore(queue, args)
        return
    _save(queue, args)
