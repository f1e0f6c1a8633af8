"""Context-parallel attention on gloo ranks against full attention over the whole sequence.

Every rank builds the same full q, k, v [s, b, h, d] and output gradient, computes the reference
(torch SDPA in fp64 on the whole sequence, GQA through enable_gqa), slices its dual-chunk share
(chunks r and 2cp-1-r), runs `context_parallel_attention` on it and compares its output and its
q, k, v gradients with the same slices of the reference. Cases: cp 2, 3 and 4; every comm type
(p2p ring, all_gather, a2a Ulysses, a2a+p2p on hierarchical groups [2, 2]); MHA and GQA; causal
and no mask; fp32 (tolerance 2e-5, measured <= 1.2e-6) and bf16 (5e-2 against the fp64
reference of the bf16-rounded inputs).

Negative control (the mutation of the issue, kept as a check on the test's power): each rank
attending only to its own tokens misses the reference by far more than the tolerance.

Dropout: the ring's per-block keep-masks, assembled into one global mask, reproduce softmax
dropout on the whole sequence exactly (fp64); for every comm type the backward is checked against
a central finite difference of the forward (same seed, so the same masks).
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

D, B = 8, 2
FP32_TOL = 2e-5
BF16_TOL = 5e-2


def _inputs(cp, hq, hkv, dtype=torch.float64, seed=0):
    s = 8 * cp
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, B, hq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(s, B, hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(s, B, hkv, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(s, B, hq * D, generator=gen, dtype=torch.float64)
    # Round to the test dtype so the reference sees the same inputs.
    return [t.to(dtype).to(torch.float64) for t in (q, k, v, dout)]


def _reference(q, k, v, dout, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)),
        is_causal=causal,
        enable_gqa=True,
        scale=D**-0.5,
    )  # [b, h, s, d]
    out = out.permute(2, 0, 1, 3).reshape(q.size(0), B, -1)  # [s, b, h * d]
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _errors(groups, comm, hq, hkv, causal, dtype):
    """Max abs errors of (out, dq, dk, dv) of this rank's slice."""
    from megatron.core.transformer.context_parallel import (
        context_parallel_attention,
        slice_for_cp_rank,
    )

    cp, rank = groups.cp.size(), groups.cp.rank()
    q, k, v, dout = _inputs(cp, hq, hkv, dtype)
    ref = _reference(q, k, v, dout, causal)
    local = [slice_for_cp_rank(t, 0, cp, rank).to(dtype).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(
        *local, groups=groups, comm_type=comm, causal=causal, scale=D**-0.5
    )
    out.backward(slice_for_cp_rank(dout, 0, cp, rank).to(dtype))
    got = [out] + [t.grad for t in local]
    return [
        (g.double() - slice_for_cp_rank(r, 0, cp, rank)).abs().max().item()
        for g, r in zip(got, ref)
    ]


def _local_only_error(cp, rank, hq, hkv):
    """Error of the mutation 'each rank attends to its own tokens only' (no KV exchange)."""
    from megatron.core.transformer.context_parallel import slice_for_cp_rank

    q, k, v, dout = _inputs(cp, hq, hkv)
    ref = _reference(q, k, v, dout, True)[0]
    local = [slice_for_cp_rank(t, 0, cp, rank) for t in (q, k, v)]
    out = _reference(*local, slice_for_cp_rank(dout, 0, cp, rank), True)[0]
    return (out - slice_for_cp_rank(ref, 0, cp, rank)).abs().max().item()


def _cases(cp, heads):
    comms = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if cp == 4 else [])
    cases = [
        (comm, hq, hkv, causal, "fp32")
        for comm in comms
        for hq, hkv in heads
        for causal in (True, False)
    ]
    hq, hkv = heads[-1]
    cases += [(comm, hq, hkv, True, "bf16") for comm in comms]
    return cases


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _run_cases(cases, hierarchical):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.context_parallel import ContextParallelGroups

    if hierarchical is not None:
        cp = ps.get_context_parallel_world_size()
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchical
        )
        a2a, p2p = ps.get_hierarchical_context_parallel_groups()
        groups = ContextParallelGroups(ps.get_context_parallel_group(), a2a, p2p)
    else:
        groups = ContextParallelGroups(ps.get_context_parallel_group())
    results = {case: _errors(groups, *case[:4], _DTYPES[case[4]]) for case in cases}
    hq, hkv = cases[0][1:3]
    results["local_only"] = _local_only_error(groups.cp.size(), groups.cp.rank(), hq, hkv)
    if hierarchical is not None:
        results["hcp_ranks"] = [
            torch.distributed.get_process_group_ranks(g) for g in (groups.a2a, groups.p2p)
        ]
    return results


