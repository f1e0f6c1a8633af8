"""The per-interval training log: Megatron's log line, TensorBoard scalars and memory reports.

`training_log` is called by the training loop (`megatron.training.training.train`) after every
iteration; it accumulates the losses and, every --log-interval iterations, prints the line built by
`format_log_line` (Megatron core_v0.8.0 format) and the timers. Every --tensorboard-log-interval
iterations it writes the scalars to TensorBoard and W&B (`scalar_writers.py`).
"""

import math
from datetime import datetime

import torch

from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import uses_cuda
from megatron.training.global_vars import get_args, get_timers
from megatron.training.logging.scalar_writers import get_scalar_writer
from megatron.training.logging.training_log_moe import log_moe_metrics
from megatron.training.logging.training_log_mtp import log_mtp_metrics
from megatron.training.theoretical_memory_usage import report_theoretical_memory
from megatron.training.utils import (
    _max_rss_bytes,
    _rss_bytes,
    num_floating_point_operations,
    print_rank_last,
    report_memory,
)

_TIMERS_TO_LOG = [
    'forward-backward',
    'forward-compute',
    'backward-compute',
    'batch-generator',
    'forward-recv',
    'forward-send',
    'backward-recv',
    'backward-send',
    'forward-send-forward-recv',
    'forward-send-backward-recv',
    'backward-send-forward-recv',
    'backward-send-backward-recv',
    'forward-backward-send-forward-backward-recv',
    'layernorm-grads-all-reduce',
    'embedding-grads-all-reduce',
    'all-grads-sync',
    'params-all-gather',
    'optimizer-copy-to-main-grad',
    'optimizer-unscale-and-check-inf',
    'optimizer-clip-main-grad',
    'optimizer-count-zeros',
    'optimizer-inner-step',
    'optimizer-copy-main-to-model-params',
    'optimizer',
]


def _format_tflops(tflops: float) -> str:
    """Megatron's one decimal from 10 TFLOP/s up; below, enough decimals for three significant
    digits, so that a CPU run (a fraction of a TFLOP/s) still reads as a figure, not 0.0."""
    if not math.isfinite(tflops) or tflops >= 10.0 or tflops <= 0.0:
        return f'{tflops:.1f}'
    decimals = min(9, max(1, 2 - math.floor(math.log10(tflops))))
    return f'{tflops:.{decimals}f}'


def format_log_line(
    iteration,
    train_iters,
    consumed_samples,
    elapsed_ms,
    learning_rate,
    batch_size,
    losses,
    loss_scale,
    grad_norm=None,
    num_zeros_in_grad=None,
    params_norm=None,
    skipped=0,
    nan=0,
    throughput=None,
    timestamp=None,
):
    """Megatron's per-interval training log line (core_v0.8.0 format).

    Args:
        losses: {key: average loss}; entries <= 0 are left out, as in Megatron.
        throughput: TFLOP/s per device, or None without --log-throughput.
        timestamp: datetime of the line (default now).
    """
    timestamp = timestamp or datetime.now()
    log_string = f" [{timestamp.strftime('%Y-%m-%d %H:%M:%S')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(consumed_samples)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_ms)
    if throughput is not None:
        log_string += f' throughput per GPU (TFLOP/s/GPU): {_format_tflops(throughput)} |'
    log_string += ' learning rate: {:.6E} |'.format(learning_rate)
    log_string += ' global batch size: {:5d} |'.format(batch_size)
    for key, avg in losses.items():
        if avg > 0.0:
            log_string += ' {}: {:.6E} |'.format(key, avg)
    log_string += ' loss scale: {:.1f} |'.format(loss_scale)
    if grad_norm is not None:
        log_string += ' grad norm: {:.3f} |'.format(grad_norm)
    if num_zeros_in_grad is not None:
        log_string += ' num zeros: {:.1f} |'.format(num_zeros_in_grad)
    if params_norm is not None:
        log_string += ' params norm: {:.3f} |'.format(params_norm)
    log_string += ' number of skipped iterations: {:3d} |'.format(skipped)
    log_string += ' number of nan iterations: {:3d} |'.format(nan)
    return log_string


