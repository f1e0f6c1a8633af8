"""Tensor parallel layers against unsharded torch references: outputs, input, weight and bias
gradients, with and without sequence parallelism; CPU initialization gives exact TP=1 slices."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from megatron.core.utils import get_current_device, init_method_normal
from tests.unit_tests.dist_utils import run_distributed

S, B, H, O, V = 8, 2, 16, 24, 64  # sequence, batch, input, output features, vocabulary
TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(seed, *shape):
    # Drawn on CPU (same values everywhere), placed on the layers' device (CPU, or GPU with nccl).
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(
        get_current_device()
    )


def _gather(t, dim):
    """All-gather this rank's shard along `dim` over the tp group (test-side, no autograd)."""
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _shard(t, dim):
    group = ps.get_tensor_model_parallel_group()
    return t.chunk(group.size(), dim=dim)[group.rank()]


def _close(name, actual, expected):
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{name}: {m}", **TOL)


def _reference_linear(x, w, b, g):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    b = b.clone().requires_grad_(True)
    y = F.linear(x, w, b)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


def _check_column(sp, gather_output, skip_bias_add):
    config = ModelParallelConfig(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(), sequence_parallel=sp
    )
    layer = ColumnParallelLinear(
        H,
        O,
        config=config,
        init_method=init_method_normal(0.2),
        bias=True,
        gather_output=gather_output,
        skip_bias_add=skip_bias_add,
    )
    with torch.no_grad():
        layer.bias.copy_(_shard(_randn(7, O), 0))
    w_full, b_full = _gather(layer.weight.detach(), 0), _gather(layer.bias.detach(), 0)
    x_full, g_full = _randn(1, S, B, H), _randn(2, S, B, O)
    y_ref, gx_ref, gw_ref, gb_ref = _reference_linear(x_full, w_full, b_full, g_full)

    x = (_shard(x_full, 0) if sp else x_full).clone().requires_grad_(True)  # [s/tp, b, h] under SP
    out, out_bias = layer(x)
    if skip_bias_add:
        assert out_bias is layer.bias
        out = out + out_bias
    else:
        assert out_bias is None
    if gather_output:
        _close("column fwd (gathered)", out.detach(), y_ref)
        out.backward(g_full)
    else:
        _close("column fwd", out.detach(), _shard(y_ref, -1))
        out.backward(_shard(g_full, -1))
    _close("column grad input", x.grad, _shard(gx_ref, 0) if sp else gx_ref)
    _close("column grad weight", layer.weight.grad, _shard(gw_ref, 0))
    _close("column grad bias", layer.bias.grad, _shard(gb_ref, 0))
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
    return True


def _check_row(sp, input_is_parallel):
    config = ModelParallelConfig(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(), sequence_parallel=sp
    )
    layer = RowParallelLinear(
        H,
        O,
        config=config,
        init_method=init_method_normal(0.2),
        bias=True,
        input_is_parallel=input_is_parallel,
        skip_bias_add=False,
    )
    with torch.no_grad():
        layer.bias.copy_(_randn(7, O))
    w_full = _gather(layer.weight.detach(), 1)
    x_full, g_full = _randn(1, S, B, H), _randn(2, S, B, O)
    y_ref, gx_ref, gw_ref, gb_ref = _reference_linear(x_full, w_full, layer.bias.detach(), g_full)

    x = (_shard(x_full, -1) if input_is_parallel else x_full).clone().requires_grad_(True)
    out, out_bias = layer(x)
    assert out_bias is None
    if sp:  # output [s/tp, b, o]
        _close("row fwd (sp)", out.detach(), _shard(y_ref, 0))
        out.backward(_shard(g_full, 0))
    else:
        _close("row fwd", out.detach(), y_ref)
        out.backward(g_full)
    _close("row grad input", x.grad, _shard(gx_ref, -1) if input_is_parallel else gx_ref)
    _close("row grad weight", layer.weight.grad, _shard(gw_ref, 1))
    assert layer.weight.partition_dim == 1 and layer.bias.sequence_parallel == sp
    bias_grad = layer.bias.grad.clone()
    if sp:
        # Each rank holds the bias gradient of its sequence chunk; finalize_model_grads sums them.
        torch.distributed.all_reduce(bias_grad, group=ps.get_tensor_model_parallel_group())
    _close("row grad bias", bias_grad, gb_ref)
    return True


