"""Megatron's timers: named wall-clock timers with log levels, reported as min/max across ranks.

`Timers(log_level, log_option)` hands out a real `Timer` for names whose level is <= the configured
`--timing-log-level` and a no-op `DummyTimer` otherwise, so finer timers cost nothing when off.
Level 0: iteration time only; 1: one-off timers (forward-backward, optimizer, ...); 2: fine grained.
"""

import time
from abc import ABC, abstractmethod
from typing import List

import torch

from megatron.core.utils import get_current_device, uses_cuda


def _synchronize():
    if uses_cuda() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class TimerBase(ABC):
    """Interface of a single named timer."""

    def __init__(self, name: str):
        self.name = name

    @abstractmethod
    def start(self, barrier=False):
        """Start the timer (optionally after a barrier across all ranks)."""

    @abstractmethod
    def stop(self, barrier=False):
        """Stop the timer and add the time since start to the elapsed total."""

    @abstractmethod
    def reset(self):
        """Zero the elapsed total."""

    @abstractmethod
    def elapsed(self, reset=True, barrier=False):
        """Elapsed seconds (a running timer keeps running)."""


class DummyTimer(TimerBase):
    """A timer above the configured log level: does nothing."""

    def __init__(self):
        super().__init__('dummy timer')

    def start(self, barrier=False):
        return

    def stop(self, barrier=False):
        return

    def reset(self):
        return

    def elapsed(self, reset=True, barrier=False):
        raise RuntimeError('dummy timer should not be used to calculate elapsed time')

    def active_time(self):
        raise RuntimeError('dummy timer should not be used to calculate active time')


class Timer(TimerBase):
    """A wall-clock timer; synchronizes CUDA (when present) at start and stop."""

    def __init__(self, name: str):
        super().__init__(name)
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._barrier_group = None
        self._start_time = time.time()

    def set_barrier_group(self, barrier_group):
        """Process group the barrier=True option synchronizes (default: all ranks)."""
        self._barrier_group = barrier_group

    def _do_barrier(self):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier(group=self._barrier_group)

    def start(self, barrier=False):
        assert not self._started, f'timer {self.name} has already been started'
        if barrier:
            self._do_barrier()
        _synchronize()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier=False):
        assert self._started, f'timer {self.name} is not started'
        if barrier:
            self._do_barrier()
        _synchronize()
        elapsed = time.time() - self._start_time
        self._elapsed += elapsed
        self._active_time += elapsed
        self._started = False

    def reset(self):
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset=True, barrier=False):
        started = self._started
        if self._started:
            self.stop(barrier=barrier)
        elapsed = self._elapsed
        if reset:
            self.reset()
        if started:
            self.start(barrier=barrier)
        return elapsed

    def active_time(self):
        """Total time spent between start/stop pairs, never reset."""
        return self._active_time


