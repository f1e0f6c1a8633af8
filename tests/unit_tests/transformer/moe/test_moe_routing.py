"""Routing math against Megatron's worked example (T = 4 tokens, E = 4 experts, top-2), Hugging
Face's aux loss, and the router module's losses, gradients and logged values.

Example: softmax rows p = [.4 .3 .2 .1], [.1 .2 .3 .4], [.5 .25 .15 .1], [.3 .45 .1 .15], logits
ln p + c_t with c = [0, 1, 2, 0.5] (the offsets leave the softmax unchanged).
"""

import math

import pytest
import torch

from megatron.core.transformer.moe.moe_utils import (
    DROPPED_INDEX,
    permute,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    unpermute,
    z_loss_func,
)
from tests.unit_tests.dist_utils import run_distributed

P = torch.tensor(
    [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.15, 0.1], [0.3, 0.45, 0.1, 0.15]],
    dtype=torch.float64,
)
C = torch.tensor([0.0, 1.0, 2.0, 0.5], dtype=torch.float64)
LOGITS = torch.log(P) + C.unsqueeze(1)
MAX = DROPPED_INDEX
#: d aux / d logits with the counts held constant (coefficient 1e-2).
AUX_GRAD = torch.tensor(
    [
        [3.0e-4, 2.25e-4, -3.5e-4, -1.75e-4],
        [1.75e-4, 3.5e-4, -2.25e-4, -3.0e-4],
        [3.125e-4, 1.5625e-4, -2.8125e-4, -1.875e-4],
        [1.875e-4, 2.8125e-4, -1.875e-4, -2.8125e-4],
    ],
    dtype=torch.float64,
)


def test_topk_routing_of_the_example():
    probs, indices, counts = topk_softmax_with_capacity(LOGITS, 2)
    assert indices.tolist() == [[0, 1], [3, 2], [0, 1], [1, 0]]
    assert counts.tolist() == [3, 3, 1, 1]
    expected = [[0.4 / 0.7, 0.3 / 0.7], [0.4 / 0.7, 0.3 / 0.7], [2 / 3, 1 / 3], [0.6, 0.4]]
    torch.testing.assert_close(probs, torch.tensor(expected, dtype=torch.float64))
    pre, pre_indices, _ = topk_softmax_with_capacity(LOGITS, 2, use_pre_softmax=True)
    assert torch.equal(pre_indices, indices)
    expected_pre = [[0.4, 0.3], [0.4, 0.3], [0.5, 0.25], [0.45, 0.3]]
    torch.testing.assert_close(pre, torch.tensor(expected_pre, dtype=torch.float64))


def test_aux_loss_value_and_gradient():
    logits = LOGITS.clone().requires_grad_(True)
    _, _, counts = topk_softmax_with_capacity(logits.detach(), 2)
    scores = torch.softmax(logits, dim=-1)
    aux = switch_load_balancing_loss_func(scores, counts, 2, 1e-2)
    assert aux.item() == pytest.approx(0.01125, rel=1e-12)
    aux.backward()
    torch.testing.assert_close(logits.grad, AUX_GRAD, atol=1e-12, rtol=1e-9)


def test_aux_loss_is_hugging_faces_divided_by_topk():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf = load_balancing_loss_func((LOGITS.float(),), num_experts=4, top_k=2)
    _, _, counts = topk_softmax_with_capacity(LOGITS, 2)
    ours = switch_load_balancing_loss_func(torch.softmax(LOGITS, -1), counts, 2, 1.0)
    assert hf.item() == pytest.approx(2.25, rel=1e-6)
    assert ours.item() * 2 == pytest.approx(hf.item(), rel=1e-6)


def test_z_loss():
    assert z_loss_func(LOGITS, 1e-3).item() == pytest.approx(1.3125e-3, rel=1e-9)


def test_capacity_probs_policy():
    probs, indices, counts = topk_softmax_with_capacity(LOGITS, 2, capacity_factor=1.0)
    assert indices.tolist() == [[0, 1], [3, 2], [0, MAX], [1, MAX]]
    expected = [[0.4 / 0.7, 0.3 / 0.7], [0.4 / 0.7, 0.3 / 0.7], [2 / 3, 0.0], [0.6, 0.0]]
    torch.testing.assert_close(probs, torch.tensor(expected, dtype=torch.float64))
    assert counts.tolist() == [3, 3, 1, 1]  # counts before dropping (for the aux loss)


