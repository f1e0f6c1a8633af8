"""Timers: log levels, elapsed/reset semantics and the min/max report across ranks."""

import re
import time

import pytest
import torch

from megatron.core.timers import DummyTimer, Timer, Timers
from tests.unit_tests.dist_utils import run_distributed


def test_log_levels_give_dummies_above_the_level():
    timers = Timers(log_level=1, log_option='minmax')
    assert isinstance(timers('a', log_level=0), Timer)
    assert isinstance(timers('b', log_level=1), Timer)
    assert isinstance(timers('c', log_level=2), DummyTimer)
    assert isinstance(timers('d'), DummyTimer)  # default level is the maximum (2)
    with pytest.raises(AssertionError):
        timers('a', log_level=1)
    with pytest.raises(ValueError, match='timing-log-option'):
        Timers(0, 'median')


def test_elapsed_reset_and_running_timer():
    timer = Timer('t')
    timer.start()
    time.sleep(0.02)
    timer.stop()
    first = timer.elapsed(reset=False)
    assert first >= 0.02
    assert timer.elapsed(reset=True) == first
    assert timer.elapsed() == 0.0
    timer.start()
    time.sleep(0.01)
    assert timer.elapsed(reset=True) >= 0.01  # a running timer keeps running
    timer.stop()
    assert timer.active_time() >= 0.03
    with pytest.raises(AssertionError):
        timer.stop()


def _timers_across_ranks():
    rank = torch.distributed.get_rank()
    timers = Timers(2, 'minmax')
    t = timers('step', log_level=0)
    t._elapsed = 0.1 * (rank + 1)  # deterministic elapsed times: 100 ms and 200 ms
    text = timers.get_all_timers_string(['step'], normalizer=1.0, reset=False)
    minmax = timers._get_global_min_max_time(['step'], reset=False, barrier=False, normalizer=2.0)
    all_text = Timers(2, 'all')
    all_text('step', 0)._elapsed = 0.1 * (rank + 1)
    return text, minmax, all_text.get_all_timers_string(['step'])


def test_min_max_across_ranks():
    results = run_distributed(_timers_across_ranks, world_size=2)
    for text, minmax, all_text in results:
        assert text.splitlines()[0] == '(min, max) time across ranks (ms):'
        assert re.fullmatch(r'    step \.+: \(100\.00, 200\.00\)', text.splitlines()[1])
        assert len(text.splitlines()[1].split(':')[0].strip()) == 48
        assert minmax['step'] == pytest.approx((0.05, 0.1))
        assert 'rank  0: 100.00' in all_text and 'rank  1: 200.00' in all_text


def test_write_to_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    timers = Timers(0, 'minmax')
    timers('interval', 0)._elapsed = 0.5
    writer = SummaryWriter(str(tmp_path))
    timers.write(['interval'], writer, iteration=3)
    writer.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars('interval-time')] == [(3, 0.5)]
    # Megatron's Timers.write resets by default; reset=False keeps the time.
    assert timers('interval', 0).elapsed(reset=False) == 0.0
    timers('interval', 0)._elapsed = 0.25
    timers.write(['interval'], None, iteration=4, reset=False)
    assert timers('interval', 0).elapsed(reset=False) == 0.25
