"""broadcast_data and the tensor splitting utilities."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (
    VocabUtility,
    broadcast_data,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)
from tests.unit_tests.dist_utils import run_distributed


def _batch(dp_rank):
    gen = torch.Generator().manual_seed(100 + dp_rank)
    return {
        "tokens": torch.randint(0, 1000, (2, 9), generator=gen),
        "labels": torch.randint(0, 1000, (2, 9), generator=gen),
        "loss_mask": torch.randint(0, 2, (3, 1, 4, 2), generator=gen),
        "scalar_like": torch.randint(0, 5, (7,), generator=gen),
    }


def _broadcast():
    keys = ["tokens", "labels", "loss_mask", "scalar_like"]
    dp_rank = ps.get_data_parallel_rank()
    if ps.get_tensor_model_parallel_rank() == 0:
        data = _batch(dp_rank)
    else:
        data = {"tokens": torch.zeros(1, dtype=torch.int64)}  # ignored on non-source ranks
    out = broadcast_data(keys, data, torch.int64)
    expected = _batch(dp_rank)
    for key in keys:
        assert torch.equal(out[key], expected[key]), key
    return dp_rank


@pytest.mark.parametrize("tp", [2, 4])
def test_broadcast_data_from_tp_rank_zero(tp):
    dp_ranks = run_distributed(_broadcast, 4, tp=tp)
    assert dp_ranks == [r // tp for r in range(4)]


def _broadcast_wrong_dtype():
    data = {"x": torch.zeros(2, dtype=torch.float32)}
    try:
        broadcast_data(["x"], data, torch.int64)
    except ValueError as exc:
        return "x has data type torch.float32" in str(exc)
    return False


def test_broadcast_data_checks_dtype():
    assert run_distributed(_broadcast_wrong_dtype, 4, tp=1) == [True] * 4


def _split_gather_1d():
    tp = ps.get_tensor_model_parallel_world_size()
    full = torch.arange(24.0).view(4, 6)
    chunk = split_tensor_into_1d_equal_chunks(full)
    r = ps.get_tensor_model_parallel_rank()
    assert torch.equal(chunk, full.view(-1)[r * 24 // tp : (r + 1) * 24 // tp])
    assert torch.equal(split_tensor_into_1d_equal_chunks(full, new_buffer=True), chunk)
    assert torch.equal(gather_split_1d_tensor(chunk), full.view(-1))
    return True


def test_1d_split_and_gather_round_trip():
    assert all(run_distributed(_split_gather_1d, 4, tp=4))


def test_split_tensor_along_last_dim():
    t = torch.arange(24.0).view(2, 3, 4)
    parts = split_tensor_along_last_dim(t, 2)
    assert [p.shape for p in parts] == [(2, 3, 2)] * 2
    assert torch.equal(torch.cat(parts, dim=-1), t)
    assert not parts[1].is_contiguous()
    assert all(
        p.is_contiguous() for p in split_tensor_along_last_dim(t, 2, contiguous_split_chunks=True)
    )


def test_vocab_utility_ranges():
    ranges = [VocabUtility.vocab_range_from_global_vocab_size(64, r, 4) for r in range(4)]
    assert ranges == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(10, 3, 4) == (30, 40)
