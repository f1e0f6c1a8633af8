"""A GPT entry script that leans on the surface core_r0.8.0's pretrain_gpt.py leans on.

Written here (not taken from Megatron) to pin that surface: the package-level helpers of
`megatron.training`, `mpu`, the GPT dataset config and builder, the tp/cp batch helpers, the layer
spec getters, the YAML config reader, the legacy model namespace, the straggler timer and the
callback protocol of `pretrain` (provider keywords, `is_distributed`, the 3-tuple loss).
It must print the same losses as the repository's pretrain_gpt.py for the same flags.
"""

import os  # noqa: F401  (imported by r0.8's script too; only its NaN message uses it)
from functools import partial
from typing import Union

import torch

import megatron.legacy.model
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import import_module
from megatron.core.utils import StragglerDetector
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training.yaml_arguments import core_transformer_config_from_yaml

# Built before initialization with no arguments, as r0.8 does; a process-wide singleton.
straggler = StragglerDetector()


def _layer_spec(args):
    if args.spec is not None:
        return import_module(args.spec)
    getter = (
        get_gpt_layer_with_transformer_engine_spec
        if args.transformer_impl == 'transformer_engine'
        else get_gpt_layer_local_spec
    )
    return getter(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm)


def model_provider(
    pre_process=True, post_process=True
) -> Union[GPTModel, megatron.legacy.model.GPTModel]:
    """One pipeline stage of GPT; the keywords come from the training loop."""
    args = get_args()
    print_rank_0('contract script: GPT model')
    if args.use_legacy_models:
        return megatron.legacy.model.GPTModel(
            core_transformer_config_from_args(args),
            num_tokentypes=0,
            parallel_output=True,
            pre_process=pre_process,
            post_process=post_process,
        )
    if args.yaml_cfg is not None:
        config = core_transformer_config_from_yaml(args, 'language_model')
    else:
        config = core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


def _next_batch(data_iterator):
    # Stages strictly inside the pipeline get activations from their neighbour, not data.
    if not (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()):
        return (None,) * 5
    per_rank = get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(data_iterator))
    # The dict's order is the contract: tokens, labels, loss_mask, attention_mask, position_ids.
    return tuple(per_rank.values())


def loss_func(loss_mask, output_tensor):
    """(sum, token count, {'lm loss': (DP sum, DP count)}): the 3-tuple form."""
    args = get_args()
    mask = loss_mask.view(-1).float()
    pair = torch.stack([(output_tensor.float().view(-1) * mask).sum(), mask.sum()])
    if args.context_parallel_size > 1:
        torch.distributed.all_reduce(pair, group=mpu.get_context_parallel_group())
    if args.check_for_nan_in_loss_and_grad:
        rank = torch.distributed.get_rank()
        assert not pair[0].isnan(), f'contract script: NaN loss on rank {rank}'
    logged = pair.clone().detach()
    torch.distributed.all_reduce(logged, group=mpu.get_data_parallel_group())
    count = pair[1].clone().detach().to(torch.int)
    return pair[0] * args.context_parallel_size, count, {'lm loss': (logged[0], logged[1])}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    with straggler(bdata=True):
        tokens, labels, loss_mask, attention_mask, position_ids = _next_batch(data_iterator)
    timers('batch-generator').stop()
    with straggler:
        out = model(tokens, position_ids, attention_mask, labels=labels)
    return out, partial(loss_func, loss_mask)


def is_dataset_built_on_rank():
    edge_stage = mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()
    return edge_stage and mpu.get_tensor_model_parallel_rank() == 0


def core_gpt_dataset_config_from_args(args):
    splits = (args.train_data_path, args.valid_data_path, args.test_data_path)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        blend_per_split=[get_blend_from_list(p) for p in splits],
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        s3_cache_path=args.s3_cache_path,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    dataset_class = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0('contract script: building GPT datasets')
    builder = BlendedMegatronDatasetBuilder(
        dataset_class,
        train_val_test_num_samples,
        is_dataset_built_on_rank,
        core_gpt_dataset_config_from_args(args),
    )
    train, valid, test = builder.build()
    print_rank_0('contract script: GPT datasets ready')
    return train, valid, test


if __name__ == '__main__':
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
