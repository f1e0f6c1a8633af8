"""End-to-end context parallelism through pretrain_gpt.py: every CP layout reproduces the serial
losses.

All runs start from the same weights (`set_reference_weights`) and read the same global batches,
with dropout off. `--eod-mask-loss` makes the loss-token counts differ between CP ranks, so the
loss and gradient scaling must use the CP-wide count (a per-rank mean would drift); gradients are
clipped (`--clip-grad 1.0`, norms ~1.4), so a gradient scaled cp times too large changes the
losses. Layouts (world size in brackets), each against its serial run:

- CP2, ring (p2p), full recompute [2]; later resumed at CP1 from its iteration-2 checkpoint [1]
- CP4, RoPE + GQA (4 heads, 2 groups: too few for a2a over 4 ranks), one comm type per layer:
  p2p, a2a+p2p (hierarchical [2, 2]), all_gather (spelled allgather), p2p [4]
- CP2 x TP2 with sequence parallelism, all_gather [4]
- CP2 x PP2, interleaved (2 virtual stages), a2a [4]
- CP2 x PP2, 1F1B, selective recompute, p2p [4]
- CP2 x DP2 with the distributed optimizer, p2p [4]
- CP2 in bf16 against serial bf16 [2]

Tolerance: relative 1e-5 per iteration in fp32 (measured <= 3e-7 on CPU, torch 2.13); 2e-2 in
bf16.
"""

import os

import pytest

from tests.functional_tests.gpt_utils import run_pretrain
from tests.unit_tests.dist_utils import run_distributed

ITERS = 4
RTOL = 1e-5
BASE = [
    '--num-layers',
    '4',
    '--micro-batch-size',
    '2',
    '--global-batch-size',
    '8',
    '--train-iters',
    str(ITERS),
    '--eval-iters',
    '1',
    '--eod-mask-loss',
]
ROPE_GQA = [
    '--position-embedding-type',
    'rope',
    '--group-query-attention',
    '--num-query-groups',
    '2',
]


def _run(world, extra, data_prefix, cache, **layout):
    args = BASE + ['--data-path', data_prefix, '--data-cache-path', cache] + list(extra)
    results = run_distributed(
        run_pretrain,
        world_size=world,
        args=(args,),
        kwargs={'reference_weights': True},
        timeout=600,
        **layout,
    )
    return results[-1]  # the last rank is on the last pipeline stage and holds the losses


def _losses(result, first=1):
    return [result['train_losses'][i]['lm loss'] for i in range(first, ITERS + 1)]


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp('cp_cache'))


_SERIAL = {}


def _serial(name, data_prefix, cache):
    """The serial run of a model variant ('learned', 'rope_gqa', 'bf16'), run once."""
    if name not in _SERIAL:
        extra = {'learned': [], 'rope_gqa': ROPE_GQA, 'bf16': ['--bf16']}[name]
        _SERIAL[name] = _run(1, extra, data_prefix, cache)
    return _SERIAL[name]


def _assert_same(result, reference, rtol=RTOL, first=1):
    assert result['iteration'] == ITERS
    assert _losses(result, first) == pytest.approx(_losses(reference, first), rel=rtol)
    assert result['valid_losses']['lm loss'] == pytest.approx(
        reference['valid_losses']['lm loss'], rel=rtol
    )


def test_cp2_ring_with_recompute_then_resume_at_cp1(gpt_data_prefix, cache, tmp_path):
    reference = _serial('learned', gpt_data_prefix, cache)
    assert _losses(reference)[-1] < _losses(reference)[0]
    save = str(tmp_path / 'ckpt')
    cp2 = _run(
        2,
        [
            '--context-parallel-size',
            '2',
            '--recompute-granularity',
            'full',
            '--recompute-method',
            'uniform',
            '--recompute-num-layers',
            '1',
            '--save',
            save,
            '--save-interval',
            '2',
        ],
        gpt_data_prefix,
        cache,
        cp=2,
    )
    _assert_same(cp2, reference)
    # The CP2 checkpoint of iteration 2, resumed without CP, continues the serial run.
    with open(os.path.join(save, 'latest_checkpointed_iteration.txt'), 'w') as f:
        f.write('2')
    resumed = _run(1, ['--load', save], gpt_data_prefix, cache)
    _assert_same(resumed, reference, first=3)


def test_cp2_bf16(gpt_data_prefix, cache):
    reference = _serial('bf16', gpt_data_prefix, cache)
    cp2 = _run(2, ['--bf16', '--context-parallel-size', '2'], gpt_data_prefix, cache, cp=2)
    _assert_same(cp2, reference, rtol=2e-2)


def test_cp4_rope_gqa_every_comm_type(gpt_data_prefix, cache):
    reference = _serial('rope_gqa', gpt_data_prefix, cache)
    cp4 = _run(
        4,
        ROPE_GQA
        + [
            '--context-parallel-size',
            '4',
            '--cp-comm-type',
            'p2p',
            'a2a+p2p',
            'allgather',
            'p2p',
            '--hierarchical-context-parallel-sizes',
            '2',
            '2',
        ],
        gpt_data_prefix,
        cache,
        cp=4,
    )
    _assert_same(cp4, reference)


LAYOUTS = {
    'cp2_tp2_sp_all_gather': (
        dict(cp=2, tp=2),
        [
            '--tensor-model-parallel-size',
            '2',
            '--sequence-parallel',
            '--cp-comm-type',
            'all_gather',
        ],
    ),
    'cp2_pp2_interleaved_a2a': (
        dict(cp=2, pp=2, vpp=2),
        [
            '--pipeline-model-parallel-size',
            '2',
            '--num-layers-per-virtual-pipeline-stage',
            '1',
            '--cp-comm-type',
            'a2a',
        ],
    ),
    'cp2_pp2_1f1b_selective_recompute': (
        dict(cp=2, pp=2),
        ['--pipeline-model-parallel-size', '2', '--recompute-activations'],
    ),
    'cp2_dp2_distributed_optimizer': (dict(cp=2), ['--use-distributed-optimizer']),
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_cp2_layouts_match_serial(layout, gpt_data_prefix, cache):
    reference = _serial('learned', gpt_data_prefix, cache)
    groups, extra = LAYOUTS[layout]
    result = _run(4, ['--context-parallel-size', '2'] + extra, gpt_data_prefix, cache, **groups)
    _assert_same(result, reference)