# (world size, cp, (hq, hkv) pairs: MHA then GQA); cp 2 runs on the 4-rank pool (dp 2).
LAYOUTS = {2: (4, 2, [(4, 4), (4, 2)]), 3: (3, 3, [(6, 6), (6, 3)]), 4: (4, 4, [(8, 8), (8, 4)])}
_RESULTS = {}


def _results(cp):
    if cp not in _RESULTS:
        world, _, heads = LAYOUTS[cp]
        hierarchical = [2, 2] if cp == 4 else None
        _RESULTS[cp] = run_distributed(
            _run_cases, world_size=world, cp=cp, args=(_cases(cp, heads), hierarchical)
        )
    return _RESULTS[cp]


def _all_cases():
    return [(cp,) + case for cp, (_, _, heads) in LAYOUTS.items() for case in _cases(cp, heads)]


@pytest.mark.parametrize("cp,comm,hq,hkv,causal,dtype", _all_cases())
def test_matches_full_attention(cp, comm, hq, hkv, causal, dtype):
    tol = FP32_TOL if dtype == "fp32" else BF16_TOL
    for rank, result in enumerate(_results(cp)):
        errors = result[(comm, hq, hkv, causal, dtype)]
        names = ("out", "dq", "dk", "dv")
        assert max(errors) < tol, f"rank {rank}: " + ", ".join(
            f"{n} {e:.2e}" for n, e in zip(names, errors)
        )


@pytest.mark.parametrize("cp", sorted(LAYOUTS))
def test_local_attention_is_caught(cp):
    """Dropping the KV exchange (each rank attends locally) fails the comparison above."""
    for rank, result in enumerate(_results(cp)):
        assert result["local_only"] > 1000 * FP32_TOL, (rank, result["local_only"])


def test_hierarchical_groups_layout():
    """cp 4 with sizes [2, 2]: level 0 (a2a) contiguous, level 1 (ring) strided."""
    expected = {0: [[0, 1], [0, 2]], 1: [[0, 1], [1, 3]], 2: [[2, 3], [0, 2]], 3: [[2, 3], [1, 3]]}
    for rank, result in enumerate(_results(4)):
        assert result["hcp_ranks"] == expected[rank]


# --------------------------------------------------------------------------------------------
# Attention dropout


def _dropout_reference_mask(cp, hq, seed, p):
    """The ring's keep-mask of every (query, key) pair of the global sequence [b, hq, s, s]."""
    from megatron.core.transformer.context_parallel.layout import cp_global_positions
    from megatron.core.transformer.context_parallel.ring_attention import (
        _block_plan,
        _dropout_for,
    )

    s = 8 * cp
    chunk = s // (2 * cp)
    mask = torch.zeros(B, hq, s, s, dtype=torch.float64)
    for rank in range(cp):
        q_pos = cp_global_positions(s, cp, rank)
        for step in range(cp):
            owner = (rank - step) % cp
            k_pos = cp_global_positions(s, cp, owner)
            ((q_rows, kv_rows, _, segment),) = _block_plan(step, rank, cp, True, [(0, 2 * chunk)])
            block = _dropout_for(p, seed, rank, step, cp, segment)
            rows, cols = q_pos[q_rows], k_pos[kv_rows]
            keep = block.keep_mask((B, hq, len(rows), len(cols)), "cpu", torch.float64)
            mask[:, :, rows[:, None], cols[None, :]] = keep
    return mask


