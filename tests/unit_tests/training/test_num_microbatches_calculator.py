"""Micro-batch calculator: constant and --rampup-batch-size (formulas of Megatron's
megatron/core/num_microbatches_calculator.py)."""

import pytest

from megatron.core import num_microbatches_calculator as nmc


@pytest.fixture(autouse=True)
def _fresh_calculator():
    nmc.destroy_num_microbatches_calculator()
    yield
    nmc.destroy_num_microbatches_calculator()


def test_not_initialized_error_names_the_call():
    with pytest.raises(RuntimeError, match='init_num_microbatches_calculator'):
        nmc.get_num_microbatches()


def test_constant():
    nmc.init_num_microbatches_calculator(
        0, None, global_batch_size=32, micro_batch_size=2, data_parallel_size=4
    )
    assert nmc.get_num_microbatches() == 4
    assert nmc.get_current_global_batch_size() == 32
    nmc.update_num_microbatches(10_000)
    assert nmc.get_num_microbatches() == 4
    with pytest.raises(AssertionError):
        nmc.init_num_microbatches_calculator(0, None, 32, 2, 4)


def test_constant_not_divisible():
    with pytest.raises(
        ValueError, match=r'global batch size \(30\) is not divisible by micro batch size \(2\)'
    ):
        nmc.init_num_microbatches_calculator(0, None, 30, 2, 4)


def test_rampup_matches_formula():
    start, incr, ramp, gbs, mbs, dp = 8, 8, 96, 32, 2, 2
    nmc.init_num_microbatches_calculator(0, [start, incr, ramp], gbs, mbs, dp)
    per_increment = ramp / ((gbs - start) // incr)
    for consumed in [0, 1, 31, 32, 33, 64, 95, 96, 97, 1000]:
        nmc.update_num_microbatches(consumed, consistency_check=True)
        expected = gbs if consumed > ramp else start + int(consumed / per_increment) * incr
        assert nmc.get_current_global_batch_size() == expected, consumed
        assert nmc.get_num_microbatches() == expected // (mbs * dp)


def test_rampup_bad_increment():
    with pytest.raises(ValueError, match=r'is not divisible by the batch size increment \(5\)'):
        nmc.init_num_microbatches_calculator(0, [8, 5, 100], 32, 2, 2)


def test_rampup_consistency_check():
    nmc.init_num_microbatches_calculator(0, [2, 2, 100], 8, 2, 2)  # start 2 < mbs x dp = 4
    with pytest.raises(ValueError, match=r'current global batch size \(2\) is not divisible'):
        nmc.update_num_microbatches(0, consistency_check=True)


def test_train_iters_from_samples_with_rampup():
    from types import SimpleNamespace

    from megatron.training.training import update_train_iters

    # Ramp 8 -> 32 in steps of 8 over 96 samples, then 32 per iteration.
    nmc.init_num_microbatches_calculator(0, [8, 8, 96], 32, 2, 2)
    args = SimpleNamespace(
        rampup_batch_size=['8', '8', '96'], train_samples=1000, global_batch_size=32
    )
    update_train_iters(args)
    consumed, iterations = 0, 0
    while consumed < 1000:
        nmc.update_num_microbatches(consumed, consistency_check=False)
        if consumed + nmc.get_current_global_batch_size() > 1000:
            break
        consumed += nmc.get_current_global_batch_size()
        iterations += 1
    assert args.train_iters == iterations
    args = SimpleNamespace(rampup_batch_size=None, train_samples=1000, global_batch_size=32)
    update_train_iters(args)
    assert args.train_iters == 1000 // 32
