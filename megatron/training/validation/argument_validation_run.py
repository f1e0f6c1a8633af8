"""Rules of the run flags (`_add_training_args`, `_add_learning_rate_args`,
`_add_regularization_args` in `arguments_model.py`; `_add_checkpointing_args`, `_add_data_args`,
`_add_logging_args` in `arguments_run.py`).

Removed flags, the entry script's defaults, batch sizes, the training length (iterations or
samples), the learning-rate and weight-decay schedules, checkpoint intervals, data and logging,
and the flags Megatron core_r0.8.0 added. Each step is called by `validate_args` in its order (the
first failing rule is the one reported) and derives what it checks (`global_batch_size`,
`start_weight_decay`, `split`, ...).
"""


def refuse_removed_flags(args):
    """Flags Megatron removed: say what replaced them."""
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


def apply_script_defaults(args, defaults):
    """Script defaults fill args that are still None."""
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


def validate_batch_sizes(args):
    """Micro and global batch sizes; derive `global_batch_size` when not given."""
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
    step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % step != 0 and args.decrease_batch_size_if_needed:
        # Later Megatron's rule: train on the largest multiple of micro x DP below the request.
        decreased = (args.global_batch_size // step) * step
        if decreased == 0 or args.rampup_batch_size is not None:
            raise ValueError(
                f'--decrease-batch-size-if-needed: --global-batch-size ({args.global_batch_size}) '
                f'is below --micro-batch-size ({args.micro_batch_size}) x data parallel size '
                f'({args.data_parallel_size}) = {step}, or used with --rampup-batch-size'
            )
        if args.rank == 0:
            print(
                f'decreasing batch size from {args.global_batch_size} to {decreased} to keep '
                f'divisiblity by micro_batch_size={args.micro_batch_size} * '
                f'data_parallel_size={args.data_parallel_size}',
                flush=True,
            )
        args.global_batch_size = decreased
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


def reset_sample_counters(args):
    """Counters restored by checkpoint loading."""
    args.consumed_train_samples = 0
    args.consumed_valid_samples = 0


def validate_training_length(args):
    """Training length: iterations or samples, never both, with schedule flags of the same kind."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError(
            f'--train-iters ({args.train_iters}) and --train-samples ({args.train_samples}) '
            'are mutually exclusive'
        )
    if args.train_iters is not None:
        _check_iteration_based_schedule(args)
    if args.train_samples is not None:
        _check_sample_based_schedule(args)


def _check_iteration_based_schedule(args):
    if args.rampup_batch_size is not None:
        raise ValueError('--rampup-batch-size is only supported with --train-samples')
    for flag, value in (
        ('--lr-decay-samples', args.lr_decay_samples),
        ('--lr-warmup-samples', args.lr_warmup_samples),
        ('--lr-wsd-decay-samples', args.lr_wsd_decay_samples),
    ):
        if value not in (None, 0):
            raise ValueError(f'{flag} ({value}) is not allowed with iteration-based --train-iters')
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters != 0:
        raise ValueError(
            f'--lr-warmup-fraction ({args.lr_warmup_fraction}) and --lr-warmup-iters '
            f'({args.lr_warmup_iters}) are mutually exclusive'
        )


def _check_sample_based_schedule(args):
    for flag, value in (
        ('--lr-decay-iters', args.lr_decay_iters),
        ('--lr-warmup-iters', args.lr_warmup_iters),
        ('--lr-wsd-decay-iters', args.lr_wsd_decay_iters),
    ):
        if value not in (None, 0):
            raise ValueError(f'{flag} ({value}) is not allowed with sample-based --train-samples')
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples != 0:
        raise ValueError(
            f'--lr-warmup-fraction ({args.lr_warmup_fraction}) and --lr-warmup-samples '
            f'({args.lr_warmup_samples}) are mutually exclusive'
        )


def validate_learning_rate(args):
    if args.lr is not None and args.min_lr > args.lr:
        raise ValueError(f'--min-lr ({args.min_lr}) must be <= --lr ({args.lr})')
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ValueError(f'--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}')


def validate_save_interval(args):
    if args.save is not None and args.save_interval is None:
        raise ValueError('--save requires --save-interval')
    if args.save_interval is not None and args.save_interval < 0:
        raise ValueError(f'--save-interval must be positive, got {args.save_interval}')


def validate_weight_decay(args):
    """The weight-decay schedule; derive its start and end values for the constant style."""
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


def validate_data_and_logging(args):
    """Data paths and split, the dataloader, eval and log intervals, the tokenizer's vocabulary."""
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


def validate_megatron_r08_extras(args):
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


def validate_timing_log_level(args):
    if args.timing_log_level not in (0, 1, 2):
        raise ValueError(f'--timing-log-level must be 0, 1 or 2, got {args.timing_log_level}')
