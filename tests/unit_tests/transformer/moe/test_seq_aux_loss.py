"""The sequence-level auxiliary loss (`--moe-router-load-balancing-type seq_aux_loss`) against
DeepSeek-V3's formula written out per sequence in the test (moe_test_utils.reference_seq_aux_loss):
its value and gradient for softmax and sigmoid scores, the router module's gradient and logged
`seq_load_balancing_loss`, and that the counts ignore the expert bias (they are the top-k of the
unbiased scores). The tensor / expert parallel layouts are in test_moe_layer_parallel.py.
"""

import pytest
import torch

from megatron.core.transformer.moe.moe_utils import (
    sequence_load_balancing_loss_func,
    switch_load_balancing_loss_func,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.transformer.moe.moe_test_utils import reference_seq_aux_loss

SEQ, BATCH, E, TOPK, COEFF = 6, 3, 4, 2, 1e-2


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SEQ * BATCH, E, generator=g, dtype=torch.float64)


def _scores(logits, score_function):
    if score_function == "sigmoid":
        s = torch.sigmoid(logits)
        return s / s.sum(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_value_and_gradient_match_the_per_sequence_formula(score_function):
    logits = _logits().requires_grad_(True)
    loss = sequence_load_balancing_loss_func(_scores(logits, score_function), BATCH, TOPK, COEFF)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = _logits().requires_grad_(True)
    ref = reference_seq_aux_loss(_scores(ref_logits, score_function), COEFF, BATCH, TOPK)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=0, rtol=1e-12)
    torch.testing.assert_close(grad, ref_logits.grad, atol=0, rtol=1e-10)


def test_one_sequence_is_the_switch_loss_and_more_sequences_are_not():
    scores = torch.softmax(_logits(1), dim=-1)
    counts = torch.bincount(torch.topk(scores, TOPK).indices.view(-1), minlength=E)
    whole = switch_load_balancing_loss_func(scores, counts, TOPK, COEFF)
    assert sequence_load_balancing_loss_func(scores, 1, TOPK, COEFF).item() == pytest.approx(
        whole.item(), rel=1e-12
    )
    # The per-sequence loss differs from the loss of the pooled tokens.
    per_sequence = sequence_load_balancing_loss_func(scores, BATCH, TOPK, COEFF).item()
    assert abs(per_sequence - whole.item()) > 1e-5


def _router_body(expert_bias):
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        reset_aux_losses_tracker,
        track_moe_metrics,
    )
    from megatron.core.transformer.moe.router import TopKRouter
    from tests.unit_tests.transformer.moe.moe_test_utils import moe_config

    reset_aux_losses_tracker()
    config = moe_config(
        hidden_size=E,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=COEFF,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=expert_bias,
        num_layers=1,
        params_dtype=torch.float64,
    )
    router = TopKRouter(config).double()
    router.set_layer_number(1)
    if expert_bias:
        # Steers the routing to experts 0 and 1; the loss's counts must not follow it.
        router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    with torch.no_grad():
        router.weight.copy_(torch.eye(E, dtype=torch.float64))  # logits = x
    x = _logits(2).view(SEQ, BATCH, E)
    router.train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    probs, indices = router(x)
    probs.sum().mul(0).backward()  # only the auxiliary loss sends gradients
    means = track_moe_metrics(1.0, 1, None, {})
    return dict(weight_grad=router.weight.grad, means=means, indices=indices)


@pytest.mark.parametrize("expert_bias", [False, True])
def test_router_gradient_and_log(expert_bias):
    out = run_distributed(_router_body, 1, args=(expert_bias,))[0]
    weight = torch.eye(E, dtype=torch.float64).requires_grad_(True)
    x = _logits(2)  # [s * b, E], rows in [s, b] order
    ref = reference_seq_aux_loss(_scores(x @ weight.t(), "sigmoid"), COEFF, BATCH, TOPK)
    ref.backward()
    # The router's balance scores are fp32 (as Megatron's), hence the tolerance.
    torch.testing.assert_close(out["weight_grad"], weight.grad, atol=1e-9, rtol=1e-5)
    assert out["means"]["seq_load_balancing_loss"] == pytest.approx(ref.item() / COEFF, rel=1e-6)
    if expert_bias:
        assert sorted(out["indices"][0].tolist()) == [0, 1]
