"""Pretrain BERT (masked LM + sentence-order prediction).

Thin entry script: the model provider, the batch getter, the loss, the forward step and the dataset
provider; `pretrain()` does the rest. Run with torchrun, e.g. `bash examples/quickstart_bert.sh`.
"""

from functools import partial
from importlib import import_module

import torch
import torch.nn.functional as F

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.enums import ModelType
from megatron.core.models.bert import bert_layer_specs
from megatron.core.models.bert.bert_model import BertModel
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets.masked_dataset_configs import core_bert_dataset_config_from_args
from megatron.training.global_vars import get_args, get_timers, get_tokenizer
from megatron.training.run_control.errors import run_main
from megatron.training.training import pretrain
from megatron.training.utils import average_losses_across_data_parallel_group, print_rank_0
from megatron.training.validation.bert_checks import check_bert_pretraining_inputs


def model_provider(pre_process=True, post_process=True) -> BertModel:
    """Build the BERT model of this pipeline stage.

    `--spec local` selects the local layer spec; without `--spec` Megatron uses the Transformer
    Engine spec (here: the local spec, with a warning); `--spec MODULE FUNCTION` builds a custom
    one. The binary head (and 2 token types) is on unless `--bert-no-binary-head`.
    """
    print_rank_0('building BERT model ...')
    args = get_args()
    config = core_transformer_config_from_args(args)
    num_tokentypes = 2 if args.bert_binary_head else 0

    if args.spec is None:
        transformer_layer_spec = bert_layer_specs.bert_layer_with_transformer_engine_spec
    elif args.spec[0] == 'local':
        print_rank_0('Using Local spec for transformer layers')
        transformer_layer_spec = bert_layer_specs.bert_layer_local_spec
    else:
        module_name, function_name = args.spec
        transformer_layer_spec = getattr(import_module(module_name), function_name)()

    return BertModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        num_tokentypes=num_tokentypes,
        add_binary_head=args.bert_binary_head,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        parallel_output=True,
        pre_process=pre_process,
        post_process=post_process,
    )


def get_batch(data_iterator):
    """The micro-batch, read on TP rank 0 and broadcast over the TP group (every stage needs the
    padding mask): (tokens, types, sentence_order, loss_mask, lm_labels, padding_mask)."""
    keys = ['text', 'types', 'labels', 'is_random', 'loss_mask', 'padding_mask']
    data = next(data_iterator) if data_iterator is not None else None
    data_b = tensor_parallel.broadcast_data(keys, data, torch.int64)

    tokens = data_b['text'].long()
    types = data_b['types'].long()
    sentence_order = data_b['is_random'].long()
    loss_mask = data_b['loss_mask'].float()
    lm_labels = data_b['labels'].long()
    padding_mask = data_b['padding_mask'].long()
    return tokens, types, sentence_order, loss_mask, lm_labels, padding_mask


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """lm loss = mean over the masked positions of this micro-batch; sop loss = cross entropy of the
    sentence-order logits. Returns (lm + sop, {'lm loss', 'sop loss'} averaged over the DP group);
    the schedule divides the loss by the number of micro-batches."""
    lm_loss_, sop_logits = output_tensor

    lm_loss_ = lm_loss_.float()
    loss_mask = loss_mask.float()
    # A micro-batch of short samples can have no masked token at all (the masking budget is
    # 0.15 x the sample's target length, < 1 below 7 tokens): Megatron then divides 0 by 0 and
    # stops on the NaN; here that micro-batch contributes an lm loss of 0 instead.
    lm_loss = torch.sum(lm_loss_.view(-1) * loss_mask.reshape(-1)) / loss_mask.sum().clamp(min=1)

    if sop_logits is not None:
        sop_loss = F.cross_entropy(
            sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1
        )
        sop_loss = sop_loss.float()
        loss = lm_loss + sop_loss
        averaged_losses = average_losses_across_data_parallel_group([lm_loss, sop_loss])
        return loss, {'lm loss': averaged_losses[0], 'sop loss': averaged_losses[1]}

    loss = lm_loss
    averaged_losses = average_losses_across_data_parallel_group([lm_loss])
    return loss, {'lm loss': averaged_losses[0]}


def forward_step(data_iterator, model: BertModel):
    """Forward one micro-batch; returns (per-token losses and sop logits, loss function)."""
    args = get_args()
    timers = get_timers()

    timers('batch-generator', log_level=2).start()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    timers('batch-generator').stop()

    if not args.bert_binary_head:
        types = None

    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Build the train, validation and test datasets (on TP rank 0 of every pipeline stage).

    Args:
        train_val_test_num_samples: samples wanted for each split.
    """
    args = get_args()
    tokenizer = get_tokenizer()
    check_bert_pretraining_inputs(args, tokenizer)
    config = core_bert_dataset_config_from_args(args, tokenizer)

    print_rank_0('> building train, validation, and test datasets for BERT ...')
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset,
        train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0,
        config,
    ).build()
    print_rank_0('> finished creating BERT datasets ...')
    return train_ds, valid_ds, test_ds


# The core datasets are distributed-aware: every rank calls the provider.
train_valid_test_datasets_provider.is_distributed = True


if __name__ == '__main__':
    run_main(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'},
    )
