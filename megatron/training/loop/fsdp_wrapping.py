"""get_model's fully-sharded branch: wrap each model chunk in TorchFullyShardedDataParallel
(`--use-torch-fsdp2`) with the mixed-precision policy the run's flags ask for."""

import torch

from megatron.core.utils import get_model_config


def uses_torch_fsdp2(args) -> bool:
    """Whether get_model wraps the chunks in FSDP2 instead of DistributedDataParallel."""
    return bool(getattr(args, 'use_torch_fsdp2', False))


def keeps_fp32_params(args) -> bool:
    """FSDP2's default bf16 layout: fp32 sharded parameters (the optimizer's master copy), bf16
    compute through the mixed-precision policy, so no Float16Module cast."""
    return uses_torch_fsdp2(args) and args.bf16 and not args.torch_fsdp2_reduce_in_bf16


def fsdp2_config_from_args(args):
    """The TorchFullyShardedDataParallelConfig of the run."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallelConfig,
    )

    if keeps_fp32_params(args):
        return TorchFullyShardedDataParallelConfig(
            reshard_after_forward=args.torch_fsdp2_reshard_after_forward,
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            output_dtype=torch.float32,
        )
    # fp32 runs, and --torch-fsdp2-reduce-in-bf16 (bf16 parameters, reduce in bf16).
    return TorchFullyShardedDataParallelConfig(
        reshard_after_forward=args.torch_fsdp2_reshard_after_forward
    )


def wrap_with_torch_fsdp2(args, model):
    """Wrap every chunk of `model` (a list) in TorchFullyShardedDataParallel."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )

    fsdp_config = fsdp2_config_from_args(args)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=fsdp_config.reduce_dtype == torch.float32,
        average_in_collective=args.ddp_average_in_collective,
    )
    wrapped = []
    for chunk in model:
        if keeps_fp32_params(args):
            chunk.float()
        wrapped.append(
            TorchFullyShardedDataParallel(
                get_model_config(chunk), ddp_config, chunk, fsdp_config=fsdp_config
            )
        )
    if args.data_parallel_random_init:
        for chunk in wrapped:
            chunk.broadcast_params()
    return wrapped