def test_capacity_position_policy_keeps_earliest_tokens():
    _, indices, _ = topk_softmax_with_capacity(
        LOGITS, 2, capacity_factor=1.0, drop_policy="position"
    )
    # Experts 0 and 1 are chosen by tokens 0, 2 and 3: token 3 (the latest) loses both.
    assert indices.tolist() == [[0, 1], [3, 2], [0, 1], [MAX, MAX]]


def test_capacity_above_token_count_drops_nothing():
    # Factor 2.5: capacity ceil(8 / 4 * 2.5) = 5 > 4 tokens (Megatron r0.8 raises here).
    probs, indices, _ = topk_softmax_with_capacity(LOGITS, 2, capacity_factor=2.5)
    plain_probs, plain_indices, _ = topk_softmax_with_capacity(LOGITS, 2)
    assert torch.equal(indices, plain_indices) and torch.equal(probs, plain_probs)
    padded_probs, padded_indices, _ = topk_softmax_with_capacity(
        LOGITS, 2, capacity_factor=2.5, pad_to_capacity=True
    )
    assert padded_indices.shape == (4, 5)
    assert padded_probs.sum().item() == pytest.approx(4.0)  # every token's probs, once


def test_pad_to_capacity_lists_tokens_per_expert():
    probs, indices, _ = topk_softmax_with_capacity(
        LOGITS, 2, capacity_factor=1.0, pad_to_capacity=True
    )
    assert indices.shape == (4, 2)
    assert indices[0].tolist() == [0, 2] and indices[1].tolist() == [0, 3]
    torch.testing.assert_close(probs[0], torch.tensor([0.4 / 0.7, 2 / 3], dtype=torch.float64))
    torch.testing.assert_close(probs[1], torch.tensor([0.3 / 0.7, 0.6], dtype=torch.float64))
    # Experts 2 and 3 have one token each; the other slot is a filler with prob 0.
    assert sorted(probs[2].tolist())[0] == 0.0 and sorted(probs[3].tolist())[0] == 0.0


def test_sigmoid_scores_and_expert_bias():
    probs, indices, _ = topk_softmax_with_capacity(LOGITS, 2, score_function="sigmoid")
    top = torch.sigmoid(LOGITS).gather(1, indices)
    torch.testing.assert_close(probs, top / top.sum(-1, keepdim=True))
    # A bias on expert 2 makes every token choose it; the probs stay unbiased scores.
    bias = torch.tensor([0.0, 0.0, 100.0, 0.0], dtype=torch.float64)
    probs, indices, _ = topk_softmax_with_capacity(LOGITS, 2, expert_bias=bias)
    assert (indices[:, 0] == 2).all()
    second = torch.topk(LOGITS.scatter(1, torch.full((4, 1), 2), -1e9), 1).values
    expected = torch.softmax(torch.cat([LOGITS[:, 2:3], second], dim=1), dim=-1)
    torch.testing.assert_close(probs, expected)


def test_sinkhorn_balances_marginals():
    out = sinkhorn(LOGITS.float())
    torch.testing.assert_close(out.sum(0), torch.full((4,), 0.25), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.sum(1), torch.full((4,), 0.25), atol=1e-3, rtol=0)


