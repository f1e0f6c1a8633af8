"""End-to-end MoE parity through pretrain_gpt.py: expert, tensor, pipeline and data parallel
layouts of the same tiny MoE GPT give the serial per-iteration lm losses.

Model: 4 layers, every one MoE (4 experts, top-2, SwiGLU experts without biases), load-balancing
loss 1e-2 and z-loss 1e-3, dropless. Every layout starts from the same weights
(`set_reference_weights`: values drawn per global parameter name, expert indices made global),
uses micro-batches of 2 sequences (the auxiliary losses are per micro-batch) and reads the same
global batches of 8. Tolerance: relative 1e-5 on each of the 4 iterations' lm loss (measured:
at most 2e-7 on CPU, torch 2.13); the two dispatchers agree bit for bit at tp = 1.
"""

import pytest

from tests.functional_tests.gpt_utils import SMALL_VOCAB_ARGS, run_pretrain
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 4
RTOL = 1e-5

MOE_ARGS = [
    '--num-layers',
    '4',
    '--num-experts',
    '4',
    '--moe-router-topk',
    '2',
    '--moe-aux-loss-coeff',
    '1e-2',
    '--moe-z-loss-coeff',
    '1e-3',
    '--ffn-hidden-size',
    '128',
    '--swiglu',
    '--disable-bias-linear',
    '--micro-batch-size',
    '2',
    '--global-batch-size',
    '8',
    '--train-iters',
    str(TRAIN_ITERS),
    '--eval-iters',
    '1',
    '--log-params-norm',
]

#: name: (world size, tp, pp, ep, extra flags)
LAYOUTS = {
    'ep2_allgather': (4, 1, 1, 2, []),
    'ep2_alltoall': (4, 1, 1, 2, ['--moe-token-dispatcher-type', 'alltoall']),
    'ep4_grouped_distopt': (4, 1, 1, 4, ['--moe-grouped-gemm', '--use-distributed-optimizer']),
    'tp2_ep2_sp': (
        4,
        2,
        1,
        2,
        ['--sequence-parallel', '--moe-token-dispatcher-type', 'alltoall'],
    ),
    'pp2_ep2': (
        4,
        1,
        2,
        2,
        [
            '--recompute-granularity',
            'full',
            '--recompute-method',
            'uniform',
            '--recompute-num-layers',
            '1',
        ],
    ),
    'pp2_vpp2_ep2': (4, 1, 2, 2, ['--num-layers-per-virtual-pipeline-stage', '1']),
}


def _run(world, tp, pp, ep, extra, data_prefix, cache, capture_stdout=False):
    flags = (
        MOE_ARGS
        + SMALL_VOCAB_ARGS
        + extra
        + [
            '--tensor-model-parallel-size',
            str(tp),
            '--pipeline-model-parallel-size',
            str(pp),
            '--expert-model-parallel-size',
            str(ep),
            '--data-path',
            data_prefix,
            '--data-cache-path',
            cache,
        ]
    )
    vpp = None
    if '--num-layers-per-virtual-pipeline-stage' in extra:
        vpp = 4 // pp // int(extra[extra.index('--num-layers-per-virtual-pipeline-stage') + 1])
    results = run_distributed(
        run_pretrain,
        world_size=world,
        tp=tp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        args=(flags,),
        kwargs={'reference_weights': True, 'capture_stdout': capture_stdout},
        timeout=600,
    )
    return results[-1]


def _losses(result):
    return [result['train_losses'][i]['lm loss'] for i in range(1, TRAIN_ITERS + 1)]


def _logged(result, field):
    """Per-iteration values of a log-line field ('grad norm', 'params norm', ...)."""
    lines = [line for line in result['stdout'].splitlines() if 'consumed samples:' in line]
    return [float(line.split(f' {field}: ')[1].split(' ')[0]) for line in lines]


@pytest.fixture(scope='module')
def reference(small_vocab_data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp('moe_cache'))
    return _run(1, 1, 1, 1, [], small_vocab_data_prefix, cache, capture_stdout=True)


def test_reference_learns_and_logs_moe_losses(reference):
    losses = _losses(reference)
    assert losses[-1] < losses[0] - 0.1  # over the 4 iterations, from ~ln(4096)
    lines = [line for line in reference['stdout'].splitlines() if 'consumed samples:' in line]
    assert len(lines) == TRAIN_ITERS
    for line in lines:
        # Megatron's order: z_loss (computed first), then load_balancing_loss.
        assert 0 < line.index(' z_loss: ') < line.index(' load_balancing_loss: '), line
        balance = float(line.split(' load_balancing_loss: ')[1].split(' ')[0])
        assert 0.9 < balance < 2.0, line  # 1.0 = perfect balance


def test_layouts_match_serial(reference, small_vocab_data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp('moe_cache'))
    results = {}
    for name, (world, tp, pp, ep, extra) in LAYOUTS.items():
        results[name] = _run(world, tp, pp, ep, extra, small_vocab_data_prefix, cache, True)
        assert _losses(results[name]) == pytest.approx(_losses(reference), rel=RTOL), name
        # Every expert is counted once in the gradient norm (clipping) and the parameter norm.
        for field in ('grad norm', 'params norm', 'load_balancing_loss', 'z_loss'):
            expected = _logged(reference, field)
            assert _logged(results[name], field) == pytest.approx(expected, rel=1e-3), field
    assert _losses(results['ep2_allgather']) == _losses(results['ep2_alltoall'])
