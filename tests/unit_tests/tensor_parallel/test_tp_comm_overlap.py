"""--tp-comm-overlap: the sequence-parallel linear layers with their all-gather / reduce-scatter
pipelined with the GEMM give the plain layers' outputs and gradients (input, weight, bias, and
main_grad with gradient accumulation fusion), for every combination of the overlap flags."""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, comm_overlap
from megatron.core.utils import init_method_normal
from tests.unit_tests.dist_utils import run_distributed

S, B, H, O = 8, 2, 16, 24  # sequence, batch, hidden, output features
TOL = dict(rtol=1e-6, atol=1e-6)

FLAG_SETS = [
    {},
    {"tp_comm_overlap_rs_dgrad": True},
    {"tp_comm_bulk_dgrad": False, "tp_comm_bulk_wgrad": False},
]


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(layer_cls, overlap, flags, fusion, weight=None, buffer_name=None):
    """(output, input grad, weight grad, bias grad) of one layer (its weight `weight` if given),
    and its weight."""
    tp = ps.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=True,
        tp_comm_overlap=overlap,
        gradient_accumulation_fusion=fusion,
        **flags,
    )
    rank = ps.get_tensor_model_parallel_rank()
    if layer_cls is ColumnParallelLinear:
        layer = ColumnParallelLinear(
            H,
            O,
            config=config,
            init_method=init_method_normal(0.2),
            bias=True,
            gather_output=False,
            tp_comm_buffer_name=buffer_name,
        )
        x = _randn(1, S, B, H).chunk(tp, dim=0)[rank]  # [s/tp, b, h]
        g = _randn(2 + rank, S, B, O // tp)
    else:
        layer = RowParallelLinear(
            O,
            H,
            config=config,
            init_method=init_method_normal(0.2),
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_comm_buffer_name=buffer_name,
        )
        x = _randn(3 + rank, S, B, O // tp)  # [s, b, o/tp]
        g = _randn(4, S, B, H).chunk(tp, dim=0)[rank]
    with torch.no_grad():
        layer.bias.copy_(_randn(9, layer.bias.numel()))
        if weight is not None:
            layer.weight.copy_(weight)
    if fusion:
        layer.weight.main_grad = torch.zeros_like(layer.weight)
    _run.last_layer = layer
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(g)
    weight_grad = layer.weight.main_grad if fusion else layer.weight.grad
    return (out.detach(), x.grad, weight_grad.clone(), layer.bias.grad), layer.weight.detach()


def _compare(layer_cls, flags, fusion):
    plain, weight = _run(layer_cls, False, flags, fusion)
    overlapped, _ = _run(layer_cls, True, flags, fusion, weight=weight)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), overlapped, plain):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}", **TOL)
    group = ps.get_tensor_model_parallel_group()
    return (
        comm_overlap.overlaps_all_gather(
            ModelParallelConfig(
                tensor_model_parallel_size=group.size(),
                tp_comm_overlap=True,
                sequence_parallel=True,
            ),
            True,
            group,
        ),
        torch.equal(overlapped[0], plain[0]) if layer_cls is ColumnParallelLinear else None,
    )


def _all_cases():
    results = []
    for layer_cls in (ColumnParallelLinear, RowParallelLinear):
        for flags in FLAG_SETS:
            for fusion in (False, True):
                results.append(_compare(layer_cls, flags, fusion))
    return results


@pytest.mark.parametrize("tp", [2, 4])
def test_overlapped_layers_equal_the_plain_layers(tp):
    for rank_results in run_distributed(_all_cases, tp, tp=tp):
        for used_overlap, column_forward_bitwise in rank_results:
            assert used_overlap
            # The column layer's pipelined all-gather computes every output row as the plain
            # GEMM does.
            assert column_forward_bitwise in (True, None)


def _ring_parts():
    group = ps.get_tensor_model_parallel_group()
    tp, rank = group.size(), group.rank()
    x = _randn(20 + rank, 2, 3, 5)  # this rank's chunk
    w = _randn(30, 5, 7)
    expected_ag = torch.cat([_randn(20 + r, 2, 3, 5) for r in range(tp)]) @ w
    y = _randn(40 + rank, 2 * tp, 3, 5)
    summed = sum(_randn(40 + r, 2 * tp, 3, 5) for r in range(tp)) @ w
    expected_rs = summed.chunk(tp)[rank]
    got_ag = comm_overlap.ring_all_gather_matmul(x, w, group)
    got_rs = comm_overlap.ring_matmul_reduce_scatter(y, w, group)
    return (
        torch.allclose(got_ag, expected_ag, **TOL),
        torch.allclose(got_rs, expected_rs, rtol=1e-5, atol=1e-5),
    )


def test_ring_kernels_equal_gather_then_multiply():
    for ag_ok, rs_ok in run_distributed(_ring_parts, 4, tp=4):
        assert ag_ok and rs_ok


def _validated(extra):
    from megatron.training.arguments import parse_args, validate_args

    base = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    base += "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 4 --lr 1e-3 "
    base += "--tensor-model-parallel-size 2"
    args = parse_args(args_list=base.split() + extra)
    args.world_size, args.rank = 2, 0
    return validate_args(args, {})


