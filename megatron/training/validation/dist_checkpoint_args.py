"""Rules of the distributed-checkpoint flags (called from `validate_args`).

- `--ckpt-format torch_dist` (later Megatron) and `--use-dist-ckpt` (r0.8) mean the same:
  `args.use_dist_ckpt` and `args.ckpt_format` are both set. The torch format stays the default.
- `--ckpt-format fsdp_dtensor` (later Megatron's FSDP format name) is read as torch_dist: the
  same files, loadable with or without FSDP.
- `--dist-ckpt-format zarr` (deprecated in Megatron) is refused: only torch_dist exists here.
- `--async-save` needs the torch_dist format when the run saves (Megatron fails at the first
  save; here before any work starts).
- Without fully parallel save the distributed optimizer state is gathered on DP rank 0 and
  cannot be resharded: Megatron's warning is printed.
"""

_NOT_RESHARDABLE_WARNING = (
    'Warning: With non-parallel ckpt save and DistributedOptimizer, it will be impossible to '
    'resume training with different parallelism. Consider removing flag '
    '--no-ckpt-fully-parallel-save.'
)


def validate_dist_checkpoint_args(args) -> None:
    """Derive `use_dist_ckpt` / `ckpt_format`; one-line ValueErrors naming the flags."""
    if getattr(args, 'ckpt_format', None) == 'fsdp_dtensor':
        # Later Megatron's name of its FSDP checkpoints: here the same torch_dist files (FSDP2
        # shards are stored under the plain model keys, see dist_checkpointing/dtensor.py).
        args.ckpt_format = 'torch_dist'
    if getattr(args, 'ckpt_format', None) is None:
        args.ckpt_format = 'torch_dist' if args.use_dist_ckpt else 'torch'
    elif args.ckpt_format == 'torch' and args.use_dist_ckpt:
        raise ValueError('--ckpt-format torch contradicts --use-dist-ckpt (torch_dist)')
    args.use_dist_ckpt = args.ckpt_format == 'torch_dist'

    if args.use_dist_ckpt and args.dist_ckpt_format != 'torch_dist':
        raise ValueError(
            f'--dist-ckpt-format {args.dist_ckpt_format}: only torch_dist is supported (zarr is '
            f'deprecated in Megatron and not implemented here)'
        )
    if args.use_dist_ckpt and getattr(args, 'num_experts', None) and args.moe_extended_tp:
        raise ValueError(
            '--moe-extended-tp with --use-dist-ckpt (--ckpt-format torch_dist): experts split '
            'over tensor x expert parallel ranks have no distributed-checkpoint layout (as in '
            'Megatron); use --ckpt-format torch'
        )
    if args.async_save and args.save and not args.use_dist_ckpt:
        raise ValueError(
            '--async-save: async checkpoint save is not implemented for legacy (torch format) '
            'checkpoints; add --use-dist-ckpt (or --ckpt-format torch_dist)'
        )
    if (
        args.use_dist_ckpt
        and not args.ckpt_fully_parallel_save
        and args.use_distributed_optimizer
        and args.rank == 0
    ):
        print(_NOT_RESHARDABLE_WARNING, flush=True)
