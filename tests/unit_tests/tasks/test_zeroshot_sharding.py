"""Zero-shot evaluation with DP > 1 scores every sample exactly once.

torch's DistributedSampler pads each rank's share by repeating samples; the zero-shot loader
flags those repeats (weight 0) and both metrics ignore them, so the DP-summed perplexity sum and
accuracy count equal the DP=1 ones.
"""

import torch

from tasks.zeroshot_gpt.datasets import LMDataset
from tasks.zeroshot_gpt.evaluate import _metric_accuracy, _metric_loss
from tasks.zeroshot_gpt.sharding import build_eval_data_loader
from tests.unit_tests.dist_utils import run_distributed


def _windows(num_tokens=26, seq_len=4):
    tokens = list(range(1, num_tokens + 1))
    return LMDataset(tokens, seq_len, 0, num_tokens, num_tokens, overlapping_eval=None)


def _totals(dataset, replicas, micro_batch_size=2):
    """(summed 'loss' with every token costing 1, accuracy count with every target right)."""
    loss = accuracy = 0.0
    for rank in range(replicas):
        loader = build_eval_data_loader(dataset, micro_batch_size, 0, replicas, rank)
        for batch in loader:
            labels = batch['text'][:, 1:]
            mask = batch['pad_mask'].long()
            loss += _metric_loss(labels, mask, batch['weight'], torch.ones(labels.shape))[0]
            logits = torch.nn.functional.one_hot(labels, 64).float()  # argmax = the label
            accuracy += _metric_accuracy(labels, mask, batch['weight'], logits)[0]
    return float(loss), float(accuracy)


def _totals_per_replica_count(replica_counts):
    # One process with TP = 1 (the accuracy metric gathers its logits over the TP group).
    dataset = _windows()
    return {replicas: _totals(dataset, replicas) for replicas in replica_counts}


def test_dp_totals_equal_single_rank_totals():
    dataset = _windows()
    counts = [1, 2, 3, 4]
    assert all(len(dataset) % n for n in counts[1:])  # the sampler pads: the case under test
    totals = run_distributed(_totals_per_replica_count, world_size=1, args=(counts,))[0]
    assert totals[1][1] == len(dataset)
    for replicas in counts[1:]:
        assert totals[replicas] == totals[1], (replicas, totals)


def test_every_rank_runs_the_same_number_of_batches():
    dataset = _windows()
    counts = {len(build_eval_data_loader(dataset, 2, 0, 4, rank)) for rank in range(4)}
    assert len(counts) == 1  # the per-batch all-reduce over DP needs equal counts


def test_dataset_attributes_read_through():
    dataset = _windows()
    loader = build_eval_data_loader(dataset, 2, 0, 2, 0)
    assert loader.dataset.num_tokenized_tokens == dataset.num_tokenized_tokens
    assert len(loader.dataset) == len(dataset)
