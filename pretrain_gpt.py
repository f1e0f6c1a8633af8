"""Pretrain GPT.

Thin entry script: the model provider, the batch getter, the loss, the forward step and the dataset
provider; `pretrain()` does the rest. Run with torchrun, e.g. `bash examples/quickstart.sh`.
`--sft` trains on chat JSONL with packed conversations and `--fim-data` rewrites GPT data for
fill-in-the-middle (docs/sft.md, `bash examples/sft/finetune_llama.sh`).
"""

import copy
import dataclasses
from functools import partial

import torch

from megatron.core import parallel_state as mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import StragglerDetector
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron.training.datasets.sft_batch import get_sft_batch
from megatron.training.datasets.sft_dataset import SFTDataset, SFTDatasetConfig
from megatron.training.global_vars import get_args, get_timers, get_tokenizer
from megatron.training.gpt_builder import (
    gpt_config_from_args,
    gpt_layer_spec_from_args,
    gpt_model_kwargs,
)
from megatron.training.run_control.errors import run_main
from megatron.training.run_control.rerun_training import validate_loss
from megatron.training.training import pretrain
from megatron.training.utils import (
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
    print_rank_0,
)

# Times the sections below when --log-straggler is set (a no-op otherwise).
stimer = StragglerDetector()


def model_provider(pre_process=True, post_process=True) -> GPTModel:
    """Build the GPT model of this pipeline stage.

    Args:
        pre_process: this stage holds the embedding (first stage).
        post_process: this stage holds the output layer and computes the loss (last stage).
    """
    args = get_args()
    print_rank_0('building GPT model ...')
    config = gpt_config_from_args(args)
    transformer_layer_spec = gpt_layer_spec_from_args(args, config)
    if args.reset_attention_mask:
        if hasattr(transformer_layer_spec, 'layer_specs'):
            transformer_layer_spec.layer_specs = [
                _with_exact_attention_mask(spec) for spec in transformer_layer_spec.layer_specs
            ]
        else:
            transformer_layer_spec = _with_exact_attention_mask(transformer_layer_spec)
    return GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        **gpt_model_kwargs(args),
    )


def _with_exact_attention_mask(layer_spec):
    """The spec with its self attention applying the dataloader's mask exactly.

    Causal layers ignore the mask they are given and run fused causal attention; the per-document
    mask of --reset-attention-mask carries more than causality, so it needs the masked path.
    """
    attention = getattr(layer_spec.submodules, 'self_attention', None)
    if attention is None or not hasattr(attention, 'params'):
        raise ValueError(
            '--reset-attention-mask needs a layer spec with a self_attention ModuleSpec '
            f'(got {type(attention).__name__})'
        )
    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.self_attention.params = {
        **layer_spec.submodules.self_attention.params,
        'attn_mask_type': AttnMaskType.arbitrary,
    }
    return layer_spec


