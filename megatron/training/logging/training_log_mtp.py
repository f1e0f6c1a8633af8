"""Multi-token-prediction losses in the training log: `mtp_{k} loss` in the log line and
TensorBoard (later Megatron's names).

Called by `training_log` on every rank every iteration (the data-parallel average is a
collective).
"""

import torch

from megatron.core import parallel_state as mpu
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.transformer.multi_token_prediction import (
    clear_mtp_loss_tracker,
    mtp_loss_tracker,
)
from megatron.core.utils import get_current_device


def log_mtp_metrics(args, iteration, writer, total_loss_dict):
    """Average each depth's loss over the micro-batches and the data-parallel replicas, add it to
    `total_loss_dict` (the log line) and TensorBoard, then clear the tracker. A no-op without
    --mtp-num-layers."""
    depth = getattr(args, 'mtp_num_layers', None)
    if not depth:
        return
    tracker = mtp_loss_tracker()
    values = torch.zeros(depth, device=get_current_device())
    for k in range(1, depth + 1):
        if k in tracker:
            values[k - 1] = tracker[k]
    group = mpu.get_data_parallel_group()
    if group.size() > 1:
        torch.distributed.all_reduce(values, group=group)
        values /= group.size()
    values /= get_num_microbatches()
    for k in range(1, depth + 1):
        name = f'mtp_{k} loss'
        total_loss_dict[name] = total_loss_dict.get(name, 0.0) + float(values[k - 1])
        if writer is not None:
            writer.add_scalar(name, float(values[k - 1]), iteration)
    clear_mtp_loss_tracker()
