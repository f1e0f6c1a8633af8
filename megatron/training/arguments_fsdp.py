"""Flags of fully sharded data parallelism: PyTorch FSDP2 (`--use-torch-fsdp2`, Megatron v0.10+
names) and its options. Rules live in argument_validation_fsdp.py."""


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
    return parser
