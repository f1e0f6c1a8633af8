"""Rules of the fully-sharded data-parallel flags (`--use-torch-fsdp2`, `--use-megatron-fsdp`):
every combination whose result could not be exact is refused with one line before any work
starts. Megatron-FSDP's strategies are translated here into the engine that runs them:

- no_shard: DistributedDataParallel (everything replicated);
- optim: DDP with the distributed optimizer (ZeRO-1: reduce-scatter, sharded fp32 main
  params and optimizer state, all-gather of the updated params);
- optim_grads: FSDP2 without resharding after forward (one all-gather per unit and step,
  gradients reduce-scattered into shards);
- optim_grads_params: FSDP2 with resharding after forward (all-gather before forward and
  again before backward, with prefetch).
"""


def _needs_fsdp2(args):
    if not args.torch_fsdp2_reshard_after_forward:
        raise ValueError('--torch-fsdp2-no-reshard-after-forward requires --use-torch-fsdp2')
    if args.torch_fsdp2_reduce_in_bf16:
        raise ValueError('--torch-fsdp2-reduce-in-bf16 requires --use-torch-fsdp2')


def _translate_megatron_fsdp(args):
    """Map --use-megatron-fsdp's strategy onto our engines; return the flag text for errors."""
    strategy = args.data_parallel_sharding_strategy
    flag = f'--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}'
    if args.use_torch_fsdp2:
        raise ValueError('--use-torch-fsdp2 contradicts --use-megatron-fsdp: choose one FSDP path')
    _needs_fsdp2(args)
    if args.fp16 and strategy in ('optim_grads', 'optim_grads_params'):
        raise ValueError(f'{flag} is not supported with --fp16; use --bf16 or fp32')
    if strategy == 'no_shard':
        args.use_distributed_optimizer = False
    elif strategy == 'optim':
        args.use_distributed_optimizer = True
    else:
        # Megatron requires --use-distributed-optimizer here; FSDP2 shards the optimizer state
        # itself, so the flag is accepted and the plain optimizer runs on the shards.
        args.use_distributed_optimizer = False
        args.use_torch_fsdp2 = True
        args.torch_fsdp2_reshard_after_forward = strategy == 'optim_grads_params'
    return flag


def _dist_checkpoint_format(args) -> bool:
    """Whether the run saves torch_dist (runs before the checkpoint flags are normalised)."""
    fmt = getattr(args, 'ckpt_format', None)
    return fmt in ('torch_dist', 'fsdp_dtensor') or bool(getattr(args, 'use_dist_ckpt', False))


def _validate_hsdp(args, flag):
    """--num-distributed-optimizer-instances N: HSDP, N replicas of DP*CP / N shard ranks."""
    instances = getattr(args, 'num_distributed_optimizer_instances', 1)
    if instances == 1:
        return
    if instances < 1:
        raise ValueError(f'--num-distributed-optimizer-instances must be >= 1, got {instances}')
    if not getattr(args, 'use_torch_fsdp2', False):
        raise ValueError(
            f'--num-distributed-optimizer-instances {instances} requires --use-torch-fsdp2 (HSDP) '
            'or --use-megatron-fsdp with optim_grads / optim_grads_params: the partial '
            'distributed optimizer is not implemented'
        )
    dp_cp = args.data_parallel_size * args.context_parallel_size
    if dp_cp % instances != 0:
        raise ValueError(
            f'{flag} --num-distributed-optimizer-instances {instances} must divide the data x '
            f'context parallel size {dp_cp} (data-parallel {args.data_parallel_size} x '
            f'context-parallel {args.context_parallel_size})'
        )


def validate_fsdp_args(args):
    """Check the FSDP flags against the others (ValueError, one line); translate
    --use-megatron-fsdp into the engine of its strategy."""
    flag = '--use-torch-fsdp2'
    if getattr(args, 'use_megatron_fsdp', False):
        flag = _translate_megatron_fsdp(args)
    _validate_hsdp(args, flag)
    if not getattr(args, 'use_torch_fsdp2', False):
        if not getattr(args, 'use_megatron_fsdp', False):
            _needs_fsdp2(args)
        return
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        raise ValueError(
            f'{flag} requires PyTorch >= 2.4 (torch.distributed.fsdp.fully_shard)'
        ) from None
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f'{flag} is not supported with pipeline parallelism (--pipeline-model-parallel-size '
            f'{args.pipeline_model_parallel_size}): FSDP2 units would re-gather per micro-batch '
            'and the tied-embedding copy across stages is not sharded'
        )
    if getattr(args, 'expert_model_parallel_size', 1) > 1 and getattr(
        args, 'moe_extended_tp', False
    ):
        raise ValueError(
            f'{flag} is not supported with --moe-extended-tp (--expert-model-parallel-size '
            f'{args.expert_model_parallel_size}): not tested; experts are sharded over the '
            'expert-data-parallel group only with plain expert parallelism'
        )
    if args.test_mode:
        raise ValueError(
            f'--test-mode is not supported with {flag}: it compares replicated parameters across '
            'the data-parallel ranks, which FSDP2 shards'
        )
    if args.use_distributed_optimizer:
        raise ValueError(
            f'{flag} is not supported with --use-distributed-optimizer: FSDP2 already shards the '
            'optimizer state (the optimizer is built on the sharded parameters)'
        )
    if args.fp16:
        raise ValueError(
            f'{flag} is not supported with --fp16: the loss-scaled fp16 path needs fp16 '
            'parameters and an overflow check the FSDP2 reduce-scatter does not run; use --bf16 '
            'or fp32'
        )
    if args.torch_fsdp2_reduce_in_bf16 and not args.bf16:
        raise ValueError('--torch-fsdp2-reduce-in-bf16 requires --bf16')
    if (args.save is not None or args.load is not None) and not _dist_checkpoint_format(args):
        raise ValueError(
            f'{flag} requires --ckpt-format torch_dist (or --use-dist-ckpt, --ckpt-format '
            'fsdp_dtensor) with --save / --load: the legacy torch format is refused'
        )
    # The fused weight-gradient GEMM accumulates into `param.main_grad`, which FSDP2's sharded
    # parameters do not have; the unfused path gives the same gradients.
    args.gradient_accumulation_fusion = False
