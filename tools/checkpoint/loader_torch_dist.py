"""Loader plugin: torch_dist checkpoints (`--use-dist-ckpt` / `--ckpt-format torch_dist`).

Written at any layout (the stored tensors are global); only the weights are read. The messages
are those of loader_mcore (MoE layers with their experts included), so any saver can follow
(mcore for the torch format at a chosen TP x PP x EP, hf for Hugging Face).
"""

import types

import utils

utils.add_megatron_path()

import loader_mcore  # noqa: E402

from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion_moe as cc_moe  # noqa: E402


def add_arguments(parser):
    loader_mcore.add_arguments(parser)


def _checkpoint_dir(load_dir):
    from megatron.core import dist_checkpointing

    iteration, release = cc._read_tracker(load_dir)
    path = cc.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise ValueError(
            f'--load-dir {load_dir}: {path} is not a torch_dist checkpoint (no metadata.json); '
            f'use --loader mcore for the torch format'
        )
    return path, iteration


def _reader(args):
    from megatron.core import dist_checkpointing

    path, iteration = _checkpoint_dir(args.load_dir)
    common = dist_checkpointing.load_common_state_dict(path)
    keys = dist_checkpointing.load_tensors_metadata(path)
    model_type = cc.model_type_from_keys(keys, getattr(common['args'], 'model_type', None))
    # The tensors are read whole: the source layout is TP1 x PP1 x EP1.
    reader = types.SimpleNamespace(
        args=common['args'],
        iteration=iteration,
        tp=1,
        pp=1,
        ep=1,
        model_type=model_type,
        path=path,
    )
    return reader


def check_arguments(args):
    reader = _reader(args)
    if reader.model_type != args.model_type:
        raise ValueError(
            f'--model-type {args.model_type}, but {args.load_dir} holds a {reader.model_type} model'
        )
    if reader.model_type == 'T5':
        raise ValueError(
            f'--loader torch_dist: {args.load_dir} holds a T5 model, which this loader does not '
            f'convert; save it in the torch format (--ckpt-format torch) and use --loader mcore'
        )
    return loader_mcore._metadata(args, reader, loader_mcore._true_vocab_size(args, reader.args))


def _load(queue, args):
    from megatron.core import dist_checkpointing
    from megatron.training.checkpoint.checkpoint_conversion_dist import dist_to_full_state_dict

    reader = _reader(args)
    md = loader_mcore._metadata(args, reader, loader_mcore._true_vocab_size(args, reader.args))
    consumed = reader.args
    md.consumed_train_samples = getattr(consumed, 'consumed_train_samples', 0)
    md.consumed_valid_samples = getattr(consumed, 'consumed_valid_samples', 0)
    print(f'loading torch_dist checkpoint {reader.path}', flush=True)
    full = dist_to_full_state_dict(dist_checkpointing.load_plain_tensors(reader.path))
    queue.put(md)
    layers, rest = cc.split_chunk_by_layer(full, 0)
    utils.queue_put(queue, 'embeddings', loader_mcore.embeddings_message(md, rest))
    for index, layer in layers.items():
        if md.num_experts:
            message = cc_moe.moe_layer_to_message(layer, md.swiglu, md.num_experts)
        else:
            message = cc.layer_to_message(layer, md.swiglu)
        utils.queue_put(queue, f'transformer layer {index}', message)
    loader_mcore.send_tail(queue, md, rest)


def load_checkpoint(queue, args):
    utils.add_megatron_path(args.megatron_path)
    utils.run_loader(queue, _load, args)