def test_permute_and_unpermute():
    indices = torch.tensor([[0, 1], [3, 2], [0, 1], [1, 0]])
    tokens = torch.arange(4, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    permuted, sorted_indices = permute(tokens, indices)
    assert sorted_indices.tolist() == [0, 4, 7, 1, 5, 6, 3, 2]
    assert permuted[:, 0].tolist() == [0, 2, 3, 0, 2, 3, 1, 1]
    probs = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    restored = unpermute(permuted, sorted_indices, probs)
    torch.testing.assert_close(restored, tokens)  # each token's probs sum to 1


# ---------------------------------------------------------------------------------------------
# the router module (one gloo rank)


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = value


def _router_body():
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        reset_aux_losses_tracker,
        track_moe_metrics,
    )
    from megatron.core.transformer.moe.router import TopKRouter
    from tests.unit_tests.transformer.moe.moe_test_utils import moe_config

    reset_aux_losses_tracker()
    config = moe_config(
        hidden_size=4,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
        moe_input_jitter_eps=0.1,
        num_layers=2,
        params_dtype=torch.float64,
    )
    router = TopKRouter(config).double()
    router.set_layer_number(2)
    with torch.no_grad():
        router.weight.copy_(LOGITS.t())  # x = identity: logits = W^T
    x = torch.eye(4, dtype=torch.float64).view(4, 1, 4)
    router.eval()
    eval_probs, eval_indices = router(x)  # no jitter in evaluation
    router.train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    config.moe_input_jitter_eps = None  # exact logits for the loss values
    probs, indices = router(x)
    probs.sum().mul(0).backward()  # only the auxiliary losses send gradients
    writer = _Writer()
    total = {}
    means = track_moe_metrics(1.0, 1, writer, total, per_layer_logging=True, log_expert_load=True)
    return dict(
        eval_indices=eval_indices,
        eval_probs=eval_probs,
        indices=indices,
        weight_grad=router.weight.grad,
        means=means,
        total=total,
        scalars=writer.scalars,
    )


def test_router_losses_gradient_and_logs():
    out = run_distributed(_router_body, 1)[0]
    assert out["indices"].tolist() == [[0, 1], [3, 2], [0, 1], [1, 0]]
    assert torch.equal(out["eval_indices"], out["indices"])
    # Gradient of aux (coeff 1e-2) + z-loss (coeff 1e-3, mean lse^2) with respect to the logits.
    lse = torch.logsumexp(LOGITS, dim=-1, keepdim=True)
    z_grad = 1e-3 * 2 * lse * torch.softmax(LOGITS, -1) / 4
    # The full softmax of the aux loss is fp32 (as Megatron), hence the tolerance.
    torch.testing.assert_close(out["weight_grad"].t(), AUX_GRAD + z_grad, atol=1e-9, rtol=1e-6)
    # Logged per layer (layer 2 of 2): the mean over layers halves the values.
    assert out["scalars"]["moe/load_balancing_loss_layer_1"] == pytest.approx(1.125)
    assert out["scalars"]["moe/z_loss_layer_1"] == pytest.approx(1.3125)
    assert out["scalars"]["moe/load_balancing_loss_layer_0"] == 0.0
    assert out["means"]["load_balancing_loss"] == pytest.approx(1.125 / 2)
    assert out["total"] == pytest.approx({"load_balancing_loss": 0.5625, "z_loss": 0.65625})
    fractions = [
        out["scalars"][f"moe/tokens_per_expert_fraction/layer_1/expert_{e}"] for e in range(4)
    ]
    assert fractions == pytest.approx([3 / 8, 3 / 8, 1 / 8, 1 / 8])
    assert out["scalars"]["moe/max_expert_fraction/layer_1"] == pytest.approx(3 / 8)
    assert not math.isnan(out["scalars"]["load_balancing_loss"])


def _expert_bias_body():
    from megatron.core.transformer.moe.router import TopKRouter, update_expert_bias
    from tests.unit_tests.transformer.moe.moe_test_utils import moe_config

    config = moe_config(
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.25, bf16=True
    )
    router = TopKRouter(config).bfloat16()  # as Float16Module casts the model
    dtypes = (router.weight.dtype, router.expert_bias.dtype, router.local_tokens_per_expert.dtype)
    router.local_tokens_per_expert.copy_(torch.tensor([300.0, 100.0, 200.0, 200.0]))
    update_expert_bias([router], group=None)
    first = router.expert_bias.clone()
    router.local_tokens_per_expert.copy_(torch.tensor([300.0, 100.0, 200.0, 200.0]))
    update_expert_bias([router], group=None)
    return dict(
        dtypes=dtypes, first=first, second=router.expert_bias, counts=router.local_tokens_per_expert
    )


def test_expert_bias_update_and_fp32_buffers():
    out = run_distributed(_expert_bias_body, 1)[0]
    assert out["dtypes"] == (torch.bfloat16, torch.float32, torch.float32)
    # bias += rate * sign(mean - count): mean 200; overloaded expert 0 down, expert 1 up.
    assert out["first"].tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert out["second"].tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert out["counts"].tolist() == [0.0, 0.0, 0.0, 0.0]  # reset once per global batch
