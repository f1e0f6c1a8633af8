"""--model-type T5 in the mcore loader and saver (not a plugin: loader_mcore / saver_mcore call it).

Megatron's converter has no T5. Its messages here extend Megatron's GPT / BERT protocol:

    "embeddings"          "word embeddings", "position embeddings" (learned_absolute)
    "encoder layer N"     N = 0 .. encoder layers - 1: the keys of Megatron's "transformer layer N"
    "encoder final norm"  "weight", "bias"
    "decoder layer N"     N = 0 .. decoder layers - 1: the same keys plus "cross norm weight/bias",
                          "cross q weight/bias", "cross kv weight/bias", "cross dense weight/bias"
    "decoder final norm"  "weight", "bias"
    "output layer"        "weight" (untied only)
    "lm head"             "output bias" (tied only: an untied T5 head has no bias)
    "done"

The order is the pipeline order (encoder stages, then decoder stages), so the loader reads and
the saver writes one stage at a time whatever the split ranks on either side. The copies of the
embedding (the split-rank stage's, a tied last stage's) are not sent: the loader reads stage 0's,
the saver writes it to every stage that holds one.
"""

import sys

import utils

utils.add_megatron_path()

from megatron.training.checkpoint import checkpoint_conversion as cc  # noqa: E402
from megatron.training.checkpoint import checkpoint_conversion_t5 as t5  # noqa: E402

# ---------------------------------------------------------------------------------------------
# loader side


def metadata_fields(margs):
    """The md fields a T5 adds: the two depths, the decoder length and the source split rank."""
    encoder, decoder = t5.t5_depths(margs)
    return dict(
        encoder_num_layers=encoder,
        decoder_num_layers=decoder,
        decoder_seq_length=getattr(margs, 'decoder_seq_length', None),
        previous_pipeline_parallel_split_rank=getattr(
            margs, 'pipeline_model_parallel_split_rank', None
        ),
    )


def check_source(md):
    """The source's recorded pipeline split fits its depths (ValueError, one line)."""
    try:
        t5.check_t5_layout(
            md.encoder_num_layers,
            md.decoder_num_layers,
            md.previous_pipeline_parallel_size,
            md.previous_pipeline_parallel_split_rank,
        )
    except ValueError as exc:
        raise ValueError(f'the source checkpoint\'s args: {exc}')


def send_model(queue, md, num_stages, take_stage, embeddings_message):
    """Stream a T5 stage by stage after `md` (see the module docstring).

    Args:
        num_stages: the source's pipeline size.
        take_stage: pp_rank -> that stage's TP-merged state dict (the caller forgets it).
        embeddings_message: (md, rest of stage 0) -> the "embeddings" message.
    """
    split = md.previous_pipeline_parallel_split_rank
    encoder, decoder = md.encoder_num_layers, md.decoder_num_layers
    for pp_rank in range(num_stages):
        stage = t5.t5_stage(encoder, decoder, num_stages, split, pp_rank)
        encoder_layers, decoder_layers, rest = t5.split_t5_chunk(take_stage(pp_rank), stage)
        if pp_rank == 0:
            utils.queue_put(queue, 'embeddings', embeddings_message(md, rest))
        for index, layer in encoder_layers.items():
            message = cc.layer_to_message(layer, md.swiglu)
            utils.queue_put(queue, f'encoder layer {index}', message)
        if stage.encoder_final_norm:
            utils.queue_put(queue, 'encoder final norm', _norm(md, rest, 'encoder'))
        for index, layer in decoder_layers.items():
            message = cc.layer_to_message(layer, md.swiglu, t5.DECODER_MESSAGE_KEYS)
            utils.queue_put(queue, f'decoder layer {index}', message)
        if stage.decoder_head:
            utils.queue_put(queue, 'decoder final norm', _norm(md, rest, 'decoder'))
            if md.output_layer:
                utils.queue_put(queue, 'output layer', {'weight': rest['output_layer.weight']})
            else:
                utils.queue_put(queue, 'lm head', {'output bias': rest['output_layer.bias']})
    utils.queue_put(queue, 'done')


def _norm(md, rest, block):
    message = {'weight': rest[f'{block}.final_layernorm.weight']}
    if md.norm_has_bias:
        message['bias'] = rest[f'{block}.final_layernorm.bias']
    return message


# ---------------------------------------------------------------------------------------------
# saver side


