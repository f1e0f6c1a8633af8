"""Packed sequences (THD) under context parallelism: the per-sequence split and the attention.

- The split against literal index lists: rank r keeps chunks r and 2cp-1-r of EVERY packed
  sequence (Megatron's `get_thd_batch_on_this_cp_rank` with Transformer Engine's
  `thd_get_partitioned_indices`), and the per-rank real-token counts (`get_cu_seqlens_on_cp_rank`).
- The attention op on gloo ranks against full per-conversation causal attention (fp64 SDPA of each
  conversation's real tokens alone; padding rows give zero), forward and q/k/v gradients, for
  every comm type (p2p, all_gather, a2a, a2a+p2p on hierarchical groups [2, 2]), cp 2 and 4, GQA,
  two samples of uneven conversations, conversations shorter than 2 x cp.
- Negative controls (each misses the reference by far more than the tolerance): attention that
  leaks across the conversations of a sample, and the per-sequence split replaced by the plain
  dual-chunk split of the whole sample.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

D = 8
TOL = 2e-5
#: Per cp: per sample, (real tokens, padded length) of each conversation; the last one takes the
#: sample's pad tail. Padded lengths are multiples of 2 x cp; several conversations are shorter
#: than 2 x cp (1 and 2 tokens at cp 2; 1, 3, 5, 6, 7 at cp 4).
SAMPLES = {
    2: [[(5, 8), (1, 4), (9, 12), (2, 4)], [(3, 4), (13, 16), (6, 8)]],
    4: [[(5, 8), (1, 8), (11, 16), (3, 8)], [(17, 24), (7, 8), (6, 8)]],
}
#: (query heads, key/value heads) per cp: grouped queries, divisible by cp for the all-to-all.
HEADS = {2: (4, 2), 4: (8, 4)}


def _cu_rows(samples):
    """The dataset's per-sample cu_seqlens and cu_seqlens_unpadded ([b, L + 1] int32)."""
    length = sum(p for _, p in samples[0])
    padded, unpadded = [], []
    for conversations in samples:
        starts, reals = [0], [0]
        for real, size in conversations:
            starts.append(starts[-1] + size)
            reals.append(reals[-1] + real)
        assert starts[-1] == length
        padded.append(starts + [length] * (length + 1 - len(starts)))
        unpadded.append(reals + [reals[-1]] * (length + 1 - len(reals)))
    return torch.tensor(padded, dtype=torch.int32), torch.tensor(unpadded, dtype=torch.int32)


def test_thd_split_matches_literal_indices_and_counts():
    from megatron.core.transformer.context_parallel import (
        get_thd_batch_on_this_cp_rank,
        slice_for_cp_rank,
        thd_partitioned_indices,
    )

    # cp 2, a sample of 12 tokens: sequences of 4 (3 real) and 8 (5 real); chunks of 1 and 2.
    assert thd_partitioned_indices([0, 4, 12], 2, 0) == [0, 3, 4, 5, 10, 11]
    assert thd_partitioned_indices([0, 4, 12], 2, 1) == [1, 2, 6, 7, 8, 9]
    # cp 4, one sequence of 16: chunks of 2, rank r keeps r and 7 - r.
    assert thd_partitioned_indices([0, 16], 4, 1) == [2, 3, 12, 13]
    cu = torch.tensor([[0, 4] + [12] * 11], dtype=torch.int32)
    unpadded = torch.tensor([[0, 3] + [8] * 11], dtype=torch.int32)
    tokens = torch.arange(100, 112).view(1, 12)
    expected = {
        0: ([100, 103, 104, 105, 110, 111], [0, 2, 6], [0, 1, 3]),
        1: ([101, 102, 106, 107, 108, 109], [0, 2, 6], [0, 2, 5]),
    }
    for rank, (kept, offsets, reals) in expected.items():
        batch = {
            "tokens": tokens,
            "labels": None,
            "cu_seqlens": cu,
            "cu_seqlens_unpadded": unpadded,
        }
        local, params = get_thd_batch_on_this_cp_rank(batch, 2, rank)
        assert local["tokens"].tolist() == [kept] and local["labels"] is None
        assert (
            params.cu_seqlens_q_padded.tolist() == offsets == params.cu_seqlens_kv_padded.tolist()
        )
        assert params.cu_seqlens_q.tolist() == reals == params.cu_seqlens_kv.tolist()
        assert params.qkv_format == "thd" and int(params.max_seqlen_q) == 4
        # The plain dual-chunk split of the sample keeps other tokens (the mutation below).
        assert slice_for_cp_rank(tokens, 1, 2, rank).tolist() != [kept]
    # Size 1 keeps everything, in order, and describes the pad tail of the last segment.
    local, params = get_thd_batch_on_this_cp_rank(
        {"tokens": tokens, "cu_seqlens": cu, "cu_seqlens_unpadded": unpadded}, 1, 0
    )
    assert torch.equal(local["tokens"], tokens)
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    assert params.cu_seqlens_q.tolist() == [0, 3, 8]