def _dropout_checks(hq, hkv, p, seed):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.context_parallel import (
        ContextParallelGroups,
        context_parallel_attention,
        slice_for_cp_rank,
    )

    cp_size = ps.get_context_parallel_world_size()
    rank = ps.get_context_parallel_rank()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        context_parallel_size=cp_size, hierarchical_context_parallel_sizes=[2, 2]
    )
    a2a, p2p = ps.get_hierarchical_context_parallel_groups()
    groups = ContextParallelGroups(ps.get_context_parallel_group(), a2a, p2p)
    q, k, v, dout = _inputs(cp_size, hq, hkv)
    local = [slice_for_cp_rank(t, 0, cp_size, rank) for t in (q, k, v, dout)]
    kwargs = dict(groups=groups, causal=True, scale=D**-0.5, dropout_p=p, dropout_seed=seed)

    # Ring: exact against dropout of the global softmax with the assembled mask.
    mask = _dropout_reference_mask(cp_size, hq, seed, p)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    kf, vf = (t.repeat_interleave(hq // hkv, dim=2) for t in (kr, vr))
    scores = torch.einsum("sbhd,tbhd->bhst", qr, kf) * D**-0.5
    scores = scores.masked_fill(torch.ones(q.size(0), q.size(0)).triu(1).bool(), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1) * mask, vf).reshape(q.size(0), B, -1)
    ref.backward(dout)
    ql, kl, vl = (t.clone().requires_grad_() for t in local[:3])
    out = context_parallel_attention(ql, kl, vl, comm_type="p2p", **kwargs)
    out.backward(local[3])
    ring_errors = [
        (g - slice_for_cp_rank(r, 0, cp_size, rank)).abs().max().item()
        for g, r in zip((out, ql.grad, kl.grad, vl.grad), (ref, qr.grad, kr.grad, vr.grad))
    ]

    # Every comm type: same seed, same masks; backward = directional finite difference.
    gen = torch.Generator().manual_seed(7)
    directions = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in local[:3]]
    fd_errors = {}
    for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):

        def loss(inputs, comm=comm):
            out = context_parallel_attention(*inputs, comm_type=comm, **kwargs)
            value = (out * local[3]).sum()
            total = value.detach().clone()
            torch.distributed.all_reduce(total, group=groups.cp)
            return value, total

        inputs = [t.clone().requires_grad_() for t in local[:3]]
        loss(inputs)[0].backward()
        analytic = sum((t.grad * d).sum() for t, d in zip(inputs, directions))
        torch.distributed.all_reduce(analytic, group=groups.cp)
        eps = 1e-6
        plus = loss([t + eps * d for t, d in zip(local[:3], directions)])[1]
        minus = loss([t - eps * d for t, d in zip(local[:3], directions)])[1]
        fd_errors[comm] = abs(((plus - minus) / (2 * eps) - analytic).item())
        # Dropout was active: the output differs from the no-dropout one.
        no_drop = context_parallel_attention(
            *local[:3], groups=groups, comm_type=comm, causal=True, scale=D**-0.5
        )
        dropped = context_parallel_attention(*local[:3], comm_type=comm, **kwargs)
        fd_errors[comm + "_changed"] = (dropped - no_drop).abs().max().item()
    return ring_errors, fd_errors


def test_attention_dropout():
    results = run_distributed(_dropout_checks, world_size=4, cp=4, args=(8, 4, 0.25, 1234))
    for rank, (ring_errors, fd_errors) in enumerate(results):
        assert max(ring_errors) < 1e-10, (rank, ring_errors)
        for comm in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            assert fd_errors[comm] < 1e-6, (rank, comm, fd_errors[comm])
            assert fd_errors[comm + "_changed"] > 1e-2, (rank, comm)


# --------------------------------------------------------------------------------------------
# Refusals of the op


def test_a2a_head_split_refused_with_p2p_hint():
    from megatron.core.transformer.context_parallel import check_cp_attention_shapes

    with pytest.raises(ValueError, match=r"query groups \(2\).*use --cp-comm-type p2p$"):
        check_cp_attention_shapes("a2a", 4, 8, 2)
    with pytest.raises(ValueError, match="not one of"):
        check_cp_attention_shapes("ring", 2, 8, 8)
    check_cp_attention_shapes("p2p", 4, 8, 2)  # the ring splits the sequence, not the heads
    check_cp_attention_shapes("a2a+p2p", 4, 8, 2, a2a_size=2)


# --------------------------------------------------------------------------------------------
# The attention layer and RoPE on a real CP group


