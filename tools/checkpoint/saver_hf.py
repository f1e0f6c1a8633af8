"""Saver plugin: a Hugging Face model directory (GPT-2 or Llama family; Mixtral, Qwen2-MoE or
Qwen3-MoE for MoE models; DeepSeek-V3 for MLA models) that transformers' `from_pretrained`
loads: config.json, model.safetensors and, with --hf-tokenizer-dir, the tokenizer files. The
vocabulary padding is removed (true size from the loader, else the one the checkpoint records,
else the padded table is kept).
"""

import os
import sys

import mamba_checkpoint
import mcore_llava
import mcore_vision
import utils

utils.add_megatron_path()

from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion_moe as cc_moe  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint as hfc  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint_deepseek as hfc_ds  # noqa: E402
from megatron.training.checkpoint import hf_checkpoint_moe as hfc_moe  # noqa: E402


def add_arguments(parser):
    group = parser.add_argument_group(title='Hugging Face saver')
    group.add_argument(
        '--megatron-path',
        type=str,
        default=None,
        help='Repository root to import megatron from (default: this checkout).',
    )
    group.add_argument(
        '--hf-tokenizer-dir',
        type=str,
        default=None,
        help='copy the tokenizer files (tokenizer.json, vocab.json, merges.txt, '
        'tokenizer.model, ...) found in this directory',
    )
    group.add_argument(
        '--merge-file',
        type=str,
        default=None,
        help='GPT-2 BPE merges: copied as merges.txt, with the loader\'s --vocab-file copied as '
        'vocab.json, so that transformers\' AutoTokenizer loads the directory',
    )


def check_arguments(args, md):
    if md is not None and md.model_type == 'VISION':
        mcore_vision.check_hf_target(md)
    elif md is not None and md.model_type == 'LLAVA':
        mcore_llava.check_hf_target(md)
    elif md is not None and mamba_checkpoint.is_mamba(md):
        if md.hf_config is None:  # refuses an architecture HF cannot hold, before any work
            mamba_checkpoint.hf_config_from_args(md.checkpoint_args, 1, md.params_dtype)
        md = None  # the rest of the checks below are the GPT families'
    elif md is not None and md.model_type != 'GPT':
        raise ValueError(
            f'--saver hf exports GPT models (GPT-2 and Llama families), not --model-type '
            f'{md.model_type}'
        )
    if md is not None and md.model_type not in ('VISION', 'LLAVA'):
        if hfc_ds.is_deepseek_args(md.checkpoint_args):
            hfc_ds.check_deepseek_args(md.checkpoint_args)
        elif getattr(md.checkpoint_args, 'mtp_num_layers', None):
            raise ValueError(
                f'saver_hf: multi-token prediction (--mtp-num-layers '
                f'{md.checkpoint_args.mtp_num_layers}) has a Hugging Face layout only in '
                f'DeepSeek-V3 (--multi-latent-attention) models'
            )
        elif _is_moe(md):
            hfc_moe.hf_moe_family_of_args(md.checkpoint_args)
        else:
            hfc.hf_family_of_args(md.checkpoint_args)
    if args.hf_tokenizer_dir is not None and not os.path.isdir(args.hf_tokenizer_dir):
        raise ValueError(f'--hf-tokenizer-dir {args.hf_tokenizer_dir} is not a directory')
    if args.merge_file is not None and not getattr(args, 'vocab_file', None):
        raise ValueError('--merge-file needs the loader\'s --vocab-file (the GPT-2 vocab.json)')
    for path in (args.merge_file, getattr(args, 'vocab_file', None)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f'{path}: no such file')
    existing = [
        n
        for n in (hfc.CONFIG_NAME, hfc.SAFETENSORS_NAME)
        if os.path.exists(os.path.join(args.save_dir, n))
    ]
    if existing and not args.overwrite:
        raise ValueError(
            f'--save-dir {args.save_dir} already holds a Hugging Face model '
            f'({", ".join(existing)}); pass --overwrite to replace it'
        )


def _is_moe(md) -> bool:
    return bool(
        getattr(md, 'num_experts', None) or getattr(md.checkpoint_args, 'num_experts', None)
    )


