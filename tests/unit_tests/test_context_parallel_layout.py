"""Context parallelism without processes: the dual-chunk batch layout, the rank groups of CP with
TP / PP / DP / EP and hierarchical CP, and the start-up refusals of the CP flags.

The group tables for world 8 (TP2 CP2) and 16 (TP2 CP2 PP2) are Megatron core_r0.8's RankGenerator
output; the EP+CP layouts are written out from r0.8's rule (expert parallelism subdivides data
parallelism, order tp-cp-ep-dp-pp).
"""

import pytest
import torch

from megatron.core.parallel_layout import (
    generate_model_parallel_groups,
    hierarchical_context_parallel_groups,
)
from megatron.core.transformer.context_parallel import (
    cp_global_positions,
    gather_from_cp_layout,
    get_batch_on_this_cp_rank,
    slice_for_cp_rank,
)
from megatron.training.arguments import parse_args, validate_args

# --------------------------------------------------------------------------------------------
# Data layout


@pytest.mark.parametrize(
    "cp,expected",
    [
        (1, [list(range(8))]),
        (2, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        (4, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_dual_chunk_positions_s8(cp, expected):
    seq = torch.arange(8)
    assert [slice_for_cp_rank(seq, 0, cp, r).tolist() for r in range(cp)] == expected
    assert [cp_global_positions(8, cp, r).tolist() for r in range(cp)] == expected


def test_dual_chunk_cp3_and_inverse():
    seq = torch.arange(12).view(1, 12)  # chunks of 2: rank r holds chunks r and 5 - r
    parts = [slice_for_cp_rank(seq, 1, 3, r) for r in range(3)]
    assert [p.tolist() for p in parts] == [[[0, 1, 10, 11]], [[2, 3, 8, 9]], [[4, 5, 6, 7]]]
    assert torch.equal(gather_from_cp_layout(parts, 1), seq)
    with pytest.raises(ValueError, match=r"length 10, not divisible by 2 x context parallel"):
        slice_for_cp_rank(torch.arange(10), 0, 3, 0)


def test_batch_slicing_dims():
    b, s = 2, 8
    mask = torch.arange(s * s).view(1, 1, s, s).expand(b, 1, s, s)
    batch = {
        "tokens": torch.arange(s).expand(b, s),
        "labels": torch.arange(1, s + 1).expand(b, s),
        "loss_mask": torch.ones(b, s),
        "attention_mask": mask,
        "position_ids": torch.arange(s).expand(b, s),
    }
    sliced = get_batch_on_this_cp_rank(batch, 2, 1)
    assert sliced["tokens"][0].tolist() == [2, 3, 4, 5]
    assert sliced["labels"][0].tolist() == [3, 4, 5, 6]  # labels stay aligned with tokens
    assert sliced["position_ids"][0].tolist() == [2, 3, 4, 5]  # global positions
    assert sliced["attention_mask"].shape == (b, 1, 4, s)  # query rows only
    assert torch.equal(sliced["attention_mask"][0, 0], mask[0, 0, 2:6])
    assert get_batch_on_this_cp_rank({"tokens": None}, 2, 0) == {"tokens": None}


# --------------------------------------------------------------------------------------------
# Rank groups


def test_groups_world8_tp2_cp2():
    g = generate_model_parallel_groups(8, tensor_model_parallel_size=2, context_parallel_size=2)
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["tp-dp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["tp-dp-cp"] == [list(range(8))]


def test_groups_world16_tp2_cp2_pp2():
    g = generate_model_parallel_groups(
        16, tensor_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_size=2
    )
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["pp"] == [[r, r + 8] for r in range(8)]
    assert g["mp"] == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]


def test_expert_parallel_with_context_parallel_layout():
    """TP2 CP2 EP2 on 16 ranks (DP 4): rank = tp + 2 (cp + 2 (ep + 2 dp/ep))."""
    g = generate_model_parallel_groups(
        16, tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2
    )
    assert g["ep"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g["tp-ep"] == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    assert g["dp-modulo-ep"] == [[r, r + 8] for r in range(8)]
    assert g["dp-modulo-ep-cp"] == [[0, 2, 8, 10], [1, 3, 9, 11], [4, 6, 12, 14], [5, 7, 13, 15]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    # An expert group shares a CP rank (its members hold the same part of the sequence) and lies
    # inside one dense data parallel group.
    cp_rank = {r: group.index(r) for group in g["cp"] for r in group}
    for group in g["ep"]:
        assert len({cp_rank[r] for r in group}) == 1
        assert any(set(group) <= set(dp) for dp in g["dp"])


def test_hierarchical_cp_groups():
    levels = hierarchical_context_parallel_groups([[0, 2, 4, 6], [1, 3, 5, 7]], [2, 2])
    assert levels == [[[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]]]
    g = generate_model_parallel_groups(
        4, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2]
    )
    assert g["hcp-0"] == [[0, 1], [2, 3]] and g["hcp-1"] == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"multiply to 6, not to the context parallel size 4"):
        hierarchical_context_parallel_groups([[0, 1, 2, 3]], [2, 3])


# --------------------------------------------------------------------------------------------
# Start-up refusals (one line each, before any work)

BASE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
]


def _validate(extra, world_size):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size, args.rank = world_size, 1
    return validate_args(args, {})


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (
            ["--context-parallel-size", "3", "--seq-length", "32"],
            3,
            "--seq-length (32) must be divisible by 2 x --context-parallel-size (3)",
        ),
        (
            [
                "--context-parallel-size",
                "4",
                "--cp-comm-type",
                "a2a",
                "--group-query-attention",
                "--num-query-groups",
                "2",
            ],
            4,
            "--cp-comm-type a2a splits heads over 4 ranks, but the attention heads (4) and query "
            "groups (2) per tensor-parallel rank are not both divisible by 4; use --cp-comm-type "
            "p2p",
        ),
        (
            ["--context-parallel-size", "2", "--cp-comm-type", "ring"],
            2,
            "--cp-comm-type 'ring' is not one of p2p, all_gather, a2a, a2a+p2p",
        ),
        (
            ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "a2a"],
            2,
            "--cp-comm-type has 3 values; give one, or one per layer (--num-layers 2)",
        ),
        (
            ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"],
            4,
            "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm",
        ),
        (
            ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"],
            4,
            "--hierarchical-context-parallel-sizes 2 3 must be two sizes whose product is "
            "--context-parallel-size (4)",
        ),
        (
            ["--context-parallel-size", "2", "--reset-attention-mask"],
            2,
            "--reset-attention-mask: its per-document attention mask cannot be split over the "
            "sequence by --context-parallel-size 2 (only causal attention is exact there); drop "
            "--reset-attention-mask or use --context-parallel-size 1",
        ),
        (
            ["--context-parallel-size", "2", "--use-tp-pp-dp-mapping"],
            2,
            "--context-parallel-size 2: context_parallel and expert_model_parallel can't be used "
            "with tp-pp-dp mapping (--use-tp-pp-dp-mapping)",
        ),
        (
            [
                "--context-parallel-size",
                "2",
                "--tensor-model-parallel-size",
                "4",
                "--sequence-parallel",
                "--seq-length",
                "36",
                "--max-position-embeddings",
                "36",
            ],
            8,
            "--sequence-parallel: the local sequence --seq-length / --context-parallel-size "
            "(36 / 2 = 18) must be divisible by --tensor-model-parallel-size (4)",
        ),
    ],
)
def test_refusals(extra, world, message):
    with pytest.raises(ValueError) as info:
        _validate(extra, world)
    assert str(info.value) == message


def test_accepted_and_normalised():
    args = _validate(["--context-parallel-size", "2", "--cp-comm-type", "allgather"], 4)
    assert args.cp_comm_type == "all_gather" and args.data_parallel_size == 2
    args = _validate(["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"], 2)
    assert args.cp_comm_type == ["p2p", "a2a"]


def test_entry_points_without_cp_refuse():
    from megatron.training.validation.context_parallel_checks import refuse_context_parallel

    args = _validate(["--context-parallel-size", "2"], 2)
    with pytest.raises(ValueError) as info:
        refuse_context_parallel(args, "text generation")
    assert str(info.value) == (
        "--context-parallel-size 2: text generation does not support context parallelism; run "
        "it with --context-parallel-size 1 (checkpoints do not depend on it)"
    )
