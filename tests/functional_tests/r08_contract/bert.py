"""A BERT entry script that leans on the surface core_r0.8.0's pretrain_bert.py leans on.

Written here (not taken from Megatron) to pin that surface: the layer spec *objects* of
`bert_layer_specs`, `tensor_parallel.broadcast_data`, the masked-LM dataset config and builder,
`average_losses_across_data_parallel_group` and the 2-tuple loss with its dict of tensors.
It must print the same losses as the repository's pretrain_bert.py for the same flags.
"""

from functools import partial

import torch
import torch.nn.functional as F

import megatron.legacy.model
from megatron.core import mpu, tensor_parallel
from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.models.bert.bert_layer_specs import (
    bert_layer_local_spec,
    bert_layer_with_transformer_engine_spec,
)
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.transformer.spec_utils import import_module
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import average_losses_across_data_parallel_group

BATCH_KEYS = ('text', 'types', 'labels', 'is_random', 'loss_mask', 'padding_mask')


def model_provider(pre_process=True, post_process=True):
    print_rank_0('contract script: BERT model')
    args = get_args()
    config = core_transformer_config_from_args(args)
    token_types = 2 if args.bert_binary_head else 0
    if args.use_legacy_models:
        return megatron.legacy.model.BertModel(
            config=config,
            num_tokentypes=token_types,
            add_binary_head=args.bert_binary_head,
            parallel_output=True,
            pre_process=pre_process,
            post_process=post_process,
        )
    # No --spec means the Transformer Engine object, whatever --transformer-impl says.
    if args.spec is None:
        layer_spec = bert_layer_with_transformer_engine_spec
    elif args.spec[0] == 'local':
        print_rank_0('contract script: local BERT layers')
        layer_spec = bert_layer_local_spec
    else:
        layer_spec = import_module(args.spec)
    return BertModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        num_tokentypes=token_types,
        add_binary_head=args.bert_binary_head,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        parallel_output=True,
        pre_process=pre_process,
        post_process=post_process,
    )


def _broadcast_batch(data_iterator):
    raw = None if data_iterator is None else next(data_iterator)
    got = tensor_parallel.broadcast_data(list(BATCH_KEYS), raw, torch.int64)
    ints = {key: got[key].long() for key in BATCH_KEYS if key != 'loss_mask'}
    return ints, got['loss_mask'].float()


def loss_func(loss_mask, sentence_order, output_tensor):
    """(lm [+ sop], {'lm loss'[, 'sop loss']} as DP means): the 2-tuple form."""
    token_losses, sop_logits = output_tensor
    mask = loss_mask.float().reshape(-1)
    lm = (token_losses.float().view(-1) * mask).sum() / mask.sum()
    if sop_logits is None:
        return lm, {'lm loss': average_losses_across_data_parallel_group([lm])[0]}
    sop = F.cross_entropy(
        sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1
    ).float()
    means = average_losses_across_data_parallel_group([lm, sop])
    return lm + sop, {'lm loss': means[0], 'sop loss': means[1]}


def forward_step(data_iterator, model):
    args = get_args()
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    ints, loss_mask = _broadcast_batch(data_iterator)
    timers('batch-generator').stop()
    token_types = ints['types'] if args.bert_binary_head else None
    out = model(
        ints['text'], ints['padding_mask'], tokentype_ids=token_types, lm_labels=ints['labels']
    )
    return out, partial(loss_func, loss_mask, ints['is_random'])


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    splits = (args.train_data_path, args.valid_data_path, args.test_data_path)
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        blend_per_split=[get_blend_from_list(p) for p in splits],
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head,
    )
    print_rank_0('contract script: building BERT datasets')
    train, valid, test = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset,
        train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        config,
    ).build()
    print_rank_0('contract script: BERT datasets ready')
    return train, valid, test


if __name__ == '__main__':
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'},
    )
