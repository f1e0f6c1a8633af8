"""Helpers of the MoE layer tests: tiny configs, global weights copied into a (sharded) MoELayer,
and a plain-PyTorch reference MoE.

Global weights (one dict): router [E, h]; w1 [E, 2f, h] (rows [gate; up]); w2 [E, h, f]; with
shared experts s1 [2fs, h], s2 [h, fs], gate [1, h]. Imported inside spawned ranks, so everything
is module level.
"""

import torch
import torch.nn.functional as F

H, FFN, E, SEQ, BATCH = 16, 8, 4, 8, 2


def moe_config(**overrides):
    """TransformerConfig of one SwiGLU MoE layer on the current parallel layout."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    kw = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        num_moe_experts=E,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def global_weights(seed=0, shared_size=None, num_experts=E, ffn=FFN):
    g = torch.Generator().manual_seed(seed)
    w = {
        "router": torch.randn(num_experts, H, generator=g) * 0.5,
        "w1": torch.randn(num_experts, 2 * ffn, H, generator=g) * 0.3,
        "w2": torch.randn(num_experts, H, ffn, generator=g) * 0.3,
    }
    if shared_size is not None:
        w["s1"] = torch.randn(2 * shared_size, H, generator=g) * 0.3
        w["s2"] = torch.randn(H, shared_size, generator=g) * 0.3
        w["gate"] = torch.randn(1, H, generator=g) * 0.3
    return w


def glu_shard(w, tp, rank):
    """Rows [gate_r; up_r] of a [2f, h] gated weight for tp rank `rank`."""
    gate, up = torch.chunk(w, 2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)


def load_weights(layer, w):
    """Copy the global weights into a (sharded) MoELayer of this rank."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    experts = layer.experts
    tp_group = experts.tp_group
    tp, rank = tp_group.size(), tp_group.rank()
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        for i, expert_id in enumerate(layer.local_expert_indices):
            fc1 = glu_shard(w["w1"][expert_id], tp, rank)  # [2f/tp, h]
            fc2 = w["w2"][expert_id].chunk(tp, dim=1)[rank]  # [h, f/tp]
            if isinstance(experts, GroupedMLP):
                nle = experts.num_local_experts
                experts.weight1.view(nle, H, -1)[i].copy_(fc1.t())
                experts.weight2.view(nle, -1, H)[i].copy_(fc2.t())
            else:
                experts.local_experts[i].linear_fc1.weight.copy_(fc1)
                experts.local_experts[i].linear_fc2.weight.copy_(fc2)
        if layer.shared_experts is not None:
            stp = layer.pg_collection.tp
            shared = layer.shared_experts
            shared.linear_fc1.weight.copy_(glu_shard(w["s1"], stp.size(), stp.rank()))
            shared.linear_fc2.weight.copy_(w["s2"].chunk(stp.size(), dim=1)[stp.rank()])
            if shared.gate_weight is not None:
                shared.gate_weight.copy_(w["gate"])


def expert_grads(layer):
    """{(global expert id, 'fc1' | 'fc2'): this rank's gradient shard in the [2f, h] / [h, f]
    orientation of the global weights (fc1 rows [gate_r; up_r])."""
    from megatron.core.transformer.moe.experts import GroupedMLP

    experts = layer.experts
    out = {}
    for i, expert_id in enumerate(layer.local_expert_indices):
        if isinstance(experts, GroupedMLP):
            nle = experts.num_local_experts
            out[(expert_id, "fc1")] = experts.weight1.grad.view(nle, H, -1)[i].t()
            out[(expert_id, "fc2")] = experts.weight2.grad.view(nle, -1, H)[i].t()
        else:
            out[(expert_id, "fc1")] = experts.local_experts[i].linear_fc1.weight.grad
            out[(expert_id, "fc2")] = experts.local_experts[i].linear_fc2.weight.grad
    return out


def reference_moe(x, w, topk=2, pre_softmax=False, keep=None):
    """Plain MoE on x [T, h]: softmax routing (top-k renormalized, or pre-softmax top-k),
    SwiGLU experts, shared experts if present. `keep` [T, k] (bool) drops pairs.

    Returns (output [T, h], full fp32 softmax [T, E], top-k indices [T, k]).
    """
    logits = x @ w["router"].t()
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, idx = torch.topk(scores, topk, dim=-1)
    if not pre_softmax:
        top = top / top.sum(dim=-1, keepdim=True)
    if keep is not None:
        top = top * keep
    out = torch.zeros_like(x)
    for e in range(w["router"].shape[0]):
        rows, slots = torch.nonzero(idx == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        gate, up = (x[rows] @ w["w1"][e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w["w2"][e].t()
        out = out.index_add(0, rows, y * top[rows, slots].unsqueeze(1))
    if "s1" in w:
        gate, up = (x @ w["s1"].t()).chunk(2, dim=-1)
        shared = (F.silu(gate) * up) @ w["s2"].t()
        out = out + shared * torch.sigmoid(x @ w["gate"].t())
    return out, scores, idx


def reference_aux_loss(scores, idx, coeff, topk=2):
    """Switch loss of one sequence: coeff * E / (T^2 k) * sum_e n_e sum_t p_te."""
    num_tokens, num_experts = scores.shape
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts).float()
    return (scores.sum(0) * counts).sum() * num_experts * coeff / (num_tokens**2 * topk)


def reference_seq_aux_loss(scores, coeff, batch, topk=2):
    """DeepSeek-V3's sequence-wise balance loss written out per sequence: scores [s * b, E]
    (rows in [s, b] order, normalised per token); for each sequence f_e = E / (k S) x (tokens
    whose top-k holds e), P_e = mean_t p_te; coeff * sum_e f_e P_e, averaged over the b."""
    num_experts = scores.shape[1]
    per_sequence = scores.view(-1, batch, num_experts)  # [s, b, E]
    total = 0.0
    for b in range(batch):
        p = per_sequence[:, b]  # [S, E]
        length = p.shape[0]
        chosen = torch.topk(p.detach(), topk, dim=-1).indices  # [S, k]
        hits = torch.stack([(chosen == e).any(dim=-1).sum() for e in range(num_experts)])
        f = hits.to(p.dtype) * num_experts / (topk * length)
        total = total + coeff * (f * p.mean(dim=0)).sum()
    return total / batch