def _check_column_row_block(sp):
    """The MLP pattern: column (no gather) -> gelu -> row (input parallel), vs two nn.Linear."""
    tp = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    fc1 = ColumnParallelLinear(H, O, config=config, init_method=init_method_normal(0.2), bias=True)
    fc2 = RowParallelLinear(
        O,
        H,
        config=config,
        init_method=init_method_normal(0.2),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    w1, b1 = _gather(fc1.weight.detach(), 0), _gather(fc1.bias.detach(), 0)
    w2, b2 = _gather(fc2.weight.detach(), 1), fc2.bias.detach()
    x_full, g_full = _randn(1, S, B, H), _randn(2, S, B, H)
    xr = x_full.clone().requires_grad_(True)
    ref = [w.clone().requires_grad_(True) for w in (w1, b1, w2, b2)]
    y_ref = F.linear(F.gelu(F.linear(xr, ref[0], ref[1])), ref[2], ref[3])
    y_ref.backward(g_full)

    x = (_shard(x_full, 0) if sp else x_full).clone().requires_grad_(True)
    y = fc2(F.gelu(fc1(x)[0]))[0]
    y.backward(_shard(g_full, 0) if sp else g_full)
    _close("block fwd", y.detach(), _shard(y_ref.detach(), 0) if sp else y_ref.detach())
    _close("block grad input", x.grad, _shard(xr.grad, 0) if sp else xr.grad)
    _close("block grad fc1.weight", fc1.weight.grad, _shard(ref[0].grad, 0))
    _close("block grad fc2.weight", fc2.weight.grad, _shard(ref[2].grad, 1))
    return True


def _check_embedding(reduce_scatter):
    tp = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=reduce_scatter)
    emb = VocabParallelEmbedding(
        V,
        H,
        init_method=init_method_normal(0.2),
        config=config,
        reduce_scatter_embeddings=reduce_scatter,
    )
    assert emb.weight.shape == (V // tp, H) and emb.weight.partition_dim == 0
    w_full = _gather(emb.weight.detach(), 0)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3)).to(
        get_current_device()
    )
    wr = w_full.clone().requires_grad_(True)
    y_ref = F.embedding(ids, wr)  # [b, s, h]
    g_full = _randn(4, B, S, H)
    y_ref.backward(g_full)
    out = emb(ids)
    if reduce_scatter:  # [s/tp, b, h]
        _close("embedding fwd (rs)", out.detach(), _shard(y_ref.detach().transpose(0, 1), 0))
        out.backward(_shard(g_full.transpose(0, 1), 0))
    else:
        _close("embedding fwd", out.detach(), y_ref.detach())
        out.backward(g_full)
    _close("embedding grad weight", emb.weight.grad, _shard(wr.grad, 0))
    return True


def _check_all_layers(sp):
    checks = []
    for gather_output, skip_bias_add in ((False, False), (False, True)) + (
        ((True, False),) if not sp else ()
    ):
        checks.append(_check_column(sp, gather_output, skip_bias_add))
    checks.append(_check_row(sp, True))
    if not sp:
        checks.append(_check_row(False, False))
    checks.append(_check_column_row_block(sp))
    checks.append(_check_embedding(sp))
    return len(checks)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, False), (4, True)])
def test_layers_match_unsharded_reference(tp, sp):
    counts = run_distributed(_check_all_layers, 4, tp=tp, args=(sp,))
    assert counts == [counts[0]] * 4 and counts[0] >= 4


@pytest.mark.gpu
def test_layers_on_gpu_with_nccl():
    tp = 2 if torch.cuda.device_count() >= 2 else 1
    counts = run_distributed(_check_all_layers, tp, tp=tp, args=(tp > 1,), backend="nccl")
    assert counts == [counts[0]] * tp


