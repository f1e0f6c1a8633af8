"""Every tensor parallel mapping against its unsharded definition, forward and backward.

Each rank back-propagates a *different* gradient, so a backward that forgets its all-reduce,
reduce-scatter or all-gather gives the wrong input gradient and fails.
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp_api
from tests.unit_tests.dist_utils import run_distributed

S, B, H = 8, 2, 12  # sequence, batch, hidden; divisible by tp = 1, 2, 4


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _close(name, actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _chunk(t, dim, r, n):
    return t.chunk(n, dim=dim)[r]


def _run(name, fn, x, grad):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _check_all_mappings():
    group = ps.get_tensor_model_parallel_group()
    r, n = group.rank(), group.size()
    ranks = range(n)
    # Same "global" tensors on every rank; per-rank gradients differ (seed + rank).
    x_full = _randn(1, S, B, H)
    x_rank = [_randn(100 + k, S, B, H) for k in ranks]  # a different partial tensor per rank
    g_full = [_randn(200 + k, S, B, H) for k in ranks]  # rank k's incoming gradient (full shape)
    checked = []

    # copy: forward identity, backward all-reduce.
    y, gx = _run("copy", tp_api.copy_to_tensor_model_parallel_region, x_full, g_full[r])
    _close("copy fwd", y, x_full)
    _close("copy bwd", gx, sum(g_full))
    checked.append("copy")

    # reduce: forward all-reduce, backward identity.
    y, gx = _run("reduce", tp_api.reduce_from_tensor_model_parallel_region, x_rank[r], g_full[0])
    _close("reduce fwd", y, sum(x_rank))
    _close("reduce bwd", gx, g_full[0])
    checked.append("reduce")

    # scatter (last dim): forward split, backward all-gather.
    g_chunk = [_chunk(g, -1, k, n) for k, g in enumerate(g_full)]
    y, gx = _run("scatter", tp_api.scatter_to_tensor_model_parallel_region, x_full, g_chunk[r])
    _close("scatter fwd", y, _chunk(x_full, -1, r, n))
    _close("scatter bwd", gx, torch.cat(g_chunk, dim=-1))
    checked.append("scatter")

    # gather (last dim): forward all-gather, backward split.
    x_chunks = [_chunk(x, -1, k, n) for k, x in enumerate(x_rank)]
    y, gx = _run("gather", tp_api.gather_from_tensor_model_parallel_region, x_chunks[r], g_full[0])
    _close("gather fwd", y, torch.cat(x_chunks, dim=-1))
    _close("gather bwd", gx, _chunk(g_full[0], -1, r, n))
    checked.append("gather")

    # scatter to sequence parallel (first dim): forward split, backward all-gather.
    g_seq = [_chunk(g, 0, k, n) for k, g in enumerate(g_full)]
    y, gx = _run("sp scatter", tp_api.scatter_to_sequence_parallel_region, x_full, g_seq[r])
    _close("sp scatter fwd", y, _chunk(x_full, 0, r, n))
    _close("sp scatter bwd", gx, torch.cat(g_seq, dim=0))
    checked.append("sp scatter")

    # gather from sequence parallel: forward all-gather; backward reduce-scatter (tp output
    # grad) or split.
    x_seq = [_chunk(x, 0, k, n) for k, x in enumerate(x_rank)]
    y, gx = _run("sp gather", tp_api.gather_from_sequence_parallel_region, x_seq[r], g_full[r])
    _close("sp gather fwd", y, torch.cat(x_seq, dim=0))
    _close("sp gather bwd (reduce-scatter)", gx, _chunk(sum(g_full), 0, r, n))
    fn = lambda t: tp_api.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False)
    y, gx = _run("sp gather no-tp-grad", fn, x_seq[r], g_full[0])
    _close("sp gather bwd (split)", gx, _chunk(g_full[0], 0, r, n))
    checked.append("sp gather")

    # reduce-scatter to sequence parallel: forward reduce-scatter, backward all-gather.
    y, gx = _run(
        "sp reduce-scatter", tp_api.reduce_scatter_to_sequence_parallel_region, x_rank[r], g_seq[r]
    )
    _close("sp reduce-scatter fwd", y, _chunk(sum(x_rank), 0, r, n))
    _close("sp reduce-scatter bwd", gx, torch.cat(g_seq, dim=0))
    checked.append("sp reduce-scatter")

    # all-gather last dim: forward all-gather, backward reduce-scatter (last dim).
    y, gx = _run(
        "ag last", tp_api.all_gather_last_dim_from_tensor_parallel_region, x_chunks[r], g_full[r]
    )
    _close("ag last fwd", y, torch.cat(x_chunks, dim=-1))
    _close("ag last bwd", gx, _chunk(sum(g_full), -1, r, n))
    checked.append("ag last")

    # reduce-scatter last dim: forward reduce-scatter (last dim), backward all-gather.
    y, gx = _run(
        "rs last", tp_api.reduce_scatter_last_dim_to_tensor_parallel_region, x_rank[r], g_chunk[r]
    )
    _close("rs last fwd", y, _chunk(sum(x_rank), -1, r, n))
    _close("rs last bwd", gx, torch.cat(g_chunk, dim=-1))
    checked.append("rs last")

    # all-to-all sequence-split <-> hidden-split: [s/tp * b, h] <-> [s * b, h/tp], and back.
    x2d_seq = _chunk(x_full, 0, r, n).reshape(-1, H)
    y = tp_api.all_to_all_sp2hp(x2d_seq)
    _close("sp2hp fwd", y, _chunk(x_full.reshape(-1, H), -1, r, n))
    _close("hp2sp fwd", tp_api.all_to_all_hp2sp(y), x2d_seq)
    xa = x2d_seq.clone().requires_grad_(True)
    tp_api.all_to_all_sp2hp(xa).backward(_chunk(g_full[0].reshape(-1, H), -1, r, n))
    _close("sp2hp bwd", xa.grad, _chunk(g_full[0], 0, r, n).reshape(-1, H))
    checked.append("all-to-all")

    # The caller's tensor is not modified by the copy's backward.
    g_keep = g_full[r].clone()
    _run("copy keep", tp_api.copy_to_tensor_model_parallel_region, x_full, g_keep)
    _close("copy leaves grad_output alone", g_keep, g_full[r])
    return checked


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mappings_match_unsharded_definition(tp):
    results = run_distributed(_check_all_mappings, 4, tp=tp)
    assert all(len(checked) == 10 for checked in results)


def _explicit_group_is_used():
    # With an explicit group of the data parallel ranks, mappings reduce over it, not over tp.
    dp_group = ps.get_data_parallel_group()
    rank = torch.distributed.get_rank()
    x = torch.full((2,), float(rank), requires_grad=True)
    y = tp_api.copy_to_tensor_model_parallel_region(x, group=dp_group)
    y.backward(torch.ones(2))
    out = tp_api.reduce_from_tensor_model_parallel_region(x.detach().clone(), group=dp_group)
    return x.grad, out, torch.distributed.get_process_group_ranks(dp_group)


def test_explicit_group_argument():
    for grad, out, dp_ranks in run_distributed(_explicit_group_is_used, 4, tp=2):
        torch.testing.assert_close(grad, torch.full((2,), float(len(dp_ranks))))
        torch.testing.assert_close(out, torch.full((2,), float(sum(dp_ranks))))


def _uneven_first_dim():
    group = ps.get_tensor_model_parallel_group()
    r = group.rank()
    sizes = [3, 1]
    x_full = _randn(5, sum(sizes), 3)
    x_parts = list(x_full.split(sizes, dim=0))
    x = x_parts[r].clone().requires_grad_(True)
    y = tp_api.gather_from_sequence_parallel_region(x, True, sizes)
    _close("uneven gather fwd", y.detach(), x_full)
    g = [_randn(300 + k, sum(sizes), 3) for k in range(2)]
    y.backward(g[r])
    _close("uneven gather bwd", x.grad, (g[0] + g[1]).split(sizes, dim=0)[r])
    z = tp_api.reduce_scatter_to_sequence_parallel_region(_randn(400 + r, sum(sizes), 3), sizes)
    _close(
        "uneven reduce-scatter", z, (_randn(400, 4, 3) + _randn(401, 4, 3)).split(sizes, dim=0)[r]
    )
    return True


def test_uneven_split_sizes():
    assert all(run_distributed(_uneven_first_dim, 4, tp=2))


def _single_rank_regions():
    # A tp group of one rank: both region mappings hand back the input itself (no autograd node,
    # no copy of the gradient); the gradient still flows.
    x = torch.randn(3, 4, requires_grad=True)
    copied = tp_api.copy_to_tensor_model_parallel_region(x)
    reduced = tp_api.reduce_from_tensor_model_parallel_region(copied * 2)
    reduced.sum().backward()
    return copied is x, reduced.grad_fn.name(), x.grad


def test_single_rank_region_mappings_record_no_node():
    for same, last_node, grad in run_distributed(_single_rank_regions, 2, tp=1):
        assert same and last_node == "MulBackward0"
        torch.testing.assert_close(grad, torch.full((3, 4), 2.0))
