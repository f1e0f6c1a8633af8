"""Tests of the distributed test harness itself (tests/unit_tests/dist_utils.py)."""

import pytest
import torch

from megatron.core import parallel_state
from tests.unit_tests import dist_utils
from tests.unit_tests.dist_utils import run_distributed


def _rank_info(scale, offset=0):
    rank = torch.distributed.get_rank()
    t = torch.full((2,), float(rank), requires_grad=True) * scale + offset  # non-leaf
    return {
        "rank": rank,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "dp_size": parallel_state.get_data_parallel_world_size(),
        "tensors": (t, [t[:1]]),
        "rand": torch.rand(3),
    }


def test_return_values_come_back_per_rank():
    outs = run_distributed(_rank_info, 2, tp=2, args=(3.0,), kwargs={"offset": 1.0})
    assert [o["rank"] for o in outs] == [0, 1]
    assert [o["tp_rank"] for o in outs] == [0, 1]
    assert [o["dp_size"] for o in outs] == [1, 1]
    for rank, out in enumerate(outs):
        t, (view,) = out["tensors"]
        torch.testing.assert_close(t, torch.full((2,), rank * 3.0 + 1.0))
        assert not t.requires_grad and view.shape == (1,)
    # Same layout, different data parallel size: the state is rebuilt per call.
    outs = run_distributed(_rank_info, 2, tp=1, args=(1.0,))
    assert [o["dp_size"] for o in outs] == [2, 2]


def test_rng_is_reset_between_calls():
    first = run_distributed(_rank_info, 2, args=(1.0,))
    second = run_distributed(_rank_info, 2, args=(1.0,))
    for a, b in zip(first, second):
        torch.testing.assert_close(a["rand"], b["rand"], rtol=0, atol=0)


def _fail_on_rank_one():
    if torch.distributed.get_rank() == 1:
        assert 1 + 1 == 3, "deliberate failure on rank one"
    return "ok"


def test_error_is_reported_with_rank_number():
    with pytest.raises(AssertionError) as info:
        run_distributed(_fail_on_rank_one, 2)
    message = str(info.value)
    assert "rank 1:" in message
    assert "deliberate failure on rank one" in message
    assert "rank 0:" not in message
    # The pool was rebuilt: the next call works.
    assert run_distributed(_rank_info, 2, args=(1.0,))[1]["rank"] == 1


def _raise_value_error():
    raise ValueError(f"bad value on rank {torch.distributed.get_rank()}")


def test_errors_from_every_rank_are_reported():
    with pytest.raises(RuntimeError) as info:
        run_distributed(_raise_value_error, 2)
    message = str(info.value)
    assert "rank 0:" in message and "rank 1:" in message
    assert "bad value on rank 1" in message


def _deadlock():
    # Rank 0 waits in a collective that rank 1 never joins.
    if torch.distributed.get_rank() == 0:
        torch.distributed.all_reduce(torch.ones(1))
    return "done"


def test_deadlock_times_out_and_names_silent_ranks():
    # 6 s: long enough for rank 1 to set up and answer even on a busy machine.
    with pytest.raises(RuntimeError, match=r"timed out after 6s: ranks \[0\] of 2 did not answer"):
        run_distributed(_deadlock, 2, timeout=6)
    assert (2, "gloo") not in dist_utils._POOLS  # killed, rebuilt on next use
    assert run_distributed(_rank_info, 2, args=(1.0,))[0]["rank"] == 0
