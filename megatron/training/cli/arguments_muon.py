"""Flags of the Muon optimizer (`--optimizer muon`, later Megatron's v0.16 names and defaults)
and their start-up checks."""


def _add_muon_args(parser):
    group = parser.add_argument_group(title='muon')
    group.add_argument('--muon-momentum', type=float, default=0.9, help='Muon momentum.')
    group.add_argument(
        '--muon-nesterov',
        '--muon-use-nesterov',
        action='store_true',
        dest='muon_nesterov',
        help='Nesterov momentum for Muon.',
    )
    group.add_argument(
        '--muon-no-split-qkv',
        action='store_true',
        help='Orthogonalise the fused QKV weight as one matrix instead of q, k and v apart.',
    )
    group.add_argument(
        '--muon-scale-mode',
        type=str,
        default='spectral',
        choices=['spectral', 'unit_rms_norm', 'shape_scaling'],
        help='Scale of the orthogonalised update.',
    )
    group.add_argument(
        '--muon-fp32-matmul-prec',
        type=str,
        default='medium',
        choices=['low', 'medium', 'high'],
        help='Precision of the Newton-Schulz iterations.',
    )
    group.add_argument('--muon-num-ns-steps', type=int, default=5, help='Newton-Schulz iterations.')
    group.add_argument(
        '--muon-tp-mode',
        type=str,
        default='duplicated',
        choices=['blockwise', 'duplicated'],
        help='Tensor-parallel weights: orthogonalise the whole matrix (duplicated) or each '
        'shard (blockwise).',
    )
    group.add_argument(
        '--muon-extra-scale-factor', type=float, default=1.0, help='Extra factor on the update.'
    )
    group.add_argument(
        '--qk-clip',
        action='store_true',
        help='After each step, rescale the query/key weights of heads whose largest attention '
        'logit exceeded --qk-clip-threshold.',
    )
    group.add_argument(
        '--qk-clip-alpha',
        type=float,
        default=0.5,
        help='Share of the QK-clip rescaling put on the queries (keys: 1 - alpha).',
    )
    group.add_argument(
        '--qk-clip-threshold', type=float, default=100.0, help='Largest attention logit allowed.'
    )
    return parser


def validate_qk_clip_args(args):
    """--qk-clip: alpha in (0, 1), a positive threshold, weights the optimizer steps in place."""
    if not args.qk_clip:
        return
    if not 0.0 < args.qk_clip_alpha < 1.0:
        raise ValueError(f'--qk-clip-alpha must be in (0, 1), got {args.qk_clip_alpha}')
    if args.qk_clip_threshold <= 0:
        raise ValueError(f'--qk-clip-threshold must be positive, got {args.qk_clip_threshold}')
    for flag, value in (
        ('--bf16', args.bf16),
        ('--fp16', args.fp16),
        ('--use-distributed-optimizer', args.use_distributed_optimizer),
    ):
        if value:
            raise ValueError(
                f'--qk-clip with {flag} is not supported (the clip rescales the model\'s own fp32 '
                'weights, which that optimizer does not step)'
            )


def validate_muon_args(args):
    """--optimizer muon with the flags it cannot run with (one ValueError line); --qk-clip."""
    validate_qk_clip_args(args)
    if args.optimizer != 'muon':
        return
    if args.use_distributed_optimizer:
        raise ValueError(
            '--optimizer muon with --use-distributed-optimizer is not supported (the '
            'distributed optimizer shards the matrices Muon orthogonalises)'
        )
    if args.fp16:
        raise ValueError('--optimizer muon with --fp16 is not supported (use --bf16 or fp32)')
    if args.muon_num_ns_steps < 1:
        raise ValueError(f'--muon-num-ns-steps must be positive, got {args.muon_num_ns_steps}')
    if not 0.0 <= args.muon_momentum < 1.0:
        raise ValueError(f'--muon-momentum must be in [0, 1), got {args.muon_momentum}')
