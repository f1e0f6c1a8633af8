"""One-line errors of the distributed-checkpoint flags and of what cannot be resharded
(rows of docs/errors.md)."""

import argparse
import re

import pytest

from tests.functional_tests.test_error_catalogue import TINY, _main, _one_error_line


@pytest.mark.parametrize(
    'argv,pattern',
    [
        (
            ['--async-save', '--save', '{tmp}'],
            r'^error: --async-save: async checkpoint save is not implemented for legacy \(torch '
            r'format\) checkpoints; add --use-dist-ckpt \(or --ckpt-format torch_dist\)$',
        ),
        (
            ['--use-dist-ckpt', '--dist-ckpt-format', 'zarr'],
            r'^error: --dist-ckpt-format zarr: only torch_dist is supported \(zarr is deprecated '
            r'in Megatron and not implemented here\)$',
        ),
        (
            ['--use-dist-ckpt', '--num-experts', '2', '--moe-extended-tp', '--disable-bias-linear'],
            r'^error: --moe-extended-tp with --use-dist-ckpt \(--ckpt-format torch_dist\): '
            r'experts split over tensor x expert parallel ranks have no distributed-checkpoint '
            r'layout \(as in Megatron\); use --ckpt-format torch$',
        ),
    ],
)
def test_flag_errors(tmp_path, argv, pattern):
    argv = [a.replace('{tmp}', str(tmp_path / 'save')) for a in argv]
    code, _, err = _main(TINY + ['--mock-data'] + argv)
    assert code == 1
    assert re.search(pattern, _one_error_line(err)), err


def test_dp_zero_optimizer_state_does_not_reshard():
    from megatron.training.checkpoint import checkpointing_dist

    args = argparse.Namespace(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        finetune=False,
        no_load_optim=False,
        no_load_rng=True,
        data_parallel_random_init=False,
        data_parallel_size=1,
        seed=1,
    )
    saved = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    common = {
        'args': saved,
        'optimizer': {'param_state_sharding_type': 'dp_zero_gather_scatter'},
    }
    with pytest.raises(ValueError) as info:
        checkpointing_dist._load_plan(args, common, 'DIR', False, optimizer=object())
    assert str(info.value) == (
        '(TP, PP) mismatch after resume ((1, 1) vs (2, 1) from checkpoint): not supported for '
        'DistributedOptimizer with sharding type dp_zero_gather_scatter (saved with '
        '--no-ckpt-fully-parallel-save); load with --no-load-optim or at the saved (TP, PP)'
    )
    # Same layout: a distributed optimizer loads it; a non-distributed one is refused.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    args.tensor_model_parallel_size = 2
    dist_opt = DistributedOptimizer.__new__(DistributedOptimizer)
    assert checkpointing_dist._load_plan(args, common, 'DIR', False, dist_opt)['load_optim']
    with pytest.raises(ValueError, match='which only --use-distributed-optimizer can load'):
        checkpointing_dist._load_plan(args, common, 'DIR', False, object())
    # Without the optimizer state nothing is refused.
    args.tensor_model_parallel_size, args.no_load_optim = 1, True
    assert not checkpointing_dist._load_plan(args, common, 'DIR', False, object())['load_optim']


def test_dp_zero_optimizer_state_does_not_reshard_across_ep():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training.checkpoint import checkpointing_dist

    args = argparse.Namespace(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        finetune=False,
        no_load_optim=False,
        no_load_rng=True,
        data_parallel_random_init=False,
        data_parallel_size=2,
        seed=1,
    )
    saved = argparse.Namespace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=2
    )
    sub = {'param_state_sharding_type': 'dp_zero_gather_scatter'}
    common = {'args': saved, 'optimizer': {0: sub, 1: dict(sub)}}
    dist_opt = DistributedOptimizer.__new__(DistributedOptimizer)
    with pytest.raises(ValueError) as info:
        checkpointing_dist._load_plan(args, common, 'DIR', False, dist_opt)
    assert str(info.value).startswith(
        '(TP, PP, EP) mismatch after resume ((1, 1, 1) vs (1, 1, 2) from checkpoint): not '
        'supported for DistributedOptimizer with sharding type dp_zero_gather_scatter'
    )
