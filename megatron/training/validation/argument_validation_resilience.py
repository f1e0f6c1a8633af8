"""Rules of the rerun state machine, non-persistent checkpoint and CPU-offload flags
(`arguments_resilience.py`, and the r0.8 non-persistent flags of the checkpointing group)."""

import math


def _validate_rerun(args):
    if args.error_injection_rate < 0:
        raise ValueError(
            f'--error-injection-rate must be >= 0 (0: no injection), '
            f'got {args.error_injection_rate}'
        )
    if args.error_injection_rate and args.rerun_mode == 'disabled':
        raise ValueError(
            f'--error-injection-rate {args.error_injection_rate} needs --rerun-mode '
            'validate_results (or report_stats): with the rerun state machine disabled no error '
            'is injected'
        )
    checks = args.check_for_nan_in_loss_and_grad or args.check_for_spiky_loss
    if args.error_injection_rate and not (checks or args.check_for_large_grads):
        raise ValueError(
            '--error-injection-rate needs a check to inject into: --check-for-spiky-loss, '
            '--check-for-large-grads, or the NaN check (on unless '
            '--no-check-for-nan-in-loss-and-grad)'
        )


def _validate_non_persistent(args):
    interval = args.non_persistent_save_interval
    kind = args.non_persistent_ckpt_type
    if interval is None:
        return
    if interval <= 0:
        raise ValueError(f'--non-persistent-save-interval must be positive, got {interval}')
    if kind is None:
        raise ValueError(
            f'--non-persistent-save-interval {interval} needs --non-persistent-ckpt-type '
            '(global or local)'
        )
    if kind == 'in_memory':
        raise ValueError(
            '--non-persistent-ckpt-type in_memory: Currently only global and local checkpoints '
            'are supported'
        )
    if args.save is None:
        raise ValueError(
            f'--non-persistent-save-interval {interval} needs --save (non-persistent '
            'checkpoints are saved only when --save is set)'
        )
    if kind == 'local' and args.non_persistent_local_ckpt_dir is None:
        raise ValueError(
            '--non-persistent-ckpt-type local: Tried to use local checkpointing without '
            'specifying --non-persistent-local-ckpt-dir!'
        )


def _validate_cpu_offload(args):
    fraction = args.optimizer_offload_fraction
    if not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
        raise ValueError(f'--optimizer-offload-fraction must be in [0, 1], got {fraction}')
    if not args.optimizer_cpu_offload:
        return
    if not args.use_distributed_optimizer:
        raise ValueError(
            '--optimizer-cpu-offload needs --use-distributed-optimizer (the offloaded state is '
            "the distributed optimizer's fp32 shard)"
        )
    if args.optimizer != 'adam':
        raise ValueError(
            f'--optimizer-cpu-offload supports --optimizer adam only, got {args.optimizer}'
        )


def validate_resilience_args(args):
    """Check the resilience flags (one-line ValueError naming the flag and its value)."""
    _validate_rerun(args)
    _validate_non_persistent(args)
    _validate_cpu_offload(args)