def get_batch(data_iterator):
    """The micro-batch of this rank: (tokens, labels, loss_mask, attention_mask, position_ids).

    Middle pipeline stages take their input from the previous stage and get Nones.
    """
    if (not mpu.is_pipeline_first_stage()) and (not mpu.is_pipeline_last_stage()):
        return None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator)
    batch = get_batch_on_this_cp_rank(batch)
    return batch.values()


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked token loss.

    With context parallelism each rank holds s/cp tokens: the [sum, count] pair is summed over
    the CP group (without autograd: the gradient flows through the local sum only), the local sum
    is multiplied by cp and the CP-wide count returned, so that with the gradients averaged over
    DP x CP the step equals CP=1 exactly. With --calculate-per-token-loss the local sum and count
    are returned instead (the counts are summed over DP x CP in finalize_model_grads).

    Returns:
        (loss, number of loss tokens, {'lm loss': (sum, count) summed over the data-parallel and
        context-parallel ranks}); the schedule divides by the token count (and micro-batch
        count) unless the loss is per token.
    """
    args = get_args()
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    total_tokens = loss_mask.sum()
    loss = torch.cat([torch.sum(losses.view(-1) * loss_mask).view(1), total_tokens.view(1)])

    # NaN / Inf (fatal) and spike (--check-for-spiky-loss) checks of the rerun state machine.
    validate_loss(args, loss[0])

    # [sum, count] of the whole sequence (all CP ranks); a detached copy, not in autograd.
    reduced = loss.clone().detach()
    if args.context_parallel_size > 1:
        torch.distributed.all_reduce(reduced, group=mpu.get_context_parallel_group())

    # The data-parallel sum below feeds the log only.
    reporting_loss = reduced.clone()
    torch.distributed.all_reduce(reporting_loss, group=mpu.get_data_parallel_group())

    if args.calculate_per_token_loss:
        return (
            loss[0],
            loss[1].clone().detach().to(torch.int),
            {'lm loss': (reporting_loss[0], reporting_loss[1])},
        )
    num_tokens = reduced[1].to(torch.int)
    return (
        loss[0] * args.context_parallel_size,
        num_tokens,
        {'lm loss': (reporting_loss[0], reporting_loss[1])},
    )


def forward_step(data_iterator, model: GPTModel):
    """Forward one micro-batch; returns (per-token losses or hidden states, loss function).

    With --sft the micro-batch is packed conversations: the model gets their boundaries
    (packed_seq_params) instead of an attention mask, and the loss mask covers answer tokens only.
    """
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    packed_seq_params = None
    with stimer(bdata=True):
        if get_args().sft:
            tokens, labels, loss_mask, position_ids, packed_seq_params = get_sft_batch(
                data_iterator
            )
            attention_mask = None
        else:
            tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers('batch-generator').stop()
    with stimer:
        output_tensor = model(
            tokens,
            position_ids,
            attention_mask,
            labels=labels,
            packed_seq_params=packed_seq_params,
            **({'loss_mask': loss_mask} if getattr(get_args(), 'mtp_num_layers', None) else {}),
        )
    return output_tensor, partial(loss_func, loss_mask)


def is_dataset_built_on_rank():
    """Datasets are read on TP rank 0 of the first and last pipeline stages (of every stage with
    --sft: the middle ones need the packed-sequence boundaries too)."""
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    return get_args().sft or mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()


def core_gpt_dataset_config_from_args(args, config_class=GPTDatasetConfig, **overrides):
    """The dataset config (GPTDatasetConfig, or the SFT / FIM / multimodal one) from args: the
    one place args become a dataset config. `overrides` set fields the args do not give (a
    subclass's own fields, which its validation may need at construction)."""
    kwargs = dict(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=get_blend_from_list(args.data_path),
        blend_per_split=[
            get_blend_from_list(args.train_data_path),
            get_blend_from_list(args.valid_data_path),
            get_blend_from_list(args.test_data_path),
        ],
        renormalize_blend_weights=args.renormalize_blend_weights,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        context_parallel_size=args.context_parallel_size,
        one_row_per_sample=args.sft_one_row_per_sample,
        long_conversations=args.sft_long_conversations,
        fim_rate=args.fim_rate,
        fim_spm_rate=args.fim_spm_rate,
        fim_split_sample=args.fim_split_sample,
        fim_fragment_rate=args.fim_fragment_rate,
        fim_no_prefix=args.fim_no_prefix,
        fim_extra_tokens={
            'prefix': args.fim_prefix_token,
            'middle': args.fim_middle_token,
            'suffix': args.fim_suffix_token,
            'pad': args.fim_pad_token,
            'eod': args.fim_eod_token,
        },
    )
    kwargs.update(overrides)
    fields = {f.name for f in dataclasses.fields(config_class)}
    return config_class(**{k: v for k, v in kwargs.items() if k in fields})


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Build the train, validation and test datasets.

    Args:
        train_val_test_num_samples: samples wanted for each split.
    """
    args = get_args()
    if args.sft:
        dataset_type, config_class = SFTDataset, SFTDatasetConfig
    elif args.fim_data:
        dataset_type, config_class = GPTFIMDataset, GPTFIMDatasetConfig
    else:
        dataset_type = MockGPTDataset if args.mock_data else GPTDataset
        config_class = GPTDatasetConfig
    config = core_gpt_dataset_config_from_args(args, config_class)
    print_rank_0('> building train, validation, and test datasets for GPT ...')
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, is_dataset_built_on_rank, config
    ).build()
    print_rank_0('> finished creating GPT datasets ...')
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
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