def test_thd_split_refuses_sequences_not_padded_for_cp():
    from megatron.core.transformer.context_parallel import get_thd_batch_on_this_cp_rank

    cu = torch.tensor([[0, 6] + [12] * 11], dtype=torch.int32)
    with pytest.raises(ValueError, match="not a multiple of 2 x context parallel size"):
        get_thd_batch_on_this_cp_rank({"cu_seqlens": cu}, 2, 0)


def test_positions_within_sequences_on_cp_ranks():
    from megatron.core.transformer.context_parallel import (
        packed_position_ids_on_cp_rank,
        thd_partitioned_indices,
    )

    # Sequences of 4 and 8: the positions of the tokens each rank keeps.
    full = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7])
    for rank in range(2):
        offsets = torch.tensor([0, 2, 6])
        got = packed_position_ids_on_cp_rank(offsets, 6, 2, rank)
        assert got.tolist() == full[thd_partitioned_indices([0, 4, 12], 2, rank)].tolist()


def _inputs(samples, hq, hkv, seed=0):
    length = sum(p for _, p in samples[0])
    b = len(samples)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, b, hq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(length, b, hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(length, b, hkv, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(length, b, hq * D, generator=gen, dtype=torch.float64)
    return q, k, v, dout


def _reference(samples, q, k, v, dout, leak=False):
    """Causal attention of each conversation's real tokens alone (fp64), zero on padding; with
    `leak`, causal attention over each whole sample instead (the negative control)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    length, b, hq, _ = q.shape
    out = torch.zeros(length, b, hq * D, dtype=torch.float64)
    for i, conversations in enumerate(samples):
        spans, start = [], 0
        for real, size in conversations:
            spans.append((start, start + real))
            start += size
        if leak:
            spans = [(0, length)]
        for lo, hi in spans:
            piece = torch.nn.functional.scaled_dot_product_attention(
                *(t[lo:hi, i].transpose(0, 1) for t in (q, k, v)),
                is_causal=True,
                enable_gqa=True,
                scale=D**-0.5,
            )  # [h, n, d]
            out[lo:hi, i] = piece.transpose(0, 1).reshape(hi - lo, hq * D)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _local(t, indices):
    """This rank's share [L / cp, b, ...] of a full [L, b, ...] tensor (per-sample indices)."""
    return torch.stack([t[index, i] for i, index in enumerate(indices)], dim=1)


def _share(data_cp, cp, rank, cp_layout="per_sequence"):
    """Inputs, reference, per-sample indices and PackedSeqParams of CP rank `rank` of `cp`, on
    the samples padded for `data_cp` (SAMPLES[data_cp], HEADS[data_cp])."""
    from megatron.core.transformer.context_parallel import (
        get_thd_batch_on_this_cp_rank,
        sample_boundaries,
        slice_for_cp_rank,
        thd_partitioned_indices,
    )

    samples, (hq, hkv) = SAMPLES[data_cp], HEADS[data_cp]
    inputs = _inputs(samples, hq, hkv)
    ref = _reference(samples, *inputs)
    cu, unpadded = _cu_rows(samples)
    length = cu.shape[1] - 1
    if cp_layout == "plain":  # the mutation: the whole-sample dual-chunk split
        indices = [slice_for_cp_rank(torch.arange(length), 0, cp, rank)] * len(samples)
    else:
        indices = [thd_partitioned_indices(sample_boundaries(row, length), cp, rank) for row in cu]
    _, params = get_thd_batch_on_this_cp_rank(
        {"cu_seqlens": cu, "cu_seqlens_unpadded": unpadded}, cp, rank
    )
    return inputs, ref, indices, params


def _max_errors(attention, inputs, ref, indices):
    """Max abs errors (out, dq, dk, dv) of `attention` on this rank's share."""
    q, k, v, dout = inputs
    local = [_local(t, indices).float().requires_grad_() for t in (q, k, v)]
    out = attention(*local)
    out.backward(_local(dout, indices).float())
    got = [out] + [t.grad for t in local]
    return [(g.double() - _local(r, indices)).abs().max().item() for g, r in zip(got, ref)]


def _errors(groups, comm, cp_layout):
    """Max abs errors (out, dq, dk, dv) of the op on this rank's share; for p2p also the error
    of the negative control that leaks across conversations."""
    from megatron.core.transformer.context_parallel import context_parallel_attention

    cp, rank = groups.cp.size(), groups.cp.rank()
    inputs, ref, indices, params = _share(cp, cp, rank, cp_layout)

    def attention(q, k, v):
        return context_parallel_attention(
            q,
            k,
            v,
            groups=groups,
            comm_type=comm,
            causal=True,
            scale=D**-0.5,
            packed_seq_params=params,
        )

    errors = _max_errors(attention, inputs, ref, indices)
    if cp_layout == "per_sequence" and comm == "p2p":
        leaked = _reference(SAMPLES[cp], *inputs, leak=True)[0]
        errors.append((_local(leaked, indices) - _local(ref[0], indices)).abs().max().item())
    return errors


def _layer_errors(cp, masked=False):
    """The same through DotProductAttention: with context parallelism (comm type p2p), or at
    CP 1 on the whole packed batch (segments at the padded offsets) on its fused per-segment
    path or its masked block-diagonal path."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    data_cp = ps.get_context_parallel_world_size()
    hq, hkv = HEADS[data_cp]
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hq * D,
        num_attention_heads=hq,
        num_query_groups=hkv,
        context_parallel_size=cp,
        attention_dropout=0.0,
    )
    layer = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    if masked:
        layer._can_use_sdpa = lambda *args: False
    rank = ps.get_context_parallel_rank() if cp > 1 else 0
    inputs, ref, indices, params = _share(data_cp, cp, rank)
    return _max_errors(
        lambda q, k, v: layer(q, k, v, None, packed_seq_params=params), inputs, ref, indices
    )


def _run_cases(comms, hierarchical):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.context_parallel import ContextParallelGroups

    cp = ps.get_context_parallel_world_size()
    if hierarchical is not None:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchical
        )
        groups = ContextParallelGroups(
            ps.get_context_parallel_group(), *ps.get_hierarchical_context_parallel_groups()
        )
    else:
        groups = ContextParallelGroups(ps.get_context_parallel_group())
    results = {comm: _errors(groups, comm, "per_sequence") for comm in comms}
    results["plain_split"] = _errors(groups, "p2p", "plain")
    results["layer"] = _layer_errors(cp)
    results["layer_cp1_fused"] = _layer_errors(1)
    results["layer_cp1_masked"] = _layer_errors(1, masked=True)
    return results


_RESULTS = {}


def _results(cp):
    if cp not in _RESULTS:
        comms = ["p2p", "all_gather", "a2a"] + (["a2a+p2p"] if cp == 4 else [])
        _RESULTS[cp] = run_distributed(
            _run_cases, world_size=4, cp=cp, args=(comms, [2, 2] if cp == 4 else None)
        )
    return _RESULTS[cp]


@pytest.mark.parametrize(
    "cp,comm",
    [(2, "p2p"), (2, "all_gather"), (2, "a2a")]
    + [(4, c) for c in ("p2p", "all_gather", "a2a", "a2a+p2p")],
)
def test_packed_cp_attention_equals_each_conversation_alone(cp, comm):
    for rank, results in enumerate(_results(cp)):
        errors = results[comm][:4]
        assert max(errors) < TOL, (rank, dict(zip(("out", "dq", "dk", "dv"), errors)))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", ["layer", "layer_cp1_fused", "layer_cp1_masked"])
def test_dot_product_attention_layer_packed(cp, case):
    """DotProductAttention with packed params: at CP > 1 (this rank's params) and at CP 1 (the
    whole batch; padding rows inside conversations give zero there too)."""
    for rank, results in enumerate(_results(cp)):
        assert max(results[case]) < TOL, (rank, case, results[case])


@pytest.mark.parametrize("cp", [2, 4])
def test_negative_controls_miss_by_far(cp):
    """Leaking attention across conversations, or the plain dual-chunk split of the sample
    (attention then confined to the wrong tokens), miss the reference by > 1000 x TOL."""
    for results in _results(cp):
        assert results["p2p"][4] > 1000 * TOL  # leaking across conversations
        assert results["plain_split"][0] > 1000 * TOL
