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
    """A timer above the configured log level: start/stop/reset cost nothing, reading fails."""

    def __init__(self):
        super().__init__('dummy timer')

    def start(self, barrier=False):
        """Ignored: this timer's level is switched off."""

    def stop(self, barrier=False):
        """Ignored: this timer's level is switched off."""

    def reset(self):
        """Ignored: there is nothing to zero."""

    def elapsed(self, reset=True, barrier=False):
        raise RuntimeError('dummy timer should not be used to calculate elapsed time')

    def active_time(self):
        raise RuntimeError('dummy timer should not be used to calculate active time')


class Timer(TimerBase):
    """A wall-clock timer; synchronizes CUDA (when present) at start and stop.

    `elapsed()` is what the log reports and is zeroed by `reset()`; `active_time()` keeps
    growing for the timer's whole life (the straggler and throughput reports read it).
    """

    def __init__(self, name: str):
        super().__init__(name)
        self._started = False
        self._start_time = time.time()
        self._elapsed = self._active_time = 0.0
        self._barrier_group = None

    def set_barrier_group(self, barrier_group):
        """Process group the barrier=True option synchronizes (default: all ranks)."""
        self._barrier_group = barrier_group

    def _settle(self, barrier: bool) -> float:
        """Wait for the group (if asked) and for queued device work; return the clock."""
        if barrier and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier(group=self._barrier_group)
        _synchronize()
        return time.time()

    def start(self, barrier=False):
        assert not self._started, f'timer {self.name} has already been started'
        self._start_time = self._settle(barrier)
        self._started = True

    def stop(self, barrier=False):
        assert self._started, f'timer {self.name} is not started'
        span = self._settle(barrier) - self._start_time
        self._elapsed += span
        self._active_time += span
        self._started = False

    def reset(self):
        self._started = False
        self._elapsed = 0.0

    def elapsed(self, reset=True, barrier=False):
        running = self._started
        # A running timer is closed for the read and reopened after, so it loses no time.
        if running:
            self.stop(barrier=barrier)
        total = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier)
        return total

    def active_time(self):
        """Total time spent between start/stop pairs, never reset."""
        return self._active_time


def _world() -> tuple:
    """(world size, rank), (1, 0) without torch.distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def _label(name: str) -> str:
    """The timer name padded with dots to a fixed column, as Megatron's report prints it."""
    return f'{name} '.ljust(48, '.')


class Timers:
    """Group of named timers.

    Args:
        log_level: the `--timing-log-level` (0, 1 or 2); timers asked for at a higher level are
            dummies.
        log_option: 'max', 'minmax' or 'all': how times across ranks are reported.
    """

    def __init__(self, log_level: int, log_option: str):
        if log_option not in ('max', 'minmax', 'all'):
            raise ValueError(
                f"--timing-log-option must be 'max', 'minmax' or 'all', got {log_option!r}"
            )
        self._log_level, self._log_option = log_level, log_option
        self._max_log_level = 2
        self._dummy_timer = DummyTimer()
        self._timers = {}
        self._log_levels = {}

    def __call__(self, name: str, log_level: int = None):
        """The timer `name`; created at `log_level` (default: the maximum level) on first use."""
        known = self._timers.get(name)
        if known is not None:
            fixed = self._log_levels[name]
            assert log_level is None or log_level == fixed, (
                f'input log level {log_level} does not match already existing log level '
                f'{fixed} for {name} timer'
            )
            return known
        level = self._max_log_level if log_level is None else log_level
        assert level <= self._max_log_level, (
            f'log level {level} is larger than max supported log level {self._max_log_level}'
        )
        if level > self._log_level:
            # Switched off: nothing is recorded, so the name stays unknown.
            return self._dummy_timer
        self._log_levels[name] = level
        self._timers[name] = timer = Timer(name)
        return timer

    def _get_elapsed_time_all_ranks(self, names: List[str], reset: bool, barrier: bool):
        """[world_size, len(names)] tensor of elapsed seconds; 0 where a rank lacks the timer.

        Collective: one all_gather of this rank's row over the default group (every rank must call
        with the same `names`).
        """
        if barrier:
            _barrier()
        world_size, rank = _world()
        device = get_current_device()
        # A timer this rank never created reads 0, which the reports below treat as absent.
        own = torch.zeros(len(names), dtype=torch.float, device=device)
        for column, name in enumerate(names):
            timer = self._timers.get(name)
            if timer is not None:
                own[column] = timer.elapsed(reset=reset)
        if world_size == 1:
            return own.unsqueeze(0)  # [1, n]
        # The list form of all_gather: gloo lacks all_gather_into_tensor for CPU tensors in some
        # torch versions.
        rows = [torch.zeros_like(own) for _ in range(world_size)]
        torch.distributed.all_gather(rows, own)
        return torch.stack(rows)  # [world_size, n]

    def _get_global_min_max_time(self, names, reset, barrier, normalizer):
        """{name: (min, max)} over the ranks that ran the timer, divided by `normalizer`."""
        table = self._get_elapsed_time_all_ranks(names, reset, barrier)
        spans = {}
        for column, name in enumerate(names):
            ran = table[:, column]
            ran = ran[ran > 0.0]
            if ran.numel() == 0:
                continue  # no rank has this timer
            spans[name] = (ran.min().item() / normalizer, ran.max().item() / normalizer)
        return spans

    def _get_global_min_max_time_string(self, names, reset, barrier, normalizer, max_only):
        spans = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not spans:
            return None
        if max_only:
            lines = ['max time across ranks (ms):']
            lines += [f'    {_label(name)}: {hi:.2f}' for name, (_, hi) in spans.items()]
        else:
            lines = ['(min, max) time across ranks (ms):']
            lines += [
                f'    {_label(name)}: ({lo:.2f}, {hi:.2f})' for name, (lo, hi) in spans.items()
            ]
        return '\n'.join(lines)

    def _get_all_ranks_time_string(self, names, reset, barrier, normalizer):
        table = self._get_elapsed_time_all_ranks(names, reset, barrier)
        lines = ['times across ranks (ms):']
        for column, name in enumerate(names):
            ranks = [r for r in range(table.size(0)) if table[r, column] > 0]
            if ranks:
                lines.append(f'  {name}:')
                lines += [f'     rank {r:2d}: {table[r, column] / normalizer:.2f}' for r in ranks]
        # Only the header: no rank ran any of the timers.
        return None if len(lines) == 1 else '\n'.join(lines)

    def get_all_timers_string(
        self,
        names: List[str] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ):
        """The report string for `names` (default: all timers), times in ms / normalizer."""
        if names is None:
            names = list(self._timers)
        assert normalizer > 0.0
        # Elapsed times are seconds: dividing by normalizer / 1000 reports milliseconds.
        per_ms = normalizer / 1000.0
        if self._log_option == 'all':
            return self._get_all_ranks_time_string(names, reset, barrier, per_ms)
        max_only = self._log_option == 'max'
        return self._get_global_min_max_time_string(names, reset, barrier, per_ms, max_only)

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
        report = self.get_all_timers_string(names, normalizer, reset, barrier)
        world_size, current = _world()
        printer = world_size - 1 if rank is None else rank
        if report is not None and printer == current:
            print(report, flush=True)

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
        # Collective: every rank reads (and resets) its timers even without a writer.
        spans = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is None:
            return
        for name, (_, slowest) in spans.items():
            writer.add_scalar(f'{name}-time', slowest, iteration)
