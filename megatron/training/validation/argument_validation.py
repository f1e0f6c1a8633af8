"""`validate_args`: Megatron's cross-flag rules, checked before any work starts.

Each rule fails with a one-line `ValueError` naming the flags and the numbers; the steps also
derive the values the rest of the training layer reads (`data_parallel_size`, `params_dtype`, ...).
The rules live by concern, the way the argument groups are split: parallel layout
(`argument_validation_parallel.py`), model (`argument_validation_model.py`), run
(`argument_validation_run.py`) and one module per feature (MoE, context parallelism, distributed
checkpoints, observability, SFT/FIM). Re-exported by `arguments.py`, where Megatron users import
it from.
"""

import math

from megatron.training.cli.arguments_unsupported import check_unsupported_flags
from megatron.training.run_control.errors import note
from megatron.training.validation.argument_validation_floats import validate_float_flags
from megatron.training.validation.argument_validation_fsdp import validate_fsdp_args
from megatron.training.validation.argument_validation_mamba import validate_mamba_args
from megatron.training.validation.argument_validation_mla import validate_mla_args
from megatron.training.validation.argument_validation_model import (
    select_transformer_impl,
    validate_mixed_precision,
    validate_network_sizes,
    validate_recompute,
    validate_sequence_lengths,
)
from megatron.training.validation.argument_validation_moe import validate_moe_args
from megatron.training.validation.argument_validation_parallel import (
    select_distributed_backend,
    validate_distributed_optimizer,
    validate_parallel_sizes,
    validate_sequence_parallel,
    validate_virtual_pipeline,
)
from megatron.training.validation.argument_validation_resilience import validate_resilience_args
from megatron.training.validation.argument_validation_run import (
    apply_script_defaults,
    refuse_removed_flags,
    reset_sample_counters,
    validate_batch_sizes,
    validate_data_and_logging,
    validate_learning_rate,
    validate_megatron_r08_extras,
    validate_save_interval,
    validate_timing_log_level,
    validate_training_length,
    validate_weight_decay,
)
from megatron.training.validation.argument_validation_sft_fim import validate_sft_and_fim_args
from megatron.training.validation.argument_validation_vision import (
    apply_vision_defaults,
    validate_vision_args,
)
from megatron.training.validation.context_parallel_checks import validate_context_parallel_args
from megatron.training.validation.dist_checkpoint_args import validate_dist_checkpoint_args
from megatron.training.validation.observability_args import validate_observability_args


def validate_args(args, defaults={}):
    """Check cross-flag rules and derive dependent args, before any work starts.

    The steps run in this order: the first failing rule is the one reported, and later steps read
    what earlier ones derive (`data_parallel_size`, `num_layers` from `--encoder-num-layers`,
    `seq_length`, ...).

    Args:
        args: the namespace from `parse_args`.
        defaults: script defaults (e.g. {'tokenizer_type': 'GPT2BPETokenizer'}), applied only to
            args that are still None.

    Raises:
        ValueError: naming the flags and the numbers, for any inconsistent combination.

    Returns:
        args, modified in place.
    """
    # Flags of features this package does not have: refuse any non-default value first.
    from megatron.training.cli.arguments_parser import get_args_parser

    check_unsupported_flags(args, get_args_parser())
    validate_float_flags(args, get_args_parser())
    validate_observability_args(args)
    validate_parallel_sizes(args)
    refuse_removed_flags(args)
    apply_script_defaults(args, defaults)
    apply_vision_defaults(args, defaults)
    select_distributed_backend(args)
    select_transformer_impl(args)
    validate_batch_sizes(args)
    validate_virtual_pipeline(args)
    validate_fsdp_args(args)
    validate_distributed_optimizer(args)
    validate_mixed_precision(args)
    reset_sample_counters(args)
    validate_training_length(args)
    validate_network_sizes(args)
    validate_sequence_lengths(args)
    validate_learning_rate(args)
    validate_save_interval(args)
    validate_weight_decay(args)
    validate_recompute(args)
    validate_sequence_parallel(args)
    validate_context_parallel_args(args)
    validate_data_and_logging(args)
    validate_moe_args(args)
    validate_mla_args(args)
    validate_mamba_args(args)
    validate_megatron_r08_extras(args)
    validate_dist_checkpoint_args(args)
    validate_sft_and_fim_args(args)
    validate_vision_args(args, defaults)
    validate_timing_log_level(args)
    validate_resilience_args(args)
    _print_args('arguments', args)
    return args