def _true_vocab(md):
    if md.true_vocab_size is not None:
        return md.true_vocab_size
    margs = md.checkpoint_args
    if cc.recorded_true_vocab_size(margs) is not None:
        return cc.recorded_true_vocab_size(margs)
    print(
        'Original vocab size not specified, keeping the padded embedding table '
        f'({margs.padded_vocab_size} rows) as the Hugging Face vocabulary.'
    )
    return margs.padded_vocab_size


def _receive_full_model(queue, md, args):
    full = {}
    msg = utils.queue_get(queue, 'embeddings', args.checking)
    full['embedding.word_embeddings.weight'] = msg.pop('word embeddings')
    if md.position_embedding_type == 'learned_absolute':
        full['embedding.position_embeddings.weight'] = msg.pop('position embeddings')
    utils.check_message(msg, args.checking)
    progress = utils.Progress('saver', md.num_layers)
    for index in range(md.num_layers):
        msg = utils.queue_get(queue, f'transformer layer {index}', args.checking)
        layer = cc_moe.message_to_moe_layer(msg, md.swiglu)
        utils.check_message(msg, args.checking)
        full.update({f'decoder.layers.{index}.{k}': v for k, v in layer.items()})
        progress.step('layer')
    msg = utils.queue_get(queue, 'final norm', args.checking)
    full['decoder.final_layernorm.weight'] = msg.pop('weight')
    if md.norm_has_bias:
        full['decoder.final_layernorm.bias'] = msg.pop('bias')
    utils.check_message(msg, args.checking)
    if md.output_layer:
        msg = utils.queue_get(queue, 'output layer', args.checking)
        full['output_layer.weight'] = msg.pop('weight')
        utils.check_message(msg, args.checking)
    msg = utils.queue_get(queue, None, args.checking)
    while msg != 'done' and msg['name'].startswith('mtp layer '):
        print(f'received {msg["name"]}', flush=True)
        full.update(cc_moe.message_to_mtp_layer(msg, md.swiglu, int(msg['name'].split()[-1])))
        utils.check_message(msg, args.checking)
        msg = utils.queue_get(queue, None, args.checking)
    if msg != 'done':
        print(f'ERROR: got some more data but was expecting to be done ({msg["name"]})')
        sys.exit(1)
    return full


def save_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    if mamba_checkpoint.is_mamba(args):
        mamba_checkpoint.save_hf(queue, args)
        print('Done!')
        return
    md = utils.queue_get(queue)
    try:
        check_arguments(args, md)
    except ValueError as exc:
        print(f'error: {exc}')
        sys.exit(1)
    if md.model_type == 'VISION':
        mcore_vision.save_hf(queue, md, args)
        print('Done!')
        return
    if md.model_type == 'LLAVA':
        mcore_llava.save_hf(queue, md, args)
        print('Done!')
        return
    full = _receive_full_model(queue, md, args)
    dtype = full['embedding.word_embeddings.weight'].dtype
    if hfc_ds.is_deepseek_args(md.checkpoint_args):
        config = hfc_ds.deepseek_config_from_args(md.checkpoint_args, _true_vocab(md), dtype)
        try:
            state_dict = hfc_ds.deepseek_state_dict_from_full(config, full)
        except ValueError as exc:
            print(f'error: {exc}')
            sys.exit(1)
    elif _is_moe(md):
        config = hfc_moe.hf_moe_config_from_args(md.checkpoint_args, _true_vocab(md), dtype)
        try:
            state_dict = hfc_moe.hf_moe_state_dict_from_full(config, full)
        except ValueError as exc:
            print(f'error: {exc}')
            sys.exit(1)
    else:
        config = hfc.hf_config_from_args(md.checkpoint_args, _true_vocab(md), dtype)
        state_dict = hfc.hf_state_dict_from_full(config, full)
    copied = hfc.save_hf_dir(args.save_dir, config, state_dict, args.hf_tokenizer_dir)
    if args.merge_file is not None:
        copied += hfc.copy_gpt2_bpe_files(
            args.save_dir, getattr(args, 'vocab_file', None), args.merge_file
        )
    print(
        f'saver: wrote {config["architectures"][0]} to {args.save_dir}'
        + (f' with tokenizer files {copied}' if copied else ''),
        flush=True,
    )
    print('Done!')
