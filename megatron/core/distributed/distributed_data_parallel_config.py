"""Configuration of `DistributedDataParallel` (the data-parallel gradient buffer and its
reduction)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    """Configuration for `DistributedDataParallel`.

    Core code treats an instance as read-only; derived values (such as the effective bucket size)
    are stored on the DDP module, never written back here.
    """

    grad_reduce_in_fp32: bool = False
    """If true, keep the contiguous gradient buffer (and reduce gradients) in fp32 whatever the
    parameter dtype (`--accumulate-allreduce-grads-in-fp32`)."""

    overlap_grad_reduce: bool = False
    """If true, start each bucket's reduction from backward hooks as soon as every gradient of the
    bucket is ready, overlapping communication with the rest of the backward pass."""

    use_distributed_optimizer: bool = False
    """If true, gradients are reduce-scattered (each data-parallel rank receives the reduced shard
    it owns) and a parameter buffer is allocated so updated parameters can be all-gathered."""

    check_for_nan_in_grad: bool = False
    """If true, check every bucket's gradient norm for NaN and Inf before it is reduced, through
    the rerun state machine (which raises when it is disabled, else reruns the step)."""

    check_for_large_grads: bool = False
    """If true, also reject (non-fatally, through the rerun state machine) a bucket whose gradient
    norm is 10x the largest of its first 100 norms (`--check-for-large-grads`)."""

    bucket_size: Optional[int] = None
    """Approximate number of elements per bucket. None means
    max(40000000, 1000000 * data-parallel size). Only used with `overlap_grad_reduce`: without
    overlap every buffer is a single bucket."""

    average_in_collective: bool = False
    """If true, average gradients inside the collective (ReduceOp.AVG); otherwise scale them by
    1 / data-parallel size before a summing collective. The result is the same."""

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(
                f"bucket_size (--ddp-bucket-size) must be positive, got {self.bucket_size}"
            )
