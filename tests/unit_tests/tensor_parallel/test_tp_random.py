"""Model-parallel RNG tracker on CPU and activation checkpointing with dropout."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import (
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
from tests.unit_tests.dist_utils import run_distributed


def test_tracker_fork_swaps_the_default_generator_on_cpu():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 5)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        inside = torch.rand(4)
    # The default stream is untouched by the fork...
    torch.testing.assert_close(torch.get_rng_state(), before, rtol=0, atol=0)
    # ...and the fork drew from a generator seeded with 5, continuing on the next fork.
    torch.manual_seed(5)
    expected = torch.rand(8)
    torch.testing.assert_close(inside, expected[:4], rtol=0, atol=0)
    with tracker.fork("a"):
        torch.testing.assert_close(torch.rand(4), expected[4:], rtol=0, atol=0)
    # get_states / set_states replays the stream.
    states = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(3)
    tracker.set_states(states)
    with tracker.fork("a"):
        torch.testing.assert_close(torch.rand(3), first, rtol=0, atol=0)


def test_tracker_rejects_duplicates_and_unknown_names():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 5)
    with pytest.raises(ValueError, match="seed 5"):
        tracker.add("b", 5)
    with pytest.raises(ValueError, match="'a'"):
        tracker.add("a", 6)
    with pytest.raises(KeyError, match="model_parallel_cuda_manual_seed"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}


def _draws():
    default = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        model_parallel = torch.rand(4)
    return default, model_parallel, sorted(get_cuda_rng_tracker().get_states())


def test_model_parallel_seed_per_tp_rank():
    out = run_distributed(_draws, 4, tp=2)
    # Default stream: same on every rank. Model-parallel stream: seed + 2718 + tp_rank.
    for default, _, names in out:
        torch.testing.assert_close(default, out[0][0], rtol=0, atol=0)
        assert names == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]
    assert not torch.equal(out[0][1], out[1][1])
    torch.testing.assert_close(out[0][1], out[2][1], rtol=0, atol=0)  # same tp rank, other dp rank
    torch.manual_seed(1234 + 2718 + 1)
    torch.testing.assert_close(out[1][1], torch.rand(4), rtol=0, atol=0)


def _block(x, w):
    # Dropout on both streams: the replicated one and the model-parallel one.
    h = F.dropout(F.linear(x, w), p=0.5, training=True)
    with get_cuda_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), p=0.3, training=True)
    return h * 2


def _checkpoint_vs_plain(distribute_saved_activations):
    tp = ps.get_tensor_model_parallel_world_size()
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(8, 2, 16, generator=gen)  # numel divisible by tp (distributed saving)
    w0 = torch.randn(16, 16, generator=gen)
    g = torch.randn(8, 2, 16, generator=gen)
    grads, after = [], []
    for use_checkpoint in (False, True, True):
        model_parallel_cuda_manual_seed(77)
        x = x0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        if use_checkpoint:
            y = checkpoint(_block, distribute_saved_activations, x, w)
        else:
            y = _block(x, w)
        y.backward(g)
        grads.append((y.detach(), x.grad, w.grad))
        after.append(torch.rand(3))  # the RNG continues identically after a recomputing backward
    for i in (1, 2):
        for a, b in zip(grads[0], grads[i]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(after[0], after[i], rtol=0, atol=0)
    # Dropout really acted (about half of the entries are zero) - the comparison is not vacuous.
    zero_fraction = (grads[0][0] == 0).float().mean().item()
    assert 0.4 < zero_fraction < 0.85, zero_fraction
    # Without the RNG replay the masks would differ: a second plain run from a different state does.
    x = x0.clone().requires_grad_(True)
    assert not torch.equal(_block(x, w0), grads[0][0])
    return tp


@pytest.mark.parametrize("tp,distribute", [(1, False), (2, True)])
def test_checkpoint_with_dropout_gives_identical_gradients(tp, distribute):
    assert run_distributed(_checkpoint_vs_plain, 4, tp=tp, args=(distribute,)) == [tp] * 4
