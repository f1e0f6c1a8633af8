"""End-to-end context parallelism through pretrain_gpt.py: every CP layout reproduces the serial
losses and gradient norms.

All runs start from the same weights (`set_reference_weights`) and read the same global batches,
with dropout off. The data are short documents (4 to 40 tokens, each ending in EOD) and
`--eod-mask-loss` is on, so the loss-token counts differ between CP ranks: the loss and gradient
scaling must use the CP-wide count (a per-rank mean would differ). The gradient norm of every
iteration is compared too (clipping and Adam hide a global gradient scale from the losses, the
norm does not). Layouts (world size in brackets), each against its serial run:

- CP2, ring (p2p), full recompute, distributed optimizer (sharded over the 2 CP ranks) [2];
  then resumed at CP1 from its iteration-2 checkpoint [1]
- CP4, RoPE + GQA (4 heads, 2 groups: too few for a2a over 4 ranks), one comm type per layer:
  p2p, a2a+p2p (hierarchical [2, 2]), all_gather (spelled allgather), p2p [4]
- CP2 x TP2 with sequence parallelism, all_gather [4]
- CP2 x PP2, interleaved (2 virtual stages), a2a [4]
- CP2 x PP2, 1F1B, selective recompute, p2p [4]
- CP2 x DP2 with the distributed optimizer and --calculate-per-token-loss (token counts summed
  over DP x CP), p2p [4], against a serial per-token-loss run
- CP2 in bf16 against serial bf16 [2]

Tolerance: relative 1e-5 per iteration in fp32 (measured <= 3e-7 on CPU, torch 2.13); 2e-2 in
bf16. Gradient norms are logged with 3 decimals: absolute 1.5e-3.
"""

import os
import re

import pytest

from tests.functional_tests.gpt_utils import SMALL_VOCAB_ARGS, run_pretrain, write_short_documents
from tests.unit_tests.dist_utils import run_distributed

ITERS = 4
RTOL = 1e-5
#: Std of the reference QKV weights: sharp enough attention that positions (RoPE, the CP layout)
#: change the losses well beyond RTOL (with 0.02 the attention is near uniform and RoPE built
#: from local positions moved the loss by only 5e-6; with 0.2 by 1e-4). Much sharper (0.5) makes
#: the first Adam steps amplify float32 noise (TP2 alone then drifts from serial by 2e-4).
QKV_STD = 0.2
BASE = SMALL_VOCAB_ARGS + [
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
        kwargs={'reference_weights': QKV_STD, 'capture_stdout': True},
        timeout=600,
        **layout,
    )
    return results[-1]  # the last rank is on the last pipeline stage and holds the losses


def _grad_norms(result):
    return [float(x) for x in re.findall(r'grad norm: ([0-9.]+) \|', result['stdout'])]


def _losses(result, first=1):
    return [result['train_losses'][i]['lm loss'] for i in range(first, ITERS + 1)]


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp('cp_cache'))


@pytest.fixture(scope='module')
def data_prefix(tmp_path_factory):
    """Short documents of ids (a skewed draw from the first 1000, so there is something to learn),
    each ending in the EOD id of SMALL_VOCAB_ARGS' vocabulary."""
    return write_short_documents(
        str(tmp_path_factory.mktemp('cp_data') / 'short_docs_text_document')
    )


_SERIAL = {}


def _serial(name, data_prefix, cache):
    """The serial run of a model variant ('learned', 'rope_gqa', 'bf16'), run once."""
    if name not in _SERIAL:
        extra = {
            'learned': [],
            'rope_gqa': ROPE_GQA,
            'bf16': ['--bf16'],
            'per_token': ['--calculate-per-token-loss'],
        }[name]
        _SERIAL[name] = _run(1, extra, data_prefix, cache)
    return _SERIAL[name]


def _assert_same(result, reference, rtol=RTOL, first=1):
    assert result['iteration'] == ITERS
    assert _losses(result, first) == pytest.approx(_losses(reference, first), rel=rtol)
    norms, ref_norms = _grad_norms(result), _grad_norms(reference)[first - 1 :]
    assert len(norms) == ITERS - first + 1
    assert norms == pytest.approx(ref_norms, abs=1.5e-3 if rtol == RTOL else 5e-2)
    assert result['valid_losses']['lm loss'] == pytest.approx(
        reference['valid_losses']['lm loss'], rel=rtol
    )


def test_cp2_ring_recompute_dist_opt_then_resume_at_cp1(data_prefix, cache, tmp_path):
    reference = _serial('learned', data_prefix, cache)
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
            '--use-distributed-optimizer',
            '--save',
            save,
            '--save-interval',
            '2',
        ],
        data_prefix,
        cache,
        cp=2,
    )
    _assert_same(cp2, reference)
    # The CP2 checkpoint of iteration 2, resumed without CP, continues the serial run.
    with open(os.path.join(save, 'latest_checkpointed_iteration.txt'), 'w') as f:
        f.write('2')
    resumed = _run(1, ['--load', save, '--use-distributed-optimizer'], data_prefix, cache)
    _assert_same(resumed, reference, first=3)


def test_cp2_bf16(data_prefix, cache):
    reference = _serial('bf16', data_prefix, cache)
    cp2 = _run(2, ['--bf16', '--context-parallel-size', '2'], data_prefix, cache, cp=2)
    _assert_same(cp2, reference, rtol=2e-2)


def test_cp4_rope_gqa_every_comm_type(data_prefix, cache):
    reference = _serial('rope_gqa', data_prefix, cache)
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
        data_prefix,
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
    'cp2_dp2_distributed_optimizer_per_token_loss': (
        dict(cp=2),
        ['--use-distributed-optimizer', '--calculate-per-token-loss'],
    ),
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_cp2_layouts_match_serial(layout, data_prefix, cache):
    reference = _serial('per_token' if 'per_token' in layout else 'learned', data_prefix, cache)
    groups, extra = LAYOUTS[layout]
    result = _run(4, ['--context-parallel-size', '2'] + extra, data_prefix, cache, **groups)
    _assert_same(result, reference)
