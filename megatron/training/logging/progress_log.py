"""--log-progress: `<--save>/progress.txt`, one tab-separated line per event (rank 0), as
Megatron writes it.

    <YYYY-MM-DD HH:MM:SS>\\tJob ID: <SLURM_JOB_ID>\\t# GPUs: <world size>\\tStarting job
    <...>\\t# GPUs: <n>\\tSaved checkpoint\\tIteration: <i>\\tJob throughput: <x> TFLOP/s/GPU\\t
        Cumulative throughput: <y> TFLOP/s/GPU\\tFloating-point operations: <f>\\t
        Tokens (in billions): <t>

The job throughput counts this job's floating-point operations since it started; the cumulative
throughput counts them since the first job of the same world size in the file (a run resumed over
several jobs), from the operations of the last checkpoint before that job.
"""

import os
import time
from datetime import datetime

import torch

from megatron.training.global_vars import get_args
from megatron.training.run_control.time_limit import get_train_start_time
from megatron.training.utils import append_to_progress_log


def _field(token, kind):
    return kind(token.split(': ')[1])


def get_start_time_from_progress_log():
    """(start time of the earliest job with this world size, floating-point operations done at
    its start) from <--save>/progress.txt."""
    args = get_args()
    start_time = None
    start_flops = None
    latest_flops = 0.0
    with open(os.path.join(args.save, 'progress.txt')) as f:
        for line in f:
            tokens = line.strip().split('\t')
            if len(tokens) < 4:
                continue
            if tokens[3] == 'Saved checkpoint' and len(tokens) > 7:
                latest_flops = _field(tokens[7], float)
            if _field(tokens[2], int) != args.world_size:
                start_time = None  # a different world size restarts the search
                start_flops = None
                continue
            if tokens[3] == 'Starting job' and start_time is None:
                start_time = tokens[0]
                start_flops = latest_flops
    if start_time is None:
        raise RuntimeError(
            f"{args.save}/progress.txt has no 'Starting job' line for world size {args.world_size}"
        )
    return datetime.strptime(start_time, '%Y-%m-%d %H:%M:%S'), start_flops


def compute_throughputs_and_append_to_progress_log(iteration, flops_so_far):
    """The 'Saved checkpoint' line of --log-progress (after a checkpoint save)."""
    args = get_args()
    if args.save is None:
        return
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        append_to_progress_log('', barrier=True)  # the barrier only: rank 0 writes the line
        return
    job_seconds = max(time.time() - get_train_start_time(), 1e-9)
    job_throughput = (flops_so_far - args.num_floating_point_operations_so_far) / (
        job_seconds * 10**12 * args.world_size
    )
    start_time, start_flops = get_start_time_from_progress_log()
    elapsed = max((datetime.now() - start_time).total_seconds(), 1e-9)
    cumulative_throughput = (flops_so_far - start_flops) / (elapsed * 10**12 * args.world_size)
    tokens_so_far = args.consumed_train_samples * args.seq_length
    append_to_progress_log(
        f'Saved checkpoint\tIteration: {iteration}\t'
        f'Job throughput: {job_throughput:.1f} TFLOP/s/GPU\t'
        f'Cumulative throughput: {cumulative_throughput:.1f} TFLOP/s/GPU\t'
        f'Floating-point operations: {flops_so_far:.2e}\t'
        f'Tokens (in billions): {tokens_so_far / 10**9:.2f}',
        barrier=True,
    )
