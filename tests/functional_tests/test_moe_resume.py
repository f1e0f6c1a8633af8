"""Exact resume of an MoE GPT at TP2 x EP2 (sequence parallel, distributed optimizer, 4 gloo ranks):
a run stopped by --exit-interval and resumed with --load gives the uninterrupted run's losses bit
for bit, and the checkpoint has Megatron's `mp_rank_TT_EEE` layout (one directory per tensor x
expert rank; each holds the dense weights and its own experts, and a two-entry distributed
optimizer state: dense and expert).
"""

import os

import torch

from tests.functional_tests.test_resume import (
    _check_resume,
    _stop_and_resume_runs,
)
from tests.unit_tests.dist_utils import run_distributed

MOE_LAYOUT = [
    '--num-experts',
    '4',
    '--moe-router-topk',
    '2',
    '--moe-aux-loss-coeff',
    '1e-2',
    '--moe-token-dispatcher-type',
    'alltoall',
    '--swiglu',
    '--disable-bias-linear',
    '--tensor-model-parallel-size',
    '2',
    '--expert-model-parallel-size',
    '2',
    '--sequence-parallel',
    '--use-distributed-optimizer',
]


def test_exact_resume_tp2_ep2(tmp_path):
    train_iters, stop_at = 4, 2
    outs = run_distributed(
        _stop_and_resume_runs,
        world_size=4,
        tp=2,
        ep=2,
        args=(str(tmp_path), train_iters, stop_at, MOE_LAYOUT),
        timeout=600,
    )
    reference, stopped, resumed = outs[-1]
    _check_resume(reference, stopped, resumed, train_iters, stop_at)

    iteration_dir = tmp_path / 'resume' / f'iter_{stop_at:07d}'
    assert sorted(os.listdir(iteration_dir)) == [
        'mp_rank_00_000',
        'mp_rank_00_001',
        'mp_rank_01_000',
        'mp_rank_01_001',
    ]
    experts = {}
    for ep_rank in (0, 1):
        state = torch.load(
            iteration_dir / f'mp_rank_00_{ep_rank:03d}' / 'model_optim_rng.pt',
            weights_only=False,
        )
        model = state['model']
        assert 'decoder.layers.0.mlp.router.weight' in model
        assert 'embedding.word_embeddings.weight' in model
        # Local expert indices: each file holds experts 0 and 1 of its expert-parallel rank.
        local = sorted({k.split('local_experts.')[1].split('.')[0] for k in model if 'local_' in k})
        assert local == ['0', '1']
        experts[ep_rank] = model['decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight']
        assert isinstance(state['optimizer'], list) and len(state['optimizer']) == 2
        # Data-parallel rank r of the tp-0 ranks has expert-parallel rank r (dp = ep = 2).
        optim = torch.load(
            iteration_dir / f'mp_rank_00_{ep_rank:03d}' / f'distrib_optim_dp{ep_rank:03d}.pt',
            weights_only=False,
        )
        assert len(optim['state']['chained']) == 2  # dense and expert optimizer shards
    assert not torch.equal(experts[0], experts[1])  # different global experts