def _layer_checks():
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.context_parallel import slice_for_cp_rank
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    full = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, cp_group=None)
    full.cp_group = None  # the same table without CP slicing
    rope_error = (rope(32) - slice_for_cp_rank(full(32), 0, cp, rank)).abs().max().item()

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        context_parallel_size=cp,
        cp_comm_type=["a2a", "p2p"],
        attention_dropout=0.0,
    )
    layers = [DotProductAttention(config, n, AttnMaskType.causal, "self") for n in (1, 2)]
    refusals = []
    for mask in (AttnMaskType.padding, AttnMaskType.arbitrary):
        try:
            DotProductAttention(config, 1, mask, "self")
        except ValueError as error:
            refusals.append(str(error))
    # The layer's output equals the op's; [s/cp, b, np, hn] in, [s/cp, b, hp] out.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(8, 2, 4, 8, generator=gen)
    kv = torch.randn(8, 2, 2, 8, generator=gen)
    outs = [layer(q, kv, kv, None).shape for layer in layers]
    return rope_error, [layer.cp_comm_type for layer in layers], refusals, outs, _dropout_replay()


def _dropout_replay():
    """Attention dropout under CP: recompute (tensor_parallel.checkpoint, which restores the RNG
    states) replays the same masks, so its gradients equal those of the plain run; a second call
    draws new masks."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        context_parallel_size=ps.get_context_parallel_world_size(),
        attention_dropout=0.5,
    )
    layer = DotProductAttention(config, 1, AttnMaskType.causal, "self").train()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(8, 2, 4, 8, generator=gen) for _ in "qkv")
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = (torch.get_rng_state(), tracker.get_states())
    grads = []
    for recompute in (False, True):
        torch.set_rng_state(states[0])
        tracker.set_states(states[1])
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        if recompute:
            out = tensor_parallel.checkpoint(lambda *x: layer(*x, None), False, *inputs)
        else:
            out = layer(*inputs, None)
        out.sum().backward()
        grads.append([t.grad for t in inputs])
    again = layer(q, k, v, None)
    return {
        "replay": max((a - b).abs().max().item() for a, b in zip(*grads)),
        "new_masks": (again - out.detach()).abs().max().item(),
    }


def test_layer_dispatch_rope_slice_mask_refusal_and_dropout_recompute():
    for rope_error, comm_types, refusals, shapes, dropout in run_distributed(
        _layer_checks, world_size=4, cp=2
    ):
        assert dropout["replay"] == 0.0 and dropout["new_masks"] > 1e-3
        assert rope_error == 0.0
        assert comm_types == ["a2a", "p2p"]  # one comm type per layer
        assert shapes == [torch.Size([8, 2, 32])] * 2
        assert len(refusals) == 2
        assert refusals[0] == (
            "context_parallel_size (2): self attention with a padding mask cannot be split over "
            "the sequence; context parallelism supports causal and no_mask attention only (GPT), "
            "not padding masks (BERT, T5) or --reset-attention-mask"
        )


# --------------------------------------------------------------------------------------------
# GPU block kernels (skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_block_kernels_match_explicit(dtype, causal):
    """The fused CUDA block (flash, 16-bit) and the explicit block agree with SDPA on one GPU,
    forward, log-sum-exp and backward with GQA; fp32 runs the explicit block."""
    from megatron.core.transformer.context_parallel.block_attention import (
        block_backward,
        block_forward,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", generator=gen).to(dtype)
    k, v = (torch.randn(2, 4, 256, 64, device="cuda", generator=gen).to(dtype) for _ in "kv")
    dout = torch.randn(q.shape, device="cuda", generator=gen).to(dtype)
    scale = 64**-0.5
    out, lse = block_forward(q, k, v, causal=causal, scale=scale)
    grads = block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *ref_in, is_causal=causal, scale=scale, enable_gqa=True
    )
    ref.backward(dout.double())
    scores = (ref_in[0] @ ref_in[1].repeat_interleave(2, 1).transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(256, 256, device="cuda").triu(1).bool(), -1e30)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - ref).abs().max() < tol
    assert (lse.double() - torch.logsumexp(scores, -1)).abs().max() < tol * 10
    for got, want in zip(grads, (t.grad for t in ref_in)):
        assert (got.double() - want).abs().max() < tol * 10
