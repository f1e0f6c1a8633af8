"""Start-up checks of the observability flags: Weights & Biases and the profiler.

`validate_observability_args(args)` is called by `validate_args`, so a bad combination stops the
job with one line before any work starts (rather than, as in Megatron, after the model is built
or never: Megatron's wandb writer needs --tensorboard-dir to log anything and crashes without
--save when --wandb-save-dir is empty).
"""

import importlib.util

from megatron.core.device import uses_cuda


def wandb_is_installed() -> bool:
    """True when the optional `wandb` package can be imported (`pip install -e .[wandb]`)."""
    return importlib.util.find_spec('wandb') is not None


def _validate_wandb_args(args):
    if not getattr(args, 'wandb_project', ''):
        return
    if not wandb_is_installed():
        raise ValueError(
            f'--wandb-project {args.wandb_project} needs the wandb package, which is not '
            'installed: pip install wandb (or pip install -e .[wandb])'
        )
    try:
        import wandb  # noqa: F401  (installed is not enough: a broken install fails here)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [''])[0]
        raise ValueError(
            f'--wandb-project {args.wandb_project}: the wandb package fails on import '
            f'({type(exc).__name__}: {reason}); repair it (pip install --force-reinstall wandb) '
            'or drop --wandb-project'
        ) from None
    if not args.wandb_exp_name:
        raise ValueError(
            f'--wandb-project {args.wandb_project} needs --wandb-exp-name (the run name)'
        )
    if not args.wandb_save_dir and not args.save:
        raise ValueError(
            f'--wandb-project {args.wandb_project} needs --wandb-save-dir, or --save (the run is '
            'then written to <save>/wandb)'
        )


def _validate_profile_args(args):
    if getattr(args, 'use_pytorch_profiler', False) and not args.profile:
        raise ValueError('--use-pytorch-profiler does nothing without --profile')
    if not args.profile:
        return
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ValueError(
            f'--profile-step-start ({args.profile_step_start}) must be >= 0 and below '
            f'--profile-step-end ({args.profile_step_end})'
        )
    bad_ranks = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
    if bad_ranks:
        raise ValueError(
            f'--profile-ranks {bad_ranks} are not global ranks of this job (world size '
            f'{args.world_size})'
        )
    if args.use_pytorch_profiler:
        if not args.tensorboard_dir:
            raise ValueError(
                '--profile --use-pytorch-profiler writes its trace to --tensorboard-dir; set it'
            )
    elif not uses_cuda(args.distributed_backend):
        raise ValueError(
            '--profile without --use-pytorch-profiler opens a CUDA profiler range for nsys, '
            'which needs a GPU (and NCCL); add --use-pytorch-profiler for a torch profiler trace'
        )


def validate_observability_args(args):
    """Check the wandb and profiler flags (one-line ValueErrors naming the flags)."""
    _validate_wandb_args(args)
    _validate_profile_args(args)