def training_log(
    loss_dict,
    total_loss_dict,
    learning_rate,
    iteration,
    loss_scale,
    report_memory_flag,
    skipped_iter,
    grad_norm,
    params_norm,
    num_zeros_in_grad,
):
    """Accumulate losses and, every --log-interval iterations, print the log line and TB scalars."""
    args = get_args()
    timers = get_timers()
    writer = get_scalar_writer()  # TensorBoard and/or W&B, last rank only

    advanced_iters_key = 'advanced iterations'
    skipped_iters_key = 'skipped iterations'
    nan_iters_key = 'nan iterations'
    if not skipped_iter:
        total_loss_dict[advanced_iters_key] = total_loss_dict.get(advanced_iters_key, 0) + 1
    else:
        if advanced_iters_key not in total_loss_dict:
            total_loss_dict[advanced_iters_key] = 0
    total_loss_dict[skipped_iters_key] = total_loss_dict.get(skipped_iters_key, 0) + skipped_iter
    got_nan = False
    for key in loss_dict:
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + float(loss_dict[key])
        else:
            value = float(loss_dict[key])
            is_nan = value == float('inf') or value == -float('inf') or value != value
            got_nan = got_nan or is_nan
    total_loss_dict[nan_iters_key] = total_loss_dict.get(nan_iters_key, 0) + int(got_nan)

    timers_to_log = _TIMERS_TO_LOG
    batch_size = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()
    total_iterations = total_loss_dict[advanced_iters_key] + total_loss_dict[skipped_iters_key]

    # TensorBoard values.
    if writer and (iteration % args.tensorboard_log_interval == 0):
        if args.log_learning_rate_to_tensorboard:
            writer.add_scalar('learning-rate', learning_rate, iteration)
            writer.add_scalar(
                'learning-rate vs samples', learning_rate, args.consumed_train_samples
            )
        if args.log_batch_size_to_tensorboard:
            writer.add_scalar('batch-size', batch_size, iteration)
            writer.add_scalar('batch-size vs samples', batch_size, args.consumed_train_samples)
        for key in loss_dict:
            writer.add_scalar(key, float(loss_dict[key]), iteration)
            writer.add_scalar(
                key + ' vs samples', float(loss_dict[key]), args.consumed_train_samples
            )
        if args.log_loss_scale_to_tensorboard:
            writer.add_scalar('loss-scale', loss_scale, iteration)
            writer.add_scalar('loss-scale vs samples', loss_scale, args.consumed_train_samples)
        if args.log_world_size_to_tensorboard:
            writer.add_scalar('world-size', args.world_size, iteration)
            writer.add_scalar('world-size vs samples', args.world_size, args.consumed_train_samples)
        if grad_norm is not None:
            writer.add_scalar('grad-norm', grad_norm, iteration)
            writer.add_scalar('grad-norm vs samples', grad_norm, args.consumed_train_samples)
        if num_zeros_in_grad is not None:
            writer.add_scalar('num-zeros', num_zeros_in_grad, iteration)
            writer.add_scalar(
                'num-zeros vs samples', num_zeros_in_grad, args.consumed_train_samples
            )
        if params_norm is not None:
            writer.add_scalar('params-norm', params_norm, iteration)
            writer.add_scalar('params-norm vs samples', params_norm, args.consumed_train_samples)
        if args.log_memory_to_tensorboard and uses_cuda():
            mem_stats = torch.cuda.memory_stats()
            writer.add_scalar(
                'mem-reserved-bytes', mem_stats['reserved_bytes.all.current'], iteration
            )
            writer.add_scalar(
                'mem-allocated-bytes', mem_stats['allocated_bytes.all.current'], iteration
            )
            writer.add_scalar('mem-allocated-count', mem_stats['allocation.all.current'], iteration)
        elif args.log_memory_to_tensorboard:
            # CPU run: no caching allocator; the process's resident set is what grows.
            writer.add_scalar('mem-rss-bytes', _rss_bytes(), iteration)
            writer.add_scalar('mem-max-rss-bytes', _max_rss_bytes(), iteration)
    log_moe_metrics(args, iteration, writer, total_loss_dict)
    log_mtp_metrics(args, iteration, writer, total_loss_dict)
    if args.log_timers_to_tensorboard and (iteration % args.tensorboard_log_interval == 0):
        # reset=False: the log line below still reports these timers (Megatron resets here, so
        # its log line shows zeros with --log-timers-to-tensorboard).
        timers.write(timers_to_log, writer, iteration, normalizer=total_iterations, reset=False)

    if iteration % args.log_interval == 0:
        elapsed_time = timers('interval-time').elapsed(barrier=True)
        elapsed_time_per_iteration = elapsed_time / max(total_iterations, 1)
        throughput = num_floating_point_operations(args, batch_size) / (
            elapsed_time_per_iteration * 10**12 * args.world_size
        )
        if writer and args.log_timers_to_tensorboard:
            writer.add_scalar('iteration-time', elapsed_time_per_iteration, iteration)
            if args.log_throughput:
                writer.add_scalar('throughput', throughput, iteration)
        losses = {}
        for key in list(total_loss_dict.keys()):
            if key not in (advanced_iters_key, skipped_iters_key, nan_iters_key):
                losses[key] = total_loss_dict[key] / float(
                    max(1, total_loss_dict[advanced_iters_key])
                )
                total_loss_dict[key] = 0.0
        log_string = format_log_line(
            iteration,
            args.train_iters,
            args.consumed_train_samples,
            elapsed_time_per_iteration * 1000.0,
            learning_rate,
            batch_size,
            losses,
            loss_scale,
            grad_norm=grad_norm,
            num_zeros_in_grad=num_zeros_in_grad,
            params_norm=params_norm,
            skipped=total_loss_dict[skipped_iters_key],
            nan=total_loss_dict[nan_iters_key],
            throughput=throughput if args.log_throughput else None,
        )
        total_loss_dict[advanced_iters_key] = 0
        total_loss_dict[skipped_iters_key] = 0
        total_loss_dict[nan_iters_key] = 0
        print_rank_last(log_string)
        if report_memory_flag and learning_rate > 0.0:
            # After the first step the optimizer state exists; compare with the theory.
            if torch.distributed.get_rank() == 0:
                report_theoretical_memory(
                    args, num_microbatches=get_num_microbatches(), verbose=True
                )
            report_memory('(after {} iterations)'.format(iteration))
            report_memory_flag = False
        timers.log(timers_to_log, normalizer=args.log_interval)
    return report_memory_flag
