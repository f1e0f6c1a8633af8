"""Flags of fully sharded data parallelism: PyTorch FSDP2 (`--use-torch-fsdp2`, Megatron v0.10+
names) and its options, and Megatron-FSDP's sharding strategies (`--use-megatron-fsdp`, v0.14+),
which are mapped onto DDP, the distributed optimizer or FSDP2 (docs/fsdp.md). Rules live in
argument_validation_fsdp.py."""

#: Megatron-FSDP's ZeRO levels, in order.
SHARDING_STRATEGIES = ('no_shard', 'optim', 'optim_grads', 'optim_grads_params')


def add_fsdp_args(parser):
    """Add the fully-sharded data-parallel flags to `parser`."""
    group = parser.add_argument_group(title='fully sharded data parallel')
    group.add_argument(
        '--use-torch-fsdp2',
        action='store_true',
        help='Shard parameters, gradients and optimizer state over the data-parallel group with '
        "PyTorch FSDP2 (torch.distributed.fsdp.fully_shard): each transformer layer, the "
        'embedding and the output layer are units gathered just in time. Gradients are '
        'reduced in fp32 unless --torch-fsdp2-reduce-in-bf16.',
    )
    group.add_argument(
        '--torch-fsdp2-no-reshard-after-forward',
        action='store_false',
        dest='torch_fsdp2_reshard_after_forward',
        help='Keep each unit\'s gathered parameters from its forward until its backward '
        '(ZeRO-2-like: one all-gather per unit and step instead of two, more memory).',
    )
    group.add_argument(
        '--torch-fsdp2-reduce-in-bf16',
        action='store_true',
        help="With --bf16: Megatron's FSDP2 numerics, bf16 parameters and no mixed-precision "
        'policy, so gradients are accumulated and reduce-scattered in bf16. By default the '
        'sharded parameters stay fp32, compute gathers them in bf16 and gradients are '
        'reduce-scattered in fp32.',
    )
    group.add_argument(
        '--num-distributed-optimizer-instances',
        type=int,
        default=1,
        help='With --use-torch-fsdp2 (or a --use-megatron-fsdp optim_grads* strategy): HSDP. '
        'The data x context parallel ranks form this many replicas of consecutive ranks; each '
        'replica shards the parameters, gradients and optimizer state over its own ranks, and '
        'the replicas all-reduce the gradient shards. Must divide the data x context parallel '
        'size.',
    )
    group.add_argument(
        '--use-megatron-fsdp',
        action='store_true',
        help='Megatron-FSDP: shard the training state over data-parallel ranks at the level '
        '--data-parallel-sharding-strategy names (no_shard = DDP, optim = the distributed '
        'optimizer, optim_grads and optim_grads_params = FSDP2 units).',
    )
    group.add_argument(
        '--data-parallel-sharding-strategy',
        type=str,
        default='optim_grads_params',
        choices=list(SHARDING_STRATEGIES),
        help='With --use-megatron-fsdp: what is sharded over data-parallel ranks: nothing, the '
        'optimizer state, also the gradients, or also the parameters (default, as Megatron '
        'v0.18+).',
    )
    return parser