def target_split_rank(args, md, pp):
    """The target's --pipeline-model-parallel-split-rank: --target-pipeline-parallel-split-rank,
    else the source's when the pipeline size is kept, else None (then one stage is required).
    """
    split = getattr(args, 'target_pipeline_parallel_split_rank', None)
    if split is None and pp > 1 and pp == md.previous_pipeline_parallel_size:
        split = md.previous_pipeline_parallel_split_rank
    return split


def check_target(args, md, pp):
    """The target split rank fits the target pipeline and both depths (ValueError, one line)."""
    split = target_split_rank(args, md, pp)
    if split is None and pp > 1:
        raise ValueError(
            f'--target-pipeline-parallel-split-rank is required for a T5 at '
            f'--target-pipeline-parallel-size {pp} (the source is PP'
            f'{md.previous_pipeline_parallel_size}, split rank '
            f'{md.previous_pipeline_parallel_split_rank})'
        )
    t5.check_t5_layout(
        md.encoder_num_layers,
        md.decoder_num_layers,
        pp,
        split,
        pp_flag='--target-pipeline-parallel-size',
        split_flag='--target-pipeline-parallel-split-rank',
    )


def _receive(queue, name, args):
    return utils.queue_get(queue, name, args.checking)


def _final_norm(queue, md, args, block, stage):
    msg = _receive(queue, f'{block} final norm', args)
    stage[f'{block}.final_layernorm.weight'] = msg.pop('weight')
    if md.norm_has_bias:
        stage[f'{block}.final_layernorm.bias'] = msg.pop('bias')
    utils.check_message(msg, args.checking)


def _layers(queue, md, args, block, share, stage, progress):
    first, count = share
    keys = t5.DECODER_MESSAGE_KEYS if block == 'decoder' else None
    for local in range(count):
        msg = _receive(queue, f'{block} layer {first + local}', args)
        layer = cc.message_to_layer(msg, md.swiglu, keys)
        utils.check_message(msg, args.checking)
        stage.update({f'{block}.layers.{local}.{k}': v for k, v in layer.items()})
        progress.step(f'{block} layer')


def _head(queue, md, args, padded, embedding, stage):
    """The LM head, under both of its names; a tied head without the embedding on its stage
    gets its own copy of the word table."""
    head = {}
    if md.output_layer:
        msg = _receive(queue, 'output layer', args)
        head['weight'] = cc.repad_vocab(msg.pop('weight'), padded)
    else:
        msg = _receive(queue, 'lm head', args)
        head['bias'] = cc.repad_vocab(msg.pop('output bias'), padded)
        if 'embedding.word_embeddings.weight' not in stage:
            head['weight'] = embedding['embedding.word_embeddings.weight']
    utils.check_message(msg, args.checking)
    for name, tensor in head.items():
        stage[f'output_layer.{name}'] = tensor
        stage[f'lm_head.output_layer.{name}'] = tensor


def save_model(queue, md, args, writer, sizes, padded, embeddings):
    """Receive a T5 (after `md`) and write it stage by stage at the target layout.

    Args:
        writer: the CheckpointWriter of the target.
        sizes: (target PP, target split rank).
        padded: the target's padded vocabulary.
        embeddings: (queue, md, args, padded) -> the stage-0 embedding entries.
    """
    pp, split = sizes
    encoder, decoder = md.encoder_num_layers, md.decoder_num_layers
    progress = utils.Progress('saver', encoder + decoder)
    embedding = None
    for pp_rank in range(pp):
        layout = t5.t5_stage(encoder, decoder, pp, split, pp_rank)
        stage = {}
        if pp_rank == 0:
            embedding = embeddings(queue, md, args, padded)
        if layout.embedding:
            stage.update(embedding)
        if layout.encoder is not None:
            _layers(queue, md, args, 'encoder', layout.encoder, stage, progress)
        if layout.encoder_final_norm:
            _final_norm(queue, md, args, 'encoder', stage)
        if layout.decoder is not None:
            _layers(queue, md, args, 'decoder', layout.decoder, stage, progress)
        if layout.decoder_head:
            _final_norm(queue, md, args, 'decoder', stage)
            _head(queue, md, args, padded, embedding, stage)
            msg = utils.queue_get(queue, None, args.checking)
            if msg != 'done':
                print(f'ERROR: got some more data but was expecting to be done ({msg["name"]})')
                sys.exit(1)
        writer.write_stage(pp_rank, stage, has_output_layer=layout.decoder_head)
        print(f'saver: wrote pipeline stage {pp_rank + 1}/{pp} ({writer.tp} files)', flush=True)
