"""How many micro-batches one training iteration runs: constant, or ramped up with the batch size.

The calculator is a process-wide singleton (Megatron keeps it here in core so schedules and the
training loop agree): `init_num_microbatches_calculator(...)` once, then `get_num_microbatches()`,
`get_current_global_batch_size()` and `update_num_microbatches(consumed_samples)` each iteration.
"""

import logging
from abc import ABC, abstractmethod
from typing import List, Optional

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def get_num_microbatches() -> int:
    """Number of micro-batches of the current iteration."""
    return _get_calculator().get()


def get_current_global_batch_size() -> int:
    """Global batch size of the current iteration (changes during a ramp-up)."""
    return _get_calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    """The micro-batch size the calculator was built with."""
    return _get_calculator().micro_batch_size


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    """Recompute the micro-batch count for `consumed_samples` (a no-op without ramp-up)."""
    _get_calculator().update(consumed_samples, consistency_check)


def init_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """Create the process-wide calculator (it must not exist yet)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    assert _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None, (
        'num microbatches calculator is already initialized.'
    )
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size
    )


def reconfigure_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """Replace the process-wide calculator (e.g. between runs in one process)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size
    )


def destroy_num_microbatches_calculator() -> None:
    """Forget the process-wide calculator."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


unset_num_microbatches_calculator = destroy_num_microbatches_calculator


def _get_calculator():
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError(
            'num microbatches calculator is not initialized: call '
            'init_num_microbatches_calculator() (initialize_megatron does it)'
        )
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: Optional[List[int]],
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> 'NumMicroBatchesCalculator':
    """Constant calculator without ramp-up, else a ramp-up calculator.

    Args:
        rampup_batch_size: None or [start global batch size, increment, ramp-up samples].
    """
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size
        )
        if rank == 0:
            print(
                'setting number of micro-batches to constant {}'.format(calculator.get()),
                flush=True,
            )
        return calculator
    if len(rampup_batch_size) != 3:
        raise ValueError(
            'expected the following format: --rampup-batch-size <start batch size> '
            f'<batch size incerement> <ramp-up samples>, got {rampup_batch_size}'
        )
    start_global_batch_size = int(rampup_batch_size[0])
    batch_size_increment = int(rampup_batch_size[1])
    ramup_samples = int(rampup_batch_size[2])
    if rank == 0:
        print(
            'will use batch size rampup starting from global batch size {} to global batch size {} '
            'with batch size increments {} over {} samples.'.format(
                start_global_batch_size, global_batch_size, batch_size_increment, ramup_samples
            ),
            flush=True,
        )
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size,
        micro_batch_size,
        data_parallel_size,
        start_global_batch_size,
        batch_size_increment,
        ramup_samples,
    )


class BatchSizeConsistencyError(ValueError, AssertionError):
    """A ramp-up step's global batch size is not a multiple of micro batch x data parallel.

    A ValueError (the one-line user error); also an AssertionError, which Megatron r0.8 raises
    here and library code (its unit tests among it) catches.
    """


class NumMicroBatchesCalculator(ABC):
    """Base class: holds the current micro-batch count and global batch size."""

    def __init__(self) -> None:
        self.num_micro_batches = None
        self.current_global_batch_size = None

    def get(self) -> int:
        """Current number of micro-batches."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """Current global batch size."""
        return self.current_global_batch_size

    @abstractmethod
    def update(self, consumed_samples, consistency_check) -> None:
        """Update for the number of samples consumed so far."""


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """num_microbatches = global_batch_size / (micro_batch_size * data_parallel_size), fixed."""

    def __init__(
        self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int
    ) -> None:
        super().__init__()
        micro_batch_times_data_parallel = micro_batch_size * data_parallel_size
        if global_batch_size % micro_batch_times_data_parallel != 0:
            raise ValueError(
                f'global batch size ({global_batch_size}) is not divisible by micro batch size '
                f'({micro_batch_size}) times data parallel size ({data_parallel_size})'
            )
        self.num_micro_batches = global_batch_size // micro_batch_times_data_parallel
        if self.num_micro_batches < 1:
            raise ValueError(
                f'number of micro-batches should be at least 1, got {self.num_micro_batches}'
            )
        self.current_global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples, consistency_check) -> None:
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch size grows from `start_global_batch_size` by `batch_size_increment` steps.

    Over the first `ramup_samples` consumed samples the batch size rises linearly in equal sample
    intervals: current = start + int(consumed / samples_per_increment) * increment, then stays at
    `global_batch_size`.
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        start_global_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
    ) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        if start_global_batch_size <= 0:
            raise ValueError(
                f'--rampup-batch-size start batch size ({start_global_batch_size}) must be positive'
            )
        if batch_size_increment <= 0:
            raise ValueError(
                f'--rampup-batch-size increment ({batch_size_increment}) must be positive'
            )
        if ramup_samples < 0:
            raise ValueError(f'--rampup-batch-size ramp-up samples ({ramup_samples}) must be >= 0')
        diff_batch_size = global_batch_size - start_global_batch_size
        if diff_batch_size < 0:
            raise ValueError(
                f'--rampup-batch-size start batch size ({start_global_batch_size}) exceeds '
                f'--global-batch-size ({global_batch_size})'
            )
        if diff_batch_size % batch_size_increment != 0:
            raise ValueError(
                f'--global-batch-size ({global_batch_size}) - start batch size '
                f'({start_global_batch_size}) = {diff_batch_size} is not divisible by the '
                f'batch size increment ({batch_size_increment})'
            )
        num_increments = diff_batch_size // batch_size_increment
        self.rampup_samples_per_increment = self.ramup_samples / max(num_increments, 1)
        self.update(0, False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        ramping = consumed_samples <= self.ramup_samples
        increments = int(consumed_samples / self.rampup_samples_per_increment) if ramping else 0
        self.current_global_batch_size = (
            self.start_global_batch_size + increments * self.batch_size_increment
            if ramping
            else self.global_batch_size
        )
        assert self.current_global_batch_size <= self.global_batch_size
        if consistency_check and (
            self.current_global_batch_size % self.micro_batch_times_data_parallel_size != 0
        ):
            raise BatchSizeConsistencyError(
                f'current global batch size ({self.current_global_batch_size}) is not divisible by '
                f'micro-batch-size ({self.micro_batch_size}) times data parallel size '
                f'({self.data_parallel_size})'
            )
        self.num_micro_batches = max(
            1, self.current_global_batch_size // self.micro_batch_times_data_parallel_size
        )
