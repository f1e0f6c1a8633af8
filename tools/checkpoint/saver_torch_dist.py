"""Saver plugin: write a torch_dist checkpoint (`common.pt` + DCP files + `metadata.json`).

The tensors are written whole (experts stacked under their global index), so the checkpoint
loads in the trainer at any TP / PP / EP / DP (`--target-*-parallel-size` are not needed; the
padded vocabulary is the one of TP 1 and is adapted at load).
"""

import os
import sys

import utils

utils.add_megatron_path()

import saver_mcore  # noqa: E402

from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402


def add_arguments(parser):
    saver_mcore.add_arguments(parser)


def check_arguments(args, md):
    saver_mcore.check_arguments(args, md)


def _save(queue, args):
    from megatron.training.checkpoint.checkpoint_conversion_dist import write_full_state_dict

    md = utils.queue_get(queue)
    try:
        check_arguments(args, md)
    except ValueError as exc:
        print(f'error: {exc}')
        sys.exit(1)
    padded = saver_mcore.target_vocab_size(md, 1, md.checkpoint_args.padded_vocab_size)
    margs = cc.args_for_target(
        md.checkpoint_args, 1, 1, padded, args.save_dir, md.iteration, md.true_vocab_size
    )
    margs = saver_mcore._moe_target_args(margs, md, args, 1)
    margs.consumed_train_samples = md.consumed_train_samples or 0
    margs.consumed_valid_samples = md.consumed_valid_samples or 0
    margs.ckpt_format, margs.use_dist_ckpt = 'torch_dist', True
    block = cc.block_name(md.model_type)
    state = saver_mcore._embeddings(queue, md, args, padded)
    progress = utils.Progress('saver', md.num_layers)
    for index in range(md.num_layers):
        layer = saver_mcore._layer(queue, md, args, index)
        state.update({f'{block}.layers.{index}.{k}': v for k, v in layer.items()})
        progress.step('layer')
    state.update(
        saver_mcore._last_stage_tail(
            queue, md, args, padded, state['embedding.word_embeddings.weight'], 1
        )
    )
    os.makedirs(args.save_dir, exist_ok=True)
    path = write_full_state_dict(args.save_dir, md.iteration, state, margs)
    print(f'saver: wrote torch_dist checkpoint {path}', flush=True)
    print('Done!')


def save_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    _save(queue, args)
