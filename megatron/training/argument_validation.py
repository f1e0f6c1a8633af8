"""`validate_args`: Megatron's cross-flag rules, checked before any work starts.

Each rule fails with a one-line `ValueError` naming the flags and the numbers; the function also
derives the values the rest of the training layer reads (`data_parallel_size`, `params_dtype`, ...).
Re-exported by `arguments.py`, where Megatron users import it from.
"""

import math

import torch

from megatron.core.utils import uses_cuda
from megatron.training.argument_validation_moe import validate_moe_args
from megatron.training.argument_validation_sft_fim import validate_sft_and_fim_args
from megatron.training.arguments_unsupported import check_unsupported_flags
from megatron.training.context_parallel_checks import validate_context_parallel_args
from megatron.training.dist_checkpoint_args import validate_dist_checkpoint_args
from megatron.training.observability_args import validate_observability_args


def _note(args, message):
    """A rank-0 note about a flag that was adjusted or has no effect here."""
    if args.rank == 0:
        print(f'NOTE: {message}', flush=True)


def validate_args(args, defaults={}):
    """Check cross-flag rules and derive dependent args, before any work starts.

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
    from megatron.training.arguments_parser import get_args_parser

    check_unsupported_flags(args, get_args_parser())
    validate_observability_args(args)

    # Model-parallel sizes against the world size.
    if args.tensor_model_parallel_size < 1 or args.pipeline_model_parallel_size < 1:
        raise ValueError(
            f'--tensor-model-parallel-size ({args.tensor_model_parallel_size}) and '
            f'--pipeline-model-parallel-size ({args.pipeline_model_parallel_size}) must be >= 1'
        )
    if args.context_parallel_size < 1:
        raise ValueError(f'--context-parallel-size ({args.context_parallel_size}) must be >= 1')
    model_parallel_size = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if args.world_size % model_parallel_size != 0:
        raise ValueError(
            f'world size ({args.world_size}) is not divisible by --tensor-model-parallel-size '
            f'({args.tensor_model_parallel_size}) x --pipeline-model-parallel-size '
            f'({args.pipeline_model_parallel_size}) x --context-parallel-size '
            f'({args.context_parallel_size}) = {model_parallel_size}'
        )
    args.data_parallel_size = args.world_size // model_parallel_size
    if args.expert_model_parallel_size > 1:
        if args.num_experts is None:
            raise ValueError('--expert-model-parallel-size > 1 requires --num-experts')
        if args.num_experts % args.expert_model_parallel_size != 0:
            raise ValueError(
                f'--num-experts ({args.num_experts}) must be divisible by '
                f'--expert-model-parallel-size ({args.expert_model_parallel_size})'
            )
        if args.data_parallel_size * args.context_parallel_size % args.expert_model_parallel_size:
            raise ValueError(
                f'data parallel size ({args.data_parallel_size}) x --context-parallel-size '
                f'({args.context_parallel_size}) must be divisible by --expert-model-parallel-size '
                f'({args.expert_model_parallel_size})'
            )
    if args.rank == 0:
        print(
            'using world size: {}, data-parallel size: {}, context-parallel size: {} '
            'tensor-model-parallel size: {}, pipeline-model-parallel size: {} '.format(
                args.world_size,
                args.data_parallel_size,
                args.context_parallel_size,
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
            ),
            flush=True,
        )
    if args.pipeline_model_parallel_split_rank is not None:
        if args.pipeline_model_parallel_size == 1:
            raise ValueError(
                f'--pipeline-model-parallel-split-rank ({args.pipeline_model_parallel_split_rank}) '
                'needs --pipeline-model-parallel-size > 1 (got 1)'
            )
        if args.pipeline_model_parallel_split_rank < 1:
            raise ValueError(
                f'--pipeline-model-parallel-split-rank ({args.pipeline_model_parallel_split_rank}) '
                'must be >= 1 (the stages before it hold the encoder)'
            )
        if args.pipeline_model_parallel_split_rank >= args.pipeline_model_parallel_size:
            raise ValueError(
                f'--pipeline-model-parallel-split-rank ({args.pipeline_model_parallel_split_rank}) '
                f'must be < --pipeline-model-parallel-size ({args.pipeline_model_parallel_size})'
            )

    # Removed flags.
    for removed, name in (
        ('batch_size', '--batch-size'),
        ('warmup', '--warmup'),
        ('model_parallel_size', '--model-parallel-size'),
    ):
        if getattr(args, removed, None) is not None:
            raise ValueError(f'{name} is no longer supported; see --help for its replacement')
    if args.checkpoint_activations:
        raise ValueError(
            '--checkpoint-activations is no longer supported; use --recompute-activations '
            '(selective) or --recompute-granularity full --recompute-method uniform|block'
        )

    # Script defaults fill args that are still None.
    for key, value in defaults.items():
        if getattr(args, key, None) is not None:
            if args.rank == 0:
                print(
                    'WARNING: overriding default arguments for {key}:{v} with {key}:{v2}'.format(
                        key=key, v=value, v2=getattr(args, key)
                    ),
                    flush=True,
                )
        else:
            setattr(args, key, value)

    # Backend: nccl needs CUDA. Without a GPU we fall back to gloo (and say so).
    if args.distributed_backend == 'nccl' and not uses_cuda('nccl'):
        _note(args, 'no CUDA device found: --distributed-backend nccl -> gloo')
        args.distributed_backend = 'gloo'
    if args.transformer_impl == 'transformer_engine':
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            _note(args, 'transformer_engine is not installed: --transformer-impl -> local')
            args.transformer_impl = 'local'
    if args.use_legacy_models:
        raise ValueError('--use-legacy-models: only the megatron.core models exist in this package')

    # Batch sizes.
    if args.micro_batch_size is None or args.micro_batch_size <= 0:
        raise ValueError(
            f'--micro-batch-size must be a positive integer, got {args.micro_batch_size}'
        )
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
        if args.rank == 0:
            print(f'setting global batch size to {args.global_batch_size}', flush=True)
    if args.global_batch_size <= 0:
        raise ValueError(f'--global-batch-size must be positive, got {args.global_batch_size}')
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) != 0:
        raise ValueError(
            f'--global-batch-size ({args.global_batch_size}) is not divisible by '
            f'--micro-batch-size ({args.micro_batch_size}) x data parallel size '
            f'({args.data_parallel_size}) = {args.micro_batch_size * args.data_parallel_size}'
        )
    if args.rampup_batch_size is not None:
        if len(args.rampup_batch_size) != 3:
            raise ValueError(
                '--rampup-batch-size expects 3 values <start batch size> <batch size increment> '
                f'<ramp-up samples>, got {args.rampup_batch_size}'
            )

    # Virtual pipeline.
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.pipeline_model_parallel_split_rank is not None:
            raise ValueError(
                '--num-layers-per-virtual-pipeline-stage: interleaved (virtual) pipelines are not '
                'supported for encoder-decoder models (--pipeline-model-parallel-split-rank '
                f'{args.pipeline_model_parallel_split_rank})'
            )
        if args.pipeline_model_parallel_size <= 1:
            raise ValueError(
                '--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1, '
                f'got {args.pipeline_model_parallel_size}'
            )
        if args.num_layers is None or args.num_layers % args.pipeline_model_parallel_size != 0:
            raise ValueError(
                f'--num-layers ({args.num_layers}) must be divisible by '
                f'--pipeline-model-parallel-size ({args.pipeline_model_parallel_size}) '
                'with the interleaved schedule'
            )
        layers_per_stage = args.num_layers // args.pipeline_model_parallel_size
        if layers_per_stage % args.num_layers_per_virtual_pipeline_stage != 0:
            raise ValueError(
                f'--num-layers ({args.num_layers}) / --pipeline-model-parallel-size '
                f'({args.pipeline_model_parallel_size}) = {layers_per_stage} layers per stage is '
                'not divisible by --num-layers-per-virtual-pipeline-stage '
                f'({args.num_layers_per_virtual_pipeline_stage})'
            )
        args.virtual_pipeline_model_parallel_size = (
            layers_per_stage // args.num_layers_per_virtual_pipeline_stage
        )
    else:
        args.virtual_pipeline_model_parallel_size = None
        # Overlapping p2p communication needs the interleaved schedule.
        args.overlap_p2p_comm = False

    # Distributed optimizer and overlap flags.
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError('--overlap-param-gather requires --use-distributed-optimizer')
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ValueError('--overlap-param-gather requires --overlap-grad-reduce')
    if args.use_distributed_optimizer and args.optimizer != 'adam' and args.optimizer != 'sgd':
        raise ValueError(f'--use-distributed-optimizer: unknown --optimizer {args.optimizer}')

    # Mixed precision.
    if args.fp16 and args.bf16:
        raise ValueError('--fp16 and --bf16 are mutually exclusive; pass at most one of them')
    args.params_dtype = torch.float
    if args.fp16:
        args.params_dtype = torch.half
    if args.bf16:
        args.params_dtype = torch.bfloat16
        # bfloat16 has too few mantissa bits to accumulate gradients: keep them in fp32.
        if not args.accumulate_allreduce_grads_in_fp32:
            args.accumulate_allreduce_grads_in_fp32 = True
            if args.rank == 0:
                print(
                    'accumulate and all-reduce gradients in fp32 for bfloat16 data type.',
                    flush=True,
                )
    if args.rank == 0:
        print('using {} for parameters ...'.format(args.params_dtype), flush=True)
    if args.fp16_lm_cross_entropy and not args.fp16:
        raise ValueError('--fp16-lm-cross-entropy requires --fp16')
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        raise ValueError('--fp32-residual-connection only makes sense with --fp16 or --bf16')
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ValueError(f'--loss-scale must be positive, got {args.loss_scale}')

    # Counters restored by checkpoint loading.
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0

    # Training length: iterations or samples, never both.
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError(
            f'--train-iters ({args.train_iters}) and --train-samples ({args.train_samples}) '
            'are mutually exclusive'
        )
    if args.train_iters is not None:
        if args.rampup_batch_size is not None:
            raise ValueError('--rampup-batch-size is only supported with --train-samples')
        for flag, value in (
            ('--lr-decay-samples', args.lr_decay_samples),
            ('--lr-warmup-samples', args.lr_warmup_samples),
            ('--lr-wsd-decay-samples', args.lr_wsd_decay_samples),
        ):
            if value not in (None, 0):
                raise ValueError(
                    f'{flag} ({value}) is not allowed with iteration-based --train-iters'
                )
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters != 0:
            raise ValueError(
                f'--lr-warmup-fraction ({args.lr_warmup_fraction}) and --lr-warmup-iters '
                f'({args.lr_warmup_iters}) are mutually exclusive'
            )
    if args.train_samples is not None:
        for flag, value in (
            ('--lr-decay-iters', args.lr_decay_iters),
            ('--lr-warmup-iters', args.lr_warmup_iters),
            ('--lr-wsd-decay-iters', args.lr_wsd_decay_iters),
        ):
            if value not in (None, 0):
                raise ValueError(
                    f'{flag} ({value}) is not allowed with sample-based --train-samples'
                )
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples != 0:
            raise ValueError(
                f'--lr-warmup-fraction ({args.lr_warmup_fraction}) and --lr-warmup-samples '
                f'({args.lr_warmup_samples}) are mutually exclusive'
            )

    # Required network sizes.
    if args.num_layers is not None and args.encoder_num_layers is not None:
        raise ValueError('--num-layers and --encoder-num-layers are mutually exclusive')
    if args.num_layers is None and args.encoder_num_layers is not None:
        args.num_layers = args.encoder_num_layers
    for flag, value in (
        ('--num-layers', args.num_layers),
        ('--hidden-size', args.hidden_size),
        ('--num-attention-heads', args.num_attention_heads),
        ('--max-position-embeddings', args.max_position_embeddings),
    ):
        if value is None:
            raise ValueError(f'{flag} is required')
        if value <= 0:
            raise ValueError(f'{flag} must be positive, got {value}')
    if args.encoder_num_layers is None:
        args.encoder_num_layers = args.num_layers
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        raise ValueError(
            f'--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads '
            f'({args.num_attention_heads}); pass --kv-channels'
        )
    if args.num_attention_heads % args.tensor_model_parallel_size != 0:
        raise ValueError(
            f'--num-attention-heads ({args.num_attention_heads}) is not divisible by '
            f'--tensor-model-parallel-size ({args.tensor_model_parallel_size})'
        )
    if args.group_query_attention and args.num_query_groups % args.tensor_model_parallel_size:
        raise ValueError(
            f'--num-query-groups ({args.num_query_groups}) is not divisible by '
            f'--tensor-model-parallel-size ({args.tensor_model_parallel_size})'
        )
    if (
        args.num_layers % args.pipeline_model_parallel_size != 0
        and args.pipeline_model_parallel_split_rank is None
    ):
        raise ValueError(
            f'--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size '
            f'({args.pipeline_model_parallel_size})'
        )
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Keep the parameter count of a 4h MLP with a gated unit, rounded to a multiple of 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads

    # Sequence lengths.
    if args.seq_length is not None and args.encoder_seq_length is not None:
        raise ValueError('--seq-length and --encoder-seq-length are mutually exclusive')
    if args.seq_length is not None:
        args.encoder_seq_length = args.seq_length
    else:
        args.seq_length = args.encoder_seq_length
    if args.seq_length is not None:
        if args.seq_length <= 0:
            raise ValueError(f'--seq-length must be positive, got {args.seq_length}')
        if args.position_embedding_type == 'learned_absolute' and (
            args.max_position_embeddings < args.seq_length
        ):
            raise ValueError(
                f'--max-position-embeddings ({args.max_position_embeddings}) must be >= '
                f'--seq-length ({args.seq_length})'
            )
    if (
        args.decoder_seq_length is not None
        and args.max_position_embeddings < args.decoder_seq_length
    ):
        raise ValueError(
            f'--max-position-embeddings ({args.max_position_embeddings}) must be >= '
            f'--decoder-seq-length ({args.decoder_seq_length})'
        )
    if args.seq_length is not None and args.context_parallel_size > 1:
        if args.seq_length % (2 * args.context_parallel_size) != 0:
            raise ValueError(
                f'--seq-length ({args.seq_length}) must be divisible by 2 x '
                f'--context-parallel-size ({args.context_parallel_size})'
            )
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = 'rope'
    if not args.add_position_embedding and args.position_embedding_type == 'learned_absolute':
        args.position_embedding_type = 'none'

    # Learning rate.
    if args.lr is not None and args.min_lr > args.lr:
        raise ValueError(f'--min-lr ({args.min_lr}) must be <= --lr ({args.lr})')
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ValueError(f'--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}')

    # Checkpointing.
    if args.save is not None and args.save_interval is None:
        raise ValueError('--save requires --save-interval')
    if args.save_interval is not None and args.save_interval <= 0:
        raise ValueError(f'--save-interval must be positive, got {args.save_interval}')

    # Weight decay schedule.
    if args.weight_decay_incr_style == 'constant':
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            if args.start_weight_decay != args.end_weight_decay:
                raise ValueError(
                    '--weight-decay-incr-style constant: --start-weight-decay '
                    f'({args.start_weight_decay}) and --end-weight-decay ({args.end_weight_decay}) '
                    'must be unset or equal'
                )
        args.start_weight_decay = args.weight_decay
        args.end_weight_decay = args.weight_decay
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            raise ValueError(
                f'--weight-decay-incr-style {args.weight_decay_incr_style} requires both '
                '--start-weight-decay and --end-weight-decay'
            )

    # Activation recomputation.
    if args.recompute_activations:
        args.recompute_granularity = 'selective'
    if args.recompute_granularity == 'selective' and args.recompute_method is not None:
        raise ValueError(
            f'--recompute-method ({args.recompute_method}) is only for --recompute-granularity full'
        )
    if args.recompute_granularity == 'full' and args.recompute_method is None:
        raise ValueError('--recompute-granularity full requires --recompute-method uniform|block')
    if args.recompute_method is not None and args.recompute_num_layers is None:
        raise ValueError(
            f'--recompute-method {args.recompute_method} requires --recompute-num-layers'
        )
    if args.distribute_saved_activations:
        if args.tensor_model_parallel_size == 1:
            raise ValueError(
                '--distribute-saved-activations requires --tensor-model-parallel-size > 1'
            )
        if args.recompute_granularity != 'full':
            raise ValueError('--distribute-saved-activations requires --recompute-granularity full')

    # Sequence parallelism is only meaningful with tensor parallelism.
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        _note(
            args, '--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled'
        )
        args.sequence_parallel = False
    if args.sequence_parallel:
        args.async_tensor_model_parallel_allreduce = False
    validate_context_parallel_args(args)

    # Data.
    if args.data_path is not None and args.split is None:
        args.split = '969, 30, 1'
    if args.data_path is not None and any(
        p is not None for p in (args.train_data_path, args.valid_data_path, args.test_data_path)
    ):
        raise ValueError('--data-path and --train/valid/test-data-path are mutually exclusive')
    if args.dataloader_type is None:
        args.dataloader_type = 'single'
    if args.eval_interval is not None and args.eval_interval <= 0:
        raise ValueError(f'--eval-interval must be positive, got {args.eval_interval}')
    if args.log_interval <= 0:
        raise ValueError(f'--log-interval must be positive, got {args.log_interval}')
    if args.tokenizer_type == 'NullTokenizer' and args.vocab_size is None:
        raise ValueError('--tokenizer-type NullTokenizer requires --vocab-size')

    validate_moe_args(args)

    _validate_megatron_r08_extras(args)
    validate_dist_checkpoint_args(args)
    validate_sft_and_fim_args(args)

    if args.timing_log_level not in (0, 1, 2):
        raise ValueError(f'--timing-log-level must be 0, 1 or 2, got {args.timing_log_level}')

    _print_args('arguments', args)
    return args


def _validate_megatron_r08_extras(args):
    """Rules of the flags added by Megatron core_r0.8.0 that this package accepts."""
    if getattr(args, 'ckpt_fully_parallel_save_deprecated', False) and args.rank == 0:
        print(
            '--ckpt-fully-parallel-save flag is deprecated and has no effect. Use '
            '--no-ckpt-fully-parallel-save to disable parallel save.',
            flush=True,
        )
    # Deferring the output layer's weight-gradient GEMM only matters with a pipeline flush.
    if getattr(args, 'defer_embedding_wgrad_compute', False):
        if args.pipeline_model_parallel_size == 1:
            args.defer_embedding_wgrad_compute = False
        elif not args.gradient_accumulation_fusion:
            raise ValueError(
                '--defer-embedding-wgrad-compute: cannot defer embedding wgrad compute when '
                'gradient accumulation fusion is not used (--no-gradient-accumulation-fusion)'
            )
        elif args.wgrad_deferral_limit < 0:
            raise ValueError(
                f'--wgrad-deferral-limit ({args.wgrad_deferral_limit}) should be greater than or '
                'equal to 0 when --defer-embedding-wgrad-compute is set'
            )
        else:
            raise ValueError(
                '--defer-embedding-wgrad-compute is not supported by this package with '
                f'--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: the '
                'deferred vocabulary-projection weight gradient at the pipeline flush is not '
                'implemented (the gradients would be the same; only the GPU overlap differs)'
            )
    interval = getattr(args, 'check_weight_hash_across_dp_replicas_interval', None)
    if interval is not None and interval <= 0:
        raise ValueError(
            f'--check-weight-hash-across-dp-replicas-interval must be positive, got {interval}'
        )
    if getattr(args, 'straggler_minmax_count', 1) < 1:
        raise ValueError(
            f'--straggler-minmax-count must be >= 1, got {args.straggler_minmax_count}'
        )


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
        _note(
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