class Timers:
    """Group of named timers.

    Args:
        log_level: the `--timing-log-level` (0, 1 or 2); timers asked for at a higher level are
            dummies.
        log_option: 'max', 'minmax' or 'all': how times across ranks are reported.
    """

    def __init__(self, log_level: int, log_option: str):
        self._log_level = log_level
        if log_option not in ('max', 'minmax', 'all'):
            raise ValueError(
                f"--timing-log-option must be 'max', 'minmax' or 'all', got {log_option!r}"
            )
        self._log_option = log_option
        self._timers = {}
        self._log_levels = {}
        self._dummy_timer = DummyTimer()
        self._max_log_level = 2

    def __call__(self, name: str, log_level: int = None):
        """The timer `name`; created at `log_level` (default: the maximum level) on first use."""
        if name in self._timers:
            if log_level is not None:
                assert log_level == self._log_levels[name], (
                    f'input log level {log_level} does not match already existing log level '
                    f'{self._log_levels[name]} for {name} timer'
                )
            return self._timers[name]
        if log_level is None:
            log_level = self._max_log_level
        assert log_level <= self._max_log_level, (
            f'log level {log_level} is larger than max supported log level {self._max_log_level}'
        )
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _get_elapsed_time_all_ranks(self, names: List[str], reset: bool, barrier: bool):
        """[world_size, len(names)] tensor of elapsed seconds; 0 where a rank lacks the timer."""
        if barrier:
            _barrier()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
            rank = torch.distributed.get_rank()
        else:
            world_size, rank = 1, 0
        # gloo has no all_gather_into_tensor for CPU tensors in every torch version: use the list
        # form.
        device = get_current_device()
        rank_name_to_time = torch.zeros((world_size, len(names)), dtype=torch.float, device=device)
        for i, name in enumerate(names):
            if name in self._timers:
                rank_name_to_time[rank, i] = self._timers[name].elapsed(reset=reset)
        if world_size > 1:
            gathered = [
                torch.zeros(len(names), dtype=torch.float, device=device) for _ in range(world_size)
            ]
            torch.distributed.all_gather(gathered, rank_name_to_time[rank, :].contiguous())
            rank_name_to_time = torch.stack(gathered)
        return rank_name_to_time

    def _get_global_min_max_time(self, names, reset, barrier, normalizer):
        """{name: (min, max)} over the ranks that ran the timer, divided by `normalizer`."""
        rank_name_to_time = self._get_elapsed_time_all_ranks(names, reset, barrier)
        name_to_min_max_time = {}
        for i, name in enumerate(names):
            rank_to_time = rank_name_to_time[:, i]
            rank_to_time = rank_to_time[rank_to_time > 0.0]
            if rank_to_time.numel() > 0:
                name_to_min_max_time[name] = (
                    rank_to_time.min().item() / normalizer,
                    rank_to_time.max().item() / normalizer,
                )
        return name_to_min_max_time

    def _get_global_min_max_time_string(self, names, reset, barrier, normalizer, max_only):
        name_to_min_max_time = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not name_to_min_max_time:
            return None
        if max_only:
            output_string = 'max time across ranks (ms):'
        else:
            output_string = '(min, max) time across ranks (ms):'
        for name in name_to_min_max_time:
            min_time, max_time = name_to_min_max_time[name]
            if max_only:
                output_string += '\n    {}: {:.2f}'.format((name + ' ').ljust(48, '.'), max_time)
            else:
                output_string += '\n    {}: ({:.2f}, {:.2f})'.format(
                    (name + ' ').ljust(48, '.'), min_time, max_time
                )
        return output_string

    def _get_all_ranks_time_string(self, names, reset, barrier, normalizer):
        rank_name_to_time = self._get_elapsed_time_all_ranks(names, reset, barrier)
        output_string = 'times across ranks (ms):'
        no_reported_timing = True
        for i, name in enumerate(names):
            not_yet_found = True
            for rank in range(rank_name_to_time.size(0)):
                if rank_name_to_time[rank, i] > 0:
                    no_reported_timing = False
                    if not_yet_found:
                        not_yet_found = False
                        output_string += '\n  {}:'.format(name)
                    output_string += '\n     rank {:2d}: {:.2f}'.format(
                        rank, rank_name_to_time[rank, i] / normalizer
                    )
        if no_reported_timing:
            return None
        return output_string

    def get_all_timers_string(
        self,
        names: List[str] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ):
        """The report string for `names` (default: all timers), times in ms / normalizer."""
        if names is None:
            names = list(self._timers.keys())
        assert normalizer > 0.0
        if self._log_option in ('max', 'minmax'):
            return self._get_global_min_max_time_string(
                names, reset, barrier, normalizer / 1000.0, self._log_option == 'max'
            )
        return self._get_all_ranks_time_string(names, reset, barrier, normalizer / 1000.0)

    def log(
        self,
        names: List[str],
        rank: int = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ):
        """Print the timers' report on `rank` (default: the last rank). Collective: call on all
        ranks."""
        output_string = self.get_all_timers_string(names, normalizer, reset, barrier)
        if rank is None:
            rank = (
                torch.distributed.get_world_size() - 1 if torch.distributed.is_initialized() else 0
            )
        current = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == current and output_string is not None:
            print(output_string, flush=True)

    def write(
        self,
        names: List[str],
        writer,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ):
        """Write the max time across ranks of each timer to a TensorBoard `writer` as '<name>-time'.
        Resets the timers by default, as Megatron's Timers.write does."""
        assert normalizer > 0.0
        name_to_min_max_time = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is not None:
            for name in name_to_min_max_time:
                _, max_time = name_to_min_max_time[name]
                writer.add_scalar(name + '-time', max_time, iteration)
