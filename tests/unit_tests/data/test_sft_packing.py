"""Packing of tokenized conversations into samples (megatron.core.datasets.sft_packing) and the
row checks: sample invariants for cp 1 and 2, overflow, the best-fit plan, and one-line errors."""

import numpy
import pytest

from megatron.core.datasets.sft_packing import (
    build_packed_sample,
    check_row,
    padded_length,
    plan_packs,
    split_conversations,
)

PAD = 0


def _conversation(rng, n, first):
    ids = numpy.arange(first, first + n, dtype=numpy.int64)
    # Random, the first token too: a trained first token must still not be learned from the
    # previous conversation's last token.
    trained = rng.random(n) < 0.5
    trained[0] = True
    return ids, trained


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("lengths", [[5, 9, 3], [7], [4, 4, 4, 4], [30], [12, 21]])
def test_packed_sample_invariants(cp, lengths):
    L = 32
    rng = numpy.random.default_rng(sum(lengths) + cp)
    convs, first = [], 1
    for n in lengths:
        convs.append(_conversation(rng, n, first))
        first += 100
    s = build_packed_sample(convs, L, PAD, context_parallel_size=cp)

    # The pack, rebuilt from the rule: conversations padded to 2*cp, cut or padded to L + 1.
    pack, trained, seg = [], [], []
    for k, (ids, mask) in enumerate(convs):
        size = padded_length(len(ids), cp)
        pack += ids.tolist() + [PAD] * (size - len(ids))
        trained += mask.tolist() + [False] * (size - len(ids))
        seg += [k] * size
    total = len(pack)
    pack = (pack + [PAD] * (L + 1))[: L + 1]
    trained = (trained + [False] * (L + 1))[: L + 1]
    seg = (seg + [len(convs) - 1] * (L + 1))[: L + 1]

    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        assert s[name].shape == (L,), name
    assert s["cu_seqlens"].shape == (L + 1,) and s["cu_seqlens"].dtype == numpy.int32
    assert s["tokens"].tolist() == pack[:-1] and s["labels"].tolist() == pack[1:]
    assert s["num_truncated"] == max(0, total - (L + 1))
    expected_mask = [float(trained[i + 1] and seg[i + 1] == seg[i]) for i in range(L)]
    assert s["loss_mask"].tolist() == expected_mask

    cu = s["cu_seqlens"].tolist()
    k = cu.index(L)
    assert cu[0] == 0 and all(a < b for a, b in zip(cu[:k], cu[1 : k + 1])) and set(cu[k:]) == {L}
    starts = cu[:k]
    assert [seg[i] for i in starts] == list(range(len(starts)))
    if cp > 1:
        assert all(b % (2 * cp) == 0 for b in cu)
    assert int(s["max_seqlen"]) == max(numpy.diff(cu[: k + 1]))
    # The real tokens of each segment: its conversation without CP pads and pad tail.
    real = [min(lo + len(convs[j][0]), L) - lo for j, lo in enumerate(starts)]
    unpadded = s["cu_seqlens_unpadded"].tolist()
    assert unpadded[: k + 1] == [0] + numpy.cumsum(real).tolist()
    assert set(unpadded[k:]) == {sum(real)}
    # Positions restart at every start and continue through pads (the tail included).
    for lo, hi in zip(starts, starts[1:] + [L]):
        assert s["position_ids"][lo:hi].tolist() == list(range(hi - lo))


def test_exact_fit_and_overflow():
    L = 16
    ids = numpy.arange(1, 18)  # L + 1 tokens: fits exactly, nothing lost
    s = build_packed_sample([(ids, numpy.ones(17, bool))], L, PAD)
    assert s["num_truncated"] == 0 and s["labels"].tolist() == list(range(2, 18))
    assert s["loss_mask"].sum() == 16
    # Longer: cut to L + 1 tokens, the rest (and any later conversation) dropped.
    s = build_packed_sample(
        [(numpy.arange(1, 25), numpy.ones(24, bool)), (numpy.arange(50, 53), numpy.ones(3, bool))],
        L,
        PAD,
    )
    assert s["num_truncated"] == 24 + 3 - 17
    assert (
        s["tokens"].tolist() == list(range(1, 17)) and s["cu_seqlens"].tolist() == [0] + [16] * 16
    )


def test_plan_is_best_fit_in_data_order_and_deterministic():
    rng = numpy.random.default_rng(0)
    lengths = rng.integers(5, 60, size=300)
    capacity = 129
    offsets, order = plan_packs(lengths, capacity)
    again = plan_packs(lengths, capacity)
    assert numpy.array_equal(offsets, again[0]) and numpy.array_equal(order, again[1])
    assert sorted(order.tolist()) == list(range(300))
    loads = []
    for k in range(len(offsets) - 1):
        members = order[offsets[k] : offsets[k + 1]]
        assert list(members) == sorted(members)  # data order within a pack
        loads.append(lengths[members].sum())
    assert max(loads) <= capacity
    # Best fit leaves little room: at least 95 % full on average, far above one per sample.
    assert lengths.sum() / (len(loads) * capacity) > 0.95
    # A conversation longer than a pack gets its own pack.
    offsets, order = plan_packs([10, 200, 10], 129)
    assert [order[offsets[k] : offsets[k + 1]].tolist() for k in range(2)] == [[0, 2], [1]]


def test_split_conversations_on_system_messages():
    m = [{"role": r, "content": "x"} for r in ("user", "assistant", "system", "user", "assistant")]
    assert [len(c) for c in split_conversations(m)] == [2, 3]


@pytest.mark.parametrize(
    "row,message",
    [
        ({"text": "hi"}, "no 'messages' list of {role, content} objects (found ['text'])"),
        ({"messages": []}, "no 'messages' list of {role, content} objects (found messages=[])"),
        ([1, 2], "a row must be a JSON object with a 'messages' list, got list"),
        (
            {"messages": [{"role": "User", "content": "a"}]},
            "message 0 has unknown role 'User'; roles are system, user, assistant, tool",
        ),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "message 0 is not a {role, content} object with string content",
        ),
        (
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
            "a conversation has no assistant turn (roles: system, user): nothing to train",
        ),
        (
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "message 1 is an assistant turn after a system turn; an assistant turn must follow a "
            "user or tool turn",
        ),
        (
            {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": " "}]},
            "message 1 is an empty assistant turn",
        ),
    ],
)
def test_row_errors(row, message):
    with pytest.raises(ValueError) as info:
        check_row(row)
    assert str(info.value) == message
