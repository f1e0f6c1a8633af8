"""Pretraining samplers: what each data-parallel rank sees, resuming from consumed_samples, and
the DataLoader built with explicit parameters or from the global args."""

import types

import pytest
import torch

from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_data_loader,
)


class _Range(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i, i + 1])}


def test_sequential_sampler_slices_each_global_batch():
    total, mbs, dp = 23, 2, 3
    per_rank = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    steps = total // (mbs * dp)
    for step in range(steps):
        base = step * mbs * dp
        for r in range(dp):
            assert per_rank[r][step] == list(range(base + r * mbs, base + (r + 1) * mbs))
    assert all(len(p) == steps for p in per_rank)
    # The trailing partial global batch is kept with drop_last=False.
    tail = list(MegatronPretrainingSampler(total, 0, mbs, 0, dp, drop_last=False))
    assert tail[-1] == [18, 19]


def test_sequential_sampler_resumes():
    full = list(MegatronPretrainingSampler(40, 0, 2, 1, 2))
    resumed = list(MegatronPretrainingSampler(40, 12, 2, 1, 2))
    assert resumed == full[3:]


@pytest.mark.parametrize("sharding", [True, False])
def test_random_sampler_covers_epoch_once_and_resumes(sharding):
    total, mbs, dp = 50, 2, 2
    seen = []
    for r in range(dp):
        sampler = MegatronPretrainingRandomSampler(None, total, 0, mbs, r, dp, sharding)
        batches = list(sampler)
        seen += [i for b in batches for i in b]
    usable = total - total % (mbs * dp)
    assert len(seen) == usable and len(set(seen)) == usable
    assert seen != sorted(seen)
    full = list(MegatronPretrainingRandomSampler(None, total, 0, mbs, 1, dp, sharding))
    resumed = list(MegatronPretrainingRandomSampler(None, total, 8, mbs, 1, dp, sharding))
    assert resumed == full[2:]
    # The next epoch is another permutation.
    epoch1 = list(MegatronPretrainingRandomSampler(None, total, usable, mbs, 1, dp, sharding))
    assert epoch1 != full


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(total_samples=0), "no sample to consume"),
        (dict(consumed_samples=10), "no samples left"),
        (dict(micro_batch_size=0), "--micro-batch-size"),
        (dict(data_parallel_rank=2), "data_parallel_rank 2"),
    ],
)
def test_sampler_errors(kwargs, message):
    args = dict(
        total_samples=10,
        consumed_samples=0,
        micro_batch_size=2,
        data_parallel_rank=0,
        data_parallel_size=2,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(**args)


def test_build_data_loader_explicit():
    loader = build_data_loader(
        _Range(12),
        4,
        "single",
        micro_batch_size=2,
        data_parallel_rank=1,
        data_parallel_size=2,
        num_workers=0,
    )
    firsts = [batch["tokens"][:, 0].tolist() for batch in loader]
    assert firsts == [[6, 7], [10, 11]]
    assert build_data_loader(None, 0, "single", 1, 0, 1) is None
    with pytest.raises(ValueError, match="--dataloader-type bogus"):
        build_data_loader(_Range(4), 0, "bogus", 1, 0, 1)


def test_build_pretraining_data_loader_reads_global_args():
    global_vars = pytest.importorskip("megatron.training.global_vars")
    from megatron.core import parallel_state
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    assert not parallel_state.model_parallel_is_initialized()
    previous = getattr(global_vars, "_GLOBAL_ARGS", None)
    global_vars.set_args(
        types.SimpleNamespace(
            dataloader_type="single", micro_batch_size=3, num_workers=0, data_sharding=True
        )
    )
    try:
        loader = build_pretraining_data_loader(_Range(9), 3)
        assert [b["tokens"][:, 0].tolist() for b in loader] == [[3, 4, 5], [6, 7, 8]]
    finally:
        global_vars.set_args(previous)
