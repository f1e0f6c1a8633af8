"""Pretrain T5.

Thin entry script: the model provider (encoder and/or decoder per pipeline stage), the batch
getter, the loss, the forward step and the dataset provider; `pretrain()` does the rest. Run with
torchrun, e.g. `bash examples/quickstart_t5.sh` (TP=2, PP=2 with split rank 1 on 4 processes).
"""

from functools import partial

import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
)
from megatron.core.enums import ModelType
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_decoder_with_transformer_engine_block_spec,
    get_t5_encoder_with_local_block_spec,
    get_t5_encoder_with_transformer_engine_block_spec,
)
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets.masked_dataset_configs import core_t5_dataset_config_from_args
from megatron.training.global_vars import get_args, get_timers
from megatron.training.run_control.errors import run_main
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0

#: The keys of a T5 sample that get_batch broadcasts over the tensor-parallel group (all int64).
T5_BATCH_KEYS = [
    'text_enc',
    'text_dec',
    'labels',
    'loss_mask',
    'enc_mask',
    'dec_mask',
    'enc_dec_mask',
]


def model_provider(
    pre_process=True, post_process=True, add_encoder=True, add_decoder=True
) -> T5Model:
    """Build the T5 model of this pipeline stage.

    Args:
        pre_process: this stage holds the embedding (stage 0 and the split rank).
        post_process: this stage holds its stack's final LayerNorm (and the LM head in the decoder).
        add_encoder: this stage runs encoder layers (stages before the split rank).
        add_decoder: this stage runs decoder layers (the split rank and after).
    """
    args = get_args()
    print_rank_0('building T5 model ...')
    config = core_transformer_config_from_args(args)
    if args.transformer_impl == 'local':
        en_block_spec = get_t5_encoder_with_local_block_spec(args.encoder_num_layers)
        de_block_spec = get_t5_decoder_with_local_block_spec(args.decoder_num_layers)
    else:
        en_block_spec = get_t5_encoder_with_transformer_engine_block_spec(args.encoder_num_layers)
        de_block_spec = get_t5_decoder_with_transformer_engine_block_spec(args.decoder_num_layers)
    return T5Model(
        config=config,
        transformer_encoder_layer_spec=en_block_spec,
        transformer_decoder_layer_spec=de_block_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        add_encoder=add_encoder,
        add_decoder=add_decoder,
    )


def get_batch(data_iterator):
    """The micro-batch of this rank, read on TP rank 0 and broadcast over the TP group.

    Every pipeline stage needs the masks, so every stage reads the batch. The int masks (1 =
    attend) become bool masks with True = masked out.

    Returns:
        (tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask).
    """
    data = next(data_iterator) if data_iterator is not None else None
    data_b = tensor_parallel.broadcast_data(T5_BATCH_KEYS, data, torch.int64)

    tokens_enc = data_b['text_enc'].long()
    tokens_dec = data_b['text_dec'].long()
    labels = data_b['labels'].long()
    loss_mask = data_b['loss_mask'].float()
    enc_mask = data_b['enc_mask'] < 0.5
    dec_mask = data_b['dec_mask'] < 0.5
    enc_dec_mask = data_b['enc_dec_mask'] < 0.5
    return tokens_enc, tokens_dec, loss_mask, labels, enc_mask, dec_mask, enc_dec_mask


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token loss.

    Returns:
        (sum of masked token losses, number of loss tokens, {'lm loss': (sum, count) summed over
        the data-parallel group}); the schedule divides by the token count and the number of
        micro-batches, the log reports the global token-weighted mean.
    """
    lm_loss_ = output_tensor.float()
    total_tokens = loss_mask.sum()
    lm_loss = torch.sum(lm_loss_.view(-1) * loss_mask.reshape(-1))
    lm_loss = torch.cat([lm_loss.view(1), total_tokens.view(1)])

    reporting_loss = lm_loss.detach().clone()
    torch.distributed.all_reduce(reporting_loss, group=mpu.get_data_parallel_group())

    num_tokens = lm_loss[1].detach().to(torch.int)
    return lm_loss[0], num_tokens, {'lm loss': (reporting_loss[0], reporting_loss[1])}


def forward_step(data_iterator, model: T5Model):
    """Forward one micro-batch; returns (per-token losses or hidden states, loss function)."""
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    tokens_enc, tokens_dec, loss_mask, lm_labels, enc_mask, dec_mask, enc_dec_mask = get_batch(
        data_iterator
    )
    timers('batch-generator').stop()
    output_tensor = model(
        tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=lm_labels
    )
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank():
    """Every pipeline stage reads T5 batches (all need the masks): TP rank 0 of each."""
    return mpu.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Build the train, validation and test T5MaskedWordPieceDatasets.

    Args:
        train_val_test_num_samples: samples wanted for each split.
    """
    args = get_args()
    config = core_t5_dataset_config_from_args(args)
    print_rank_0('> building train, validation, and test datasets for T5 ...')
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        T5MaskedWordPieceDataset, train_val_test_num_samples, is_dataset_built_on_rank, config
    ).build()
    print_rank_0('> finished creating T5 datasets ...')
    return train_ds, valid_ds, test_ds


# The core datasets are distributed-aware: every rank calls the provider.
train_valid_test_datasets_provider.is_distributed = True


if __name__ == '__main__':
    run_main(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_and_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'},
    )