def _build_cpu_init_weights(use_cpu_initialization):
    tp = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp, use_cpu_initialization=use_cpu_initialization
    )
    init = init_method_normal(0.02)
    col = ColumnParallelLinear(H, O, config=config, init_method=init, bias=False, stride=2)
    row = RowParallelLinear(
        O,
        H,
        config=config,
        init_method=init,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    emb = VocabParallelEmbedding(V, H, init_method=init, config=config)
    return {"col": col.weight, "row": row.weight, "emb": emb.weight}


def test_cpu_initialization_gives_exact_slices_of_tp1_weights():
    full = run_distributed(_build_cpu_init_weights, 4, tp=1, args=(True,))[0]
    for tp in (2, 4):
        shards = run_distributed(_build_cpu_init_weights, 4, tp=tp, args=(True,))
        # Rows of the stride-2 column weight: rank r holds blocks r and r + tp of 2 * tp blocks.
        blocks = full["col"].chunk(2 * tp, dim=0)
        for r in range(tp):
            torch.testing.assert_close(
                shards[r]["col"], torch.cat([blocks[r], blocks[r + tp]]), rtol=0, atol=0
            )
        torch.testing.assert_close(
            torch.cat([s["row"] for s in shards[:tp]], dim=1), full["row"], rtol=0, atol=0
        )
        torch.testing.assert_close(
            torch.cat([s["emb"] for s in shards[:tp]], dim=0), full["emb"], rtol=0, atol=0
        )
        # Data parallel replicas (ranks tp..) hold the same slices.
        for r in range(tp, 4):
            torch.testing.assert_close(shards[r]["row"], shards[r - tp]["row"], rtol=0, atol=0)


def test_per_partition_init_uses_model_parallel_rng():
    a = run_distributed(_build_cpu_init_weights, 4, tp=2, args=(False,))
    b = run_distributed(_build_cpu_init_weights, 4, tp=2, args=(False,))
    # Deterministic for the seed, different across tp ranks, equal across dp replicas.
    torch.testing.assert_close(a[0]["row"], b[0]["row"], rtol=0, atol=0)
    assert not torch.equal(a[0]["row"], a[1]["row"])
    torch.testing.assert_close(a[0]["row"], a[2]["row"], rtol=0, atol=0)
    std = torch.cat([a[0]["col"].flatten(), a[1]["col"].flatten()]).std().item()
    assert 0.015 < std < 0.025


def _check_grad_accumulation_fusion():
    tp = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, gradient_accumulation_fusion=True)
    layer = ColumnParallelLinear(
        H, O, config=config, init_method=init_method_normal(0.2), bias=False
    )
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    x, g = _randn(1, S, B, H), _randn(2, S, B, O)
    expected = _shard(g, -1).reshape(-1, O // tp).t() @ x.reshape(-1, H)
    for _ in range(2):  # accumulates
        out, _ = layer(x)
        out.backward(_shard(g, -1))
    _close("main_grad", layer.weight.main_grad, 2 * expected)
    assert layer.weight.grad is None
    # With the DDP marker attribute the marker is set (the hook then skips the add); a weight
    # with zero_out_wgrad (tied to the embedding, whose lookup gives autograd the gradient the
    # hook adds) hands autograd no gradient at all.
    layer.weight.grad_added_to_main_grad = False
    layer(x)[0].backward(_shard(g, -1))
    assert layer.weight.grad_added_to_main_grad and layer.weight.grad.shape == layer.weight.shape
    _close("main_grad", layer.weight.main_grad, 3 * expected)
    layer.weight.grad, layer.weight.grad_added_to_main_grad = None, False
    layer.weight.zero_out_wgrad = True
    layer(x)[0].backward(_shard(g, -1))
    assert layer.weight.grad_added_to_main_grad and layer.weight.grad is None
    _close("main_grad", layer.weight.main_grad, 4 * expected)
    return True


def test_gradient_accumulation_fusion_accumulates_into_main_grad():
    assert all(run_distributed(_check_grad_accumulation_fusion, 4, tp=2))


def _check_extras():
    tp = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=tp)
    col = ColumnParallelLinear(
        H,
        O,
        config=config,
        init_method=init_method_normal(0.2),
        bias=False,
        skip_weight_param_allocation=True,
    )
    assert col.weight is None
    w = _randn(5, O // tp, H).requires_grad_(True)
    out, _ = col(_randn(1, S, B, H), weight=w)
    assert out.shape == (S, B, O // tp)
    try:
        col(_randn(1, S, B, H), weight=_randn(5, O, H))
    except RuntimeError as exc:
        assert "shape" in str(exc)
    else:
        raise AssertionError("wrong weight shape accepted")
    # The state dict carries the (empty) Transformer Engine compatible extra state.
    row = RowParallelLinear(
        O,
        H,
        config=config,
        init_method=init_method_normal(0.2),
        bias=True,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    assert set(row.state_dict()) == {"weight", "bias", "_extra_state"}
    _, bias = row(_randn(1, S, B, O // tp))
    assert bias is row.bias
    return True


def test_skip_weight_allocation_and_state_dict():
    assert all(run_distributed(_check_extras, 4, tp=2))


def _bad_row_config():
    config = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    try:
        RowParallelLinear(
            O,
            H,
            config=config,
            init_method=init_method_normal(0.2),
            bias=True,
            input_is_parallel=False,
            skip_bias_add=False,
        )
    except ValueError as exc:
        assert "input_is_parallel" in str(exc)
    else:
        raise AssertionError("sequence_parallel without input_is_parallel accepted")
    try:
        ColumnParallelLinear(H, 10, config=config, init_method=init_method_normal(0.2))
    except ValueError as exc:
        assert "output_size (10)" in str(exc) and "(4)" in str(exc)
    else:
        raise AssertionError("non-divisible output size accepted")
    return True


def test_layer_argument_errors():
    assert all(run_distributed(_bad_row_config, 4, tp=4))