def test_flags_reach_the_layer_config_and_need_sequence_parallel():
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.cli.arguments_unsupported import UNSUPPORTED_FLAGS

    flags = ["--tp-comm-overlap", "--disable-tp-comm-bulk-wgrad", "--tp-comm-overlap-rs-dgrad"]
    flags += ["--disable-tp-comm-overlap-rs", "--disable-tp-comm-split-ag"]
    assert not set(f for f in flags if f.startswith("--")) & set(UNSUPPORTED_FLAGS)
    config = core_transformer_config_from_args(_validated(flags + ["--sequence-parallel"]))
    assert config.tp_comm_overlap and config.tp_comm_overlap_rs_dgrad
    assert not config.tp_comm_bulk_wgrad and config.tp_comm_bulk_dgrad
    assert not config.tp_comm_overlap_rs and config.tp_comm_overlap_ag
    assert not config.tp_comm_split_ag and config.tp_comm_split_rs

    class _TwoRanks:
        def size(self):
            return 2

    # --disable-tp-comm-overlap-rs / --disable-tp-comm-split-ag turn those pipelines off.
    assert not comm_overlap.overlaps_reduce_scatter(config, True, _TwoRanks())
    assert not comm_overlap.overlaps_all_gather(config, True, _TwoRanks())
    default = core_transformer_config_from_args(
        _validated(["--tp-comm-overlap", "--sequence-parallel"])
    )
    assert comm_overlap.overlaps_reduce_scatter(default, True, _TwoRanks())
    assert comm_overlap.overlaps_all_gather(default, True, _TwoRanks())
    assert not comm_overlap.overlaps_all_gather(default, False, _TwoRanks())  # no SP in the layer
    with pytest.raises(ValueError) as err:
        _validated(["--tp-comm-overlap"])
    assert str(err.value) == (
        "--tp-comm-overlap: tensor parallel communication/GEMM overlap can happen only when "
        "sequence parallelism is enabled (add --sequence-parallel, with "
        "--tensor-model-parallel-size > 1; got 2)"
    )


#: Global pipelines off; the userbuffers configuration turns them on for fc1 and fc2 only.
UB_CFGS = {
    'fc1_fprop': {'method': 'ring_exchange', 'num_sm': 2, 'cga_size': 2},
    'fc1_dgrad': {'method': 'pipeline', 'num_splits': 4},
    'fc1_wgrad': {'method': 'bulk'},
    'fc2_fprop': {'method': 'pipeline', 'atomic_gemm': 0},
}
CFG_FLAGS = {
    'tp_comm_overlap_ag': False,
    'tp_comm_overlap_rs': False,
    'tp_comm_bulk_wgrad': False,
    'tp_comm_overlap_ub_cfgs': UB_CFGS,
}


def _cfg_cases():
    from megatron.core.tensor_parallel.comm_overlap_cfg import layer_overlap

    results = []
    for layer_cls, listed, unlisted in (
        (ColumnParallelLinear, 'fc1', 'qkv'),
        (RowParallelLinear, 'fc2', 'proj'),
    ):
        plain, weight = _run(layer_cls, False, CFG_FLAGS, False, buffer_name=listed)
        overlapped, _ = _run(layer_cls, True, CFG_FLAGS, False, weight=weight, buffer_name=listed)
        for a, b in zip(overlapped, plain):
            torch.testing.assert_close(a, b, **TOL)
        config = _run.last_layer.config
        group = ps.get_tensor_model_parallel_group()
        check = (
            comm_overlap.overlaps_all_gather
            if layer_cls is ColumnParallelLinear
            else comm_overlap.overlaps_reduce_scatter
        )
        results.append((check(config, True, group, listed), check(config, True, group, unlisted)))
    fc1 = layer_overlap(config, 'fc1')
    results.append((fc1.tp_comm_overlap_rs_dgrad, fc1.tp_comm_bulk_wgrad))
    return results


def test_userbuffers_cfg_turns_on_the_listed_layers_only():
    for rank_results in run_distributed(_cfg_cases, 2, tp=2):
        assert rank_results == [(True, False), (True, False), (True, True)]


@pytest.mark.parametrize(
    "ub_cfgs, message",
    [
        ({"qkv_fprop": {"method": "bulk"}}, "qkv_fprop method 'bulk' is not one of"),
        ({"fc2_wgrad": {"method": "bulk"}}, "unknown GEMM 'fc2_wgrad'"),
        ({"attn_fprop": {}}, "unknown GEMM 'attn_fprop'"),
        (
            {"fc1_fprop": {"method": "pipeline", "num_cores": 3}},
            r"unknown settings \['num_cores'\]",
        ),
        ({"fc1_fprop": "pipeline"}, "fc1_fprop must be a mapping of settings"),
    ],
)
def test_tp_comm_overlap_cfg_is_checked_before_work(tmp_path, ub_cfgs, message):
    import yaml

    path = tmp_path / "ub.yaml"
    path.write_text(yaml.safe_dump(ub_cfgs))
    with pytest.raises(ValueError, match=message):
        _validated(["--tp-comm-overlap", "--sequence-parallel", "--tp-comm-overlap-cfg", str(path)])


def test_tp_comm_overlap_cfg_reaches_the_config(tmp_path):
    import yaml

    from megatron.training.arguments import core_transformer_config_from_args

    path = tmp_path / "ub.yaml"
    path.write_text(yaml.safe_dump(UB_CFGS))
    flags = ["--tp-comm-overlap", "--sequence-parallel", "--tp-comm-overlap-cfg", str(path)]
    config = core_transformer_config_from_args(_validated(flags))
    assert config.tp_comm_overlap_ub_cfgs == UB_CFGS
    with pytest.raises(ValueError, match="needs --tp-comm-overlap"):
        _validated(["--sequence-parallel", "--tp-comm-overlap-cfg", str(path)])
    with pytest.raises(ValueError, match="cannot read"):
        _validated(flags[:-1] + [str(tmp_path / "missing.yaml")])