def _print_args(title, args):
    """Print the arguments, sorted case-insensitively, dots padding each name to 48 characters."""
    if args.rank == 0:
        print(f'------------------------ {title} ------------------------', flush=True)
        str_list = []
        for arg in vars(args):
            dots = '.' * (48 - len(arg))
            str_list.append('  {} {} {}'.format(arg, dots, getattr(args, arg)))
        for arg in sorted(str_list, key=lambda x: x.lower()):
            print(arg, flush=True)
        print(f'-------------------- end of {title} ---------------------', flush=True)


def validate_encoder_decoder_args(args):
    """Rules for encoder-decoder (T5) models, checked by `pretrain` before the model is built.

    Raises:
        ValueError: naming the flag and the numbers.
    """
    if args.decoder_seq_length is None:
        raise ValueError('--decoder-seq-length is required for encoder-decoder (T5) models')
    if args.virtual_pipeline_model_parallel_size is not None:
        raise ValueError(
            '--num-layers-per-virtual-pipeline-stage: interleaved (virtual) pipelines are not '
            'supported for encoder-decoder (T5) models'
        )
    if args.decoder_num_layers is None:
        note(
            args,
            '--decoder-num-layers not given: using --encoder-num-layers '
            f'({args.encoder_num_layers})',
        )
        args.decoder_num_layers = args.encoder_num_layers
    pp, split = args.pipeline_model_parallel_size, args.pipeline_model_parallel_split_rank
    if pp > 1:
        if split is None:
            raise ValueError(
                f'--pipeline-model-parallel-split-rank is required with '
                f'--pipeline-model-parallel-size {pp} for encoder-decoder (T5) models'
            )
        if args.encoder_num_layers % split != 0:
            raise ValueError(
                f'--encoder-num-layers ({args.encoder_num_layers}) is not divisible by the '
                f'{split} encoder stages (--pipeline-model-parallel-split-rank {split})'
            )
        if args.decoder_num_layers % (pp - split) != 0:
            raise ValueError(
                f'--decoder-num-layers ({args.decoder_num_layers}) is not divisible by the '
                f'{pp - split} decoder stages (--pipeline-model-parallel-size {pp} - '
                f'--pipeline-model-parallel-split-rank {split})'
            )
    has_data = any(
        getattr(args, name, None)
        for name in ('data_path', 'train_data_path', 'valid_data_path', 'test_data_path')
    )
    if has_data and args.vocab_extra_ids <= 0:
        raise ValueError(
            f'--vocab-extra-ids ({args.vocab_extra_ids}) must be > 0 for T5 data: the '
            'span-corruption sentinels <extra_id_i> come from it (Megatron uses 100)'
        )
    if has_data:
        # Each masked span takes one sentinel; a sample of L tokens (the encoder length minus
        # [BOS] and [EOS]) has at most ceil(mask_prob x L) masked tokens, hence spans.
        spans = max(1, math.ceil(args.mask_prob * (args.encoder_seq_length - 2)))
        if args.vocab_extra_ids < spans:
            raise ValueError(
                f'--vocab-extra-ids ({args.vocab_extra_ids}) is fewer than the masked spans a T5 '
                f'sample can have: up to ceil(--mask-prob {args.mask_prob} x '
                f'(--encoder-seq-length {args.encoder_seq_length} - 2)) = {spans}, one sentinel '
                f'each; pass --vocab-extra-ids {spans} or more (Megatron uses 100)'
            )
    return args
