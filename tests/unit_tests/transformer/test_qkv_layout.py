"""The fused QKV row layout of `linear_qkv`, checked against literal row numbers.

Megatron-core lays out the rows of `linear_qkv.weight` grouped per query group,
`[ng, np/ng + 2, hn]`: for group g, its np/ng query heads (hn rows each), then its key head (hn
rows), then its value head (hn rows). Tensor parallelism hands each rank a contiguous slice of
rows (whole groups). Query head i attends with the key/value head of group i // (np/ng).

The expected tables below are written out by hand for the two shapes used here (no helper of the
package computes them, and `hf_weight_mapping` is not used), so a change of the layout that is
applied consistently everywhere (e.g. key and value swapped in the split and in the checkpoint
converter alike) still fails.

How rows are made visible: the input is the one-hot vector e_0 at every position and row r of the
weight has r + 1 in column 0 (zero elsewhere, no bias), so output feature r of `linear_qkv` is
r + 1. Inside Attention's split, each q/k/v element then names the global weight row it came
from.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

HN = 2  # head size
NP = 4  # query heads

# Global rows (0-based) feeding each head, per case. MHA: ng = np = 4, so 3 * hn = 6 rows per
# group. GQA: ng = 2, so (2 + 2) * hn = 8 rows per group.
EXPECTED = {
    "mha": {
        "ng": 4,
        "q": {0: [0, 1], 1: [6, 7], 2: [12, 13], 3: [18, 19]},
        "k": {0: [2, 3], 1: [8, 9], 2: [14, 15], 3: [20, 21]},
        "v": {0: [4, 5], 1: [10, 11], 2: [16, 17], 3: [22, 23]},
        # value group used by each query head
        "v_of_q": {0: [4, 5], 1: [10, 11], 2: [16, 17], 3: [22, 23]},
    },
    "gqa": {
        "ng": 2,
        "q": {0: [0, 1], 1: [2, 3], 2: [8, 9], 3: [10, 11]},
        "k": {0: [4, 5], 1: [12, 13]},
        "v": {0: [6, 7], 1: [14, 15]},
        "v_of_q": {0: [6, 7], 1: [6, 7], 2: [14, 15], 3: [14, 15]},
    },
}


def _attention(ng, zero_rows=()):
    """A SelfAttention (local spec) whose linear_qkv row r (global numbering) is (r + 1) * e_0
    except `zero_rows`, which are zero; linear_proj the identity; no biases."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    hidden = NP * HN
    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=NP,
        num_query_groups=ng,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec().submodules.self_attention
    attn = build_module(spec, config=config, layer_number=1)
    rows = (NP + 2 * ng) * HN
    full_qkv = torch.zeros(rows, hidden)
    full_qkv[:, 0] = torch.arange(1, rows + 1, dtype=torch.float32)
    full_qkv[list(zero_rows)] = 0.0
    cols = hidden // tp
    with torch.no_grad():
        # Contiguous row slice per TP rank (ColumnParallelLinear splits dim 0), column slice of
        # the output projection (RowParallelLinear splits dim 1).
        attn.linear_qkv.weight.copy_(full_qkv[rank * rows // tp : (rank + 1) * rows // tp])
        attn.linear_proj.weight.copy_(torch.eye(hidden)[:, rank * cols : (rank + 1) * cols])
    return attn, rank


def _split_and_forward(case):
    exp = EXPECTED[case]
    x = torch.zeros(3, 1, NP * HN)  # [s, b, h]: e_0 at every position
    x[..., 0] = 1.0
    attn, rank = _attention(exp["ng"])
    query, key, value = attn.get_query_key_value_tensors(x)
    # With the query and key rows zeroed the causal softmax is uniform; every position carries
    # the same value vector, so the context of query head i is exactly its value head's rows.
    qk_rows = [r for rows in list(exp["q"].values()) + list(exp["k"].values()) for r in rows]
    attn, _ = _attention(exp["ng"], zero_rows=qk_rows)
    out, _ = attn(x, attention_mask=None)
    return {"rank": rank, "q": query, "k": key, "v": value, "out": out}


def _rows(tensor):
    """[s, b, heads, hn] holding r + 1 -> {local head: [r, ...]} (checks positions agree)."""
    assert torch.equal(tensor, tensor[:1].expand_as(tensor))
    return {h: [int(x) - 1 for x in tensor[0, 0, h].tolist()] for h in range(tensor.size(2))}


@pytest.mark.parametrize("case", ["mha", "gqa"])
@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_rows_per_head(case, tp):
    exp = EXPECTED[case]
    ng = exp["ng"]
    outs = run_distributed(_split_and_forward, world_size=tp, tp=tp, args=(case,))
    for out in outs:
        rank = out["rank"]
        np_local, ng_local = NP // tp, ng // tp
        assert out["q"].shape[2:] == (np_local, HN)
        assert out["k"].shape[2:] == (ng_local, HN)
        assert out["v"].shape[2:] == (ng_local, HN)
        q_heads = range(rank * np_local, (rank + 1) * np_local)
        kv_heads = range(rank * ng_local, (rank + 1) * ng_local)
        assert _rows(out["q"]) == {i: exp["q"][h] for i, h in enumerate(q_heads)}
        assert _rows(out["k"]) == {i: exp["k"][h] for i, h in enumerate(kv_heads)}
        assert _rows(out["v"]) == {i: exp["v"][h] for i, h in enumerate(kv_heads)}
        # After attention and the identity output projection (all-reduced over TP), feature block
        # i of the output is the value head query head i used.
        ctx = out["out"].view(out["out"].size(0), out["out"].size(1), NP, HN)
        assert _rows(ctx) == exp["v_of_q"]
