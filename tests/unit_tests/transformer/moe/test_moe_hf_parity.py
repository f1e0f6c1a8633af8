"""MoELayer against Hugging Face's MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock (tiny random
configs built here): the output and every gradient (input, router, each expert's gate/up and down
weights, the shared expert and its gate) at atol 1e-5, for both dispatchers and grouped experts.

Mixtral's routing (softmax over all experts, top-k, renormalize) is Megatron's default router;
Qwen2-MoE's `norm_topk_prob=False` is `--moe-router-pre-softmax`, its shared expert and sigmoid
gate are `moe_shared_expert_intermediate_size` and `moe_shared_expert_gate`.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.transformer.moe.moe_test_utils import (
    BATCH,
    FFN,
    SEQ,
    E,
    H,
    global_weights,
    load_weights,
    moe_config,
)

SHARED = 12
ATOL = 1e-5


def _hf_block(kind):
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(
            hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=2
        )
        return MixtralSparseMoeBlock(config)
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(
        hidden_size=H,
        moe_intermediate_size=FFN,
        shared_expert_intermediate_size=SHARED,
        num_experts=E,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    )
    return Qwen2MoeSparseMoeBlock(config)


def _load_hf(block, w):
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        block.experts.gate_up_proj.copy_(w["w1"])  # [E, 2f, h]: rows [gate; up]
        block.experts.down_proj.copy_(w["w2"])  # [E, h, f]
        if "s1" in w:
            gate, up = w["s1"].chunk(2, dim=0)
            block.shared_expert.gate_proj.weight.copy_(gate)
            block.shared_expert.up_proj.weight.copy_(up)
            block.shared_expert.down_proj.weight.copy_(w["s2"])
            block.shared_expert_gate.weight.copy_(w["gate"])


def _compare(kind, dispatcher, grouped):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLP
    from megatron.core.transformer.spec_utils import build_module

    qwen = kind == "qwen2_moe"
    config = moe_config(
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=grouped,
        moe_router_pre_softmax=qwen,
        moe_shared_expert_intermediate_size=SHARED if qwen else None,
        moe_shared_expert_gate=qwen,
    )
    layer = build_module(get_gpt_layer_local_spec(E, grouped).submodules.mlp, config=config)
    w = global_weights(seed=3, shared_size=SHARED if qwen else None)
    load_weights(layer, w)
    hf = _hf_block(kind)
    _load_hf(hf, w)

    x = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(5))
    grad = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(6))
    ours_x = x.clone().requires_grad_(True)
    out, _ = layer(ours_x)
    (out * grad).sum().backward()
    hf_x = x.transpose(0, 1).contiguous().requires_grad_(True)  # HF: [b, s, h]
    hf_out = hf(hf_x)
    (hf_out * grad.transpose(0, 1)).sum().backward()

    pairs = {
        "output": (out, hf_out.transpose(0, 1)),
        "input grad": (ours_x.grad, hf_x.grad.transpose(0, 1)),
        "router grad": (layer.router.weight.grad, hf.gate.weight.grad),
    }
    experts = layer.experts
    for e in range(E):
        if isinstance(experts, GroupedMLP):
            fc1 = experts.weight1.grad.view(E, H, -1)[e].t()
            fc2 = experts.weight2.grad.view(E, -1, H)[e].t()
        else:
            fc1 = experts.local_experts[e].linear_fc1.weight.grad
            fc2 = experts.local_experts[e].linear_fc2.weight.grad
        pairs[f"expert {e} fc1 grad"] = (fc1, hf.experts.gate_up_proj.grad[e])
        pairs[f"expert {e} fc2 grad"] = (fc2, hf.experts.down_proj.grad[e])
    if qwen:
        shared = layer.shared_experts
        pairs["shared fc1 grad"] = (
            shared.linear_fc1.weight.grad,
            torch.cat(
                [hf.shared_expert.gate_proj.weight.grad, hf.shared_expert.up_proj.weight.grad]
            ),
        )
        pairs["shared fc2 grad"] = (
            shared.linear_fc2.weight.grad,
            hf.shared_expert.down_proj.weight.grad,
        )
        pairs["shared gate grad"] = (shared.gate_weight.grad, hf.shared_expert_gate.weight.grad)
    return {k: (a.detach(), b.detach()) for k, (a, b) in pairs.items()}


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_layer_matches_hf_block(kind):
    for dispatcher, grouped in (("allgather", False), ("alltoall", False), ("alltoall", True)):
        pairs = run_distributed(_compare, 1, args=(kind, dispatcher, grouped))[0]
        for name, (ours, theirs) in pairs.items():
            torch.testing.assert_close(
                ours,
                theirs,
                atol=ATOL,
                rtol=0,
                msg=f"{kind} {dispatcher} grouped={grouped}: {name}",
            )
