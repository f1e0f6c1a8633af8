"""Rules of the fully-sharded data-parallel flags (`--use-torch-fsdp2`): every combination whose
result could not be exact is refused with one line before any work starts."""


def _needs_fsdp2(args):
    if not args.torch_fsdp2_reshard_after_forward:
        raise ValueError('--torch-fsdp2-no-reshard-after-forward requires --use-torch-fsdp2')
    if args.torch_fsdp2_reduce_in_bf16:
        raise ValueError('--torch-fsdp2-reduce-in-bf16 requires --use-torch-fsdp2')


def validate_fsdp_args(args):
    """Check --use-torch-fsdp2 against the other flags (ValueError, one line)."""
    if not getattr(args, 'use_torch_fsdp2', False):
        _needs_fsdp2(args)
        return
    flag = '--use-torch-fsdp2'
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
    if getattr(args, 'expert_model_parallel_size', 1) > 1:
        raise ValueError(
            f'{flag} is not supported with expert parallelism (--expert-model-parallel-size '
            f'{args.expert_model_parallel_size}): experts would need their own '
            'expert-data-parallel mesh'
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
    if getattr(args, 'use_megatron_fsdp', False):
        raise ValueError(f'{flag} contradicts --use-megatron-fsdp: choose one FSDP implementation')
    if args.save is not None or args.load is not None:
        raise ValueError(
            f'{flag}: checkpoints (--save / --load) of FSDP2-sharded models are not supported yet'
        )
    # The fused weight-gradient GEMM accumulates into `param.main_grad`, which FSDP2's sharded
    # parameters do not have; the unfused path gives the same gradients.
    args.gradient_accumulation_fusion = False
