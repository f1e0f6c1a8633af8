"""MoELayer on expert / tensor / data parallel gloo ranks against a plain-PyTorch reference.

Every rank of a tensor-parallel group holds a slice (sequence parallel) of one sequence; each
data-parallel replica has its own sequence. The reference runs the unsharded MoE on the
sequences of the rank's tensor x expert group (the tokens its experts see) with the global
weights, and each rank compares its output, its input gradient, its experts' weight-gradient
shards and (summed over the group) the router gradient. Tolerance 1e-5 (float32 summation order).

The sequence-level auxiliary loss (seq_aux_loss) at tp2 x ep2 with both dispatchers.

Also: the allgather and alltoall dispatchers give bit-identical results at tp = 1 (k = 2);
grouped experts equal sequential ones; a rank whose experts receive no token works and gets
zero (not missing) expert gradients; capacity drops the same pairs with and without padding at
any ep, as the reference with the same drops.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.transformer.moe.moe_test_utils import (
    BATCH,
    SEQ,
    E,
    H,
    expert_grads,
    global_weights,
    glu_shard,
    load_weights,
    moe_config,
    reference_aux_loss,
    reference_moe,
    reference_seq_aux_loss,
)

WORLD = 4
ATOL = 1e-5


def _sequence(i, zero_token=False):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(SEQ, BATCH, H, generator=g)
    return x.abs() if zero_token else x


def _output_grad(i):
    return torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(200 + i))


def _layer_body(
    dispatcher,
    grouped=False,
    aux_coeff=0.0,
    zero_token=False,
    extended_tp=False,
    capacity=None,
    pad=False,
    recompute=False,
    balancing="aux_loss",
):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        topk_softmax_with_capacity,
    )
    from megatron.core.transformer.spec_utils import build_module

    config = moe_config(
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped,
        moe_router_load_balancing_type=balancing if aux_coeff else "none",
        moe_aux_loss_coeff=aux_coeff,
        moe_extended_tp=extended_tp,
        moe_expert_capacity_factor=capacity,
        moe_pad_expert_input_to_capacity=pad,
        moe_layer_recompute=recompute,
    )
    layer = build_module(get_gpt_layer_local_spec(E, grouped).submodules.mlp, config=config)
    layer.set_layer_number(1)
    w = global_weights(seed=1)
    if zero_token:
        # Positive inputs and a router that always prefers experts 2 and 3: the ranks holding
        # experts 0 and 1 receive no token.
        w["router"] = torch.tensor([[-1.0], [-0.5], [1.0], [0.5]]).expand(E, H).contiguous()
    load_weights(layer, w)
    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    rank = torch.distributed.get_rank()

    x_full = _sequence(rank // tp, zero_token)
    x = x_full.chunk(tp, dim=0)[tp_rank].clone().requires_grad_(True)
    layer.train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    out, bias = layer(x)
    assert bias is None
    (out * _output_grad(rank // tp).chunk(tp, dim=0)[tp_rank]).sum().backward()

    # Reference: the sequences of every rank whose tokens reach this rank's experts.
    tp_ep_group = ps.get_tensor_and_expert_parallel_group()
    sequences = sorted({r // tp for r in torch.distributed.get_process_group_ranks(tp_ep_group)})
    ref_w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    total = 0.0
    for i in sequences:
        xi = _sequence(i, zero_token).view(-1, H).requires_grad_(True)
        keep = None
        if capacity is not None:
            logits = (xi @ ref_w["router"].t()).detach()
            _, kept, _ = topk_softmax_with_capacity(logits, 2, capacity_factor=capacity)
            keep = kept != torch.iinfo(torch.long).max
        out_i, scores, idx = reference_moe(xi, ref_w, keep=keep)
        total = total + (out_i * _output_grad(i).view(-1, H)).sum()
        if aux_coeff and balancing == "seq_aux_loss":
            total = total + reference_seq_aux_loss(scores, aux_coeff, BATCH)
        elif aux_coeff:
            total = total + reference_aux_loss(scores, idx, aux_coeff)
        if i == rank // tp:
            ref_out, ref_x = out_i, xi
    total.backward()

    router_grad = layer.router.weight.grad.clone()
    torch.distributed.all_reduce(router_grad, group=tp_ep_group)
    etp = layer.experts.tp_group
    ref_expert_grads = {}
    for expert_id in layer.local_expert_indices:
        ref_expert_grads[(expert_id, "fc1")] = glu_shard(
            ref_w["w1"].grad[expert_id], etp.size(), etp.rank()
        )
        ref_expert_grads[(expert_id, "fc2")] = (
            ref_w["w2"].grad[expert_id].chunk(etp.size(), dim=1)[etp.rank()]
        )
    rows = slice(tp_rank * x.numel() // H, (tp_rank + 1) * x.numel() // H)
    return dict(
        out=out.detach().reshape(-1, H),
        ref_out=ref_out.detach()[rows],
        x_grad=x.grad.reshape(-1, H),
        ref_x_grad=ref_x.grad[rows],
        router_grad=router_grad,
        ref_router_grad=ref_w["router"].grad,
        expert_grads=expert_grads(layer),
        ref_expert_grads=ref_expert_grads,
    )


def _check(results):
    for rank, r in enumerate(results):
        msg = f"rank {rank}"
        torch.testing.assert_close(r["out"], r["ref_out"], atol=ATOL, rtol=0, msg=msg)
        torch.testing.assert_close(r["x_grad"], r["ref_x_grad"], atol=ATOL, rtol=0, msg=msg)
        torch.testing.assert_close(
            r["router_grad"], r["ref_router_grad"], atol=ATOL, rtol=0, msg=msg
        )
        assert r["expert_grads"].keys() == r["ref_expert_grads"].keys()
        for key, grad in r["expert_grads"].items():
            assert grad is not None, (rank, key)
            torch.testing.assert_close(
                grad, r["ref_expert_grads"][key], atol=ATOL, rtol=0, msg=f"{msg} {key}"
            )


LAYOUTS = {
    # name: (tp, ep)
    "dp4": (1, 1),
    "ep2": (1, 2),
    "ep4": (1, 4),
    "tp2_ep2": (2, 2),
    "tp2": (2, 1),
}


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_seq_aux_loss_at_tp2_ep2(dispatcher):
    """The sequence-level loss with each tp rank holding half of the positions of the BATCH
    sequences (sequence parallel): the alltoall dispatcher routes the gathered logits,
    allgather its own half (the counts summed over tp)."""
    results = run_distributed(
        _layer_body,
        WORLD,
        tp=2,
        ep=2,
        args=(dispatcher,),
        kwargs=dict(aux_coeff=1e-1, balancing="seq_aux_loss"),
    )
    _check(results)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_reference(layout, dispatcher):
    tp, ep = LAYOUTS[layout]
    aux = 1e-2 if layout in ("ep2", "tp2_ep2") else 0.0
    results = run_distributed(
        _layer_body, WORLD, tp=tp, ep=ep, args=(dispatcher,), kwargs=dict(aux_coeff=aux)
    )
    _check(results)


def test_grouped_experts_and_extended_tp():
    for tp, ep, kwargs in (
        (1, 2, dict(grouped=True)),
        (2, 2, dict(grouped=True)),
        (2, 2, dict(extended_tp=True)),
        (1, 2, dict(recompute=True, aux_coeff=1e-2)),
    ):
        _check(
            run_distributed(_layer_body, WORLD, tp=tp, ep=ep, args=("allgather",), kwargs=kwargs)
        )


def test_dispatchers_are_bit_identical_at_tp1():
    for ep in (2, 4):
        got = {
            d: run_distributed(_layer_body, WORLD, ep=ep, args=(d,), kwargs=dict(aux_coeff=1e-2))
            for d in ("allgather", "alltoall")
        }
        for a, b in zip(got["allgather"], got["alltoall"]):
            for key in ("out", "x_grad", "router_grad"):
                assert torch.equal(a[key], b[key]), key
            for key, grad in a["expert_grads"].items():
                assert torch.equal(grad, b["expert_grads"][key]), key


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_rank_without_tokens(dispatcher):
    for grouped in (False, True):
        results = run_distributed(
            _layer_body,
            WORLD,
            ep=2,
            args=(dispatcher,),
            kwargs=dict(zero_token=True, grouped=grouped),
        )
        _check(results)
        # Ranks 0 and 2 hold experts 0 and 1, which no token chose: zero gradients, not None.
        for rank in (0, 2):
            for grad in results[rank]["expert_grads"].values():
                assert torch.count_nonzero(grad) == 0


def test_capacity_drop_and_pad():
    for ep, pad in ((1, False), (2, False), (2, True), (4, True)):
        results = run_distributed(
            _layer_body, WORLD, ep=ep, args=("alltoall",), kwargs=dict(capacity=0.5, pad=pad)
        )
        _check(results)
