"""A T5 entry script that leans on the surface core_r0.8.0's pretrain_t5.py leans on.

Written here (not taken from Megatron) to pin that surface: `megatron.core.models.T5` (capital
T), the four block-spec getters of `t5_spec`, the T5 masked dataset config (encoder and decoder
lengths), the legacy T5 name imported at module load, the encoder_and_decoder model type whose
provider also takes add_encoder / add_decoder, the 'batch generator' timer name and the 3-tuple
loss. It must print the same losses as the repository's pretrain_t5.py for the same flags.
"""

from functools import partial
from typing import Union

import torch

from megatron.core import mpu, tensor_parallel
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_decoder_with_transformer_engine_block_spec,
    get_t5_encoder_with_local_block_spec,
    get_t5_encoder_with_transformer_engine_block_spec,
)
from megatron.legacy.model import T5Model as LegacyT5Model
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args

BATCH_KEYS = ['text_enc', 'text_dec', 'labels', 'loss_mask', 'enc_mask', 'dec_mask', 'enc_dec_mask']

_BLOCK_SPECS = {
    'local': (get_t5_encoder_with_local_block_spec, get_t5_decoder_with_local_block_spec),
    'transformer_engine': (
        get_t5_encoder_with_transformer_engine_block_spec,
        get_t5_decoder_with_transformer_engine_block_spec,
    ),
}


def model_provider(
    pre_process=True, post_process=True, add_encoder=True, add_decoder=True
) -> Union[T5Model, LegacyT5Model]:
    args = get_args()
    config = core_transformer_config_from_args(args)
    if args.use_legacy_models:
        return LegacyT5Model(
            config=config,
            num_tokentypes=0,
            parallel_output=True,
            pre_process=pre_process,
            post_process=post_process,
            add_encoder=add_encoder,
            add_decoder=add_decoder,
        )
    print_rank_0('contract script: T5 model')
    encoder_getter, decoder_getter = _BLOCK_SPECS[args.transformer_impl]
    return T5Model(
        config=config,
        transformer_encoder_layer_spec=encoder_getter(args.encoder_num_layers),
        transformer_decoder_layer_spec=decoder_getter(args.decoder_num_layers),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
    )


def loss_func(loss_mask, output_tensor):
    """(sum, token count, {'lm loss': (DP sum, DP count)})."""
    mask = loss_mask.reshape(-1)
    pair = torch.stack([(output_tensor.float().view(-1) * mask).sum(), mask.sum()])
    logged = pair.clone().detach()
    torch.distributed.all_reduce(logged, group=mpu.get_data_parallel_group())
    count = pair[1].clone().detach().to(torch.int)
    return pair[0], count, {'lm loss': (logged[0], logged[1])}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers('batch generator', log_level=2).start()
    raw = None if data_iterator is None else next(data_iterator)
    got = tensor_parallel.broadcast_data(BATCH_KEYS, raw, torch.int64)
    timers('batch generator').stop()
    # The dataset's masks say 1 = attend; the model wants True = blocked.
    blocked = {key: got[key] < 0.5 for key in ('enc_mask', 'dec_mask', 'enc_dec_mask')}
    out = model(
        got['text_enc'].long(),
        got['text_dec'].long(),
        blocked['enc_mask'],
        blocked['dec_mask'],
        blocked['enc_dec_mask'],
        lm_labels=got['labels'].long(),
    )
    return out, partial(loss_func, got['loss_mask'].float())


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    splits = (args.train_data_path, args.valid_data_path, args.test_data_path)
    config = T5MaskedWordPieceDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.encoder_seq_length,
        sequence_length_decoder=args.decoder_seq_length,
        blend=get_blend_from_list(args.data_path),
        blend_per_split=[get_blend_from_list(p) for p in splits],
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=10,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True,
    )
    print_rank_0('contract script: building T5 datasets')
    train, valid, test = BlendedMegatronDatasetBuilder(
        T5MaskedWordPieceDataset,
        train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        config,
    ).build()
    print_rank_0('contract script: T5 datasets ready')
    return train, valid, test


if __name__ == '__main__':
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_and_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'},
    )
