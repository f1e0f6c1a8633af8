"""megatron/inference/text_generation/sampling.py and beam_utils.py against their definitions."""

import math

import torch

from megatron.inference.text_generation.beam_utils import BeamHypotheses
from megatron.inference.text_generation.sampling import (
    modify_logits_for_top_k_filtering,
    modify_logits_for_top_p_filtering,
    sample,
)


def test_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.5]])
    modify_logits_for_top_k_filtering(logits, 2)
    # The 2nd largest is 2.0 and both of its copies survive.
    assert torch.isinf(logits[0, [0, 4]]).all()
    assert logits[0, 1:4].tolist() == [3.0, 2.0, 2.0]


def test_top_p_shift_by_one_rule():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = logits.clone()
    modify_logits_for_top_p_filtering(kept, 0.6)
    # Mass before token 1 is 0.5 <= 0.6: kept; before token 2 it is 0.8 > 0.6: dropped.
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    top_only = logits.clone()
    modify_logits_for_top_p_filtering(top_only, 0.1)
    assert torch.isfinite(top_only[0, 0]) and torch.isinf(top_only[0, 1:]).all()


def test_greedy_ignores_temperature_and_clamps_to_vocab():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    assert sample(logits, top_k=1, temperature=0.01).tolist() == [3]
    # Id 3 is vocabulary padding when vocab_size is 3: it maps onto the last real id.
    assert sample(logits, top_k=1, vocab_size=3).tolist() == [2]


def test_sampling_follows_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    counts = torch.bincount(sample(logits, top_k=2), minlength=4).float() / 4000
    assert counts[2:].sum() == 0
    want = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    torch.testing.assert_close(counts[:2], want, atol=0.03, rtol=0)
    counts = torch.bincount(sample(logits, temperature=2.0), minlength=4).float() / 4000
    torch.testing.assert_close(counts, torch.softmax(logits[0] / 2.0, 0), atol=0.03, rtol=0)
    # The logits given are not modified.
    assert logits[0].tolist() == [2.0, 1.0, 0.0, -1.0]


def test_beam_hypotheses_keep_the_best_with_length_penalty():
    hyps = BeamHypotheses(2, length_penalty=2.0)
    hyps.add("a", -4.0, 2)  # -1.0
    hyps.add("b", -1.0, 1)  # -1.0
    hyps.add("c", -2.0, 2)  # -0.5: replaces a worst
    assert len(hyps) == 2 and sorted(h for _, h in hyps.beams) in (["b", "c"], ["a", "c"])
    assert math.isclose(hyps.worst_score, -1.0)
    # Done when the best open beam, normalised at this length, cannot beat the worst kept.
    assert hyps.is_done(-4.0, 2) and not hyps.is_done(-1.0, 2)
    assert not BeamHypotheses(2).is_done(-100.0, 1)
