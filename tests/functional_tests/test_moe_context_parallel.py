"""MoE with context parallelism through pretrain_gpt.py: CP2 x EP2 reproduces the serial run and
the CP1 x EP2 run, with both token dispatchers.

Model: 2 layers, both MoE (4 experts, top-2, SwiGLU experts, no biases), load-balancing loss 1e-2
and z-loss 1e-3, dropless, RoPE, same reference weights in every layout (`set_reference_weights`,
expert indices made global, sharp attention so that the CP layout matters), dropout off, global
batches of 8 sequences in micro-batches of 2.

Under CP each rank routes its s / cp tokens: the expert counts of the load-balancing loss are
summed over the CP group (the tp x cp group with sequence parallelism), each rank's partial loss
covers its own tokens, and the z-loss coefficient is divided by cp; the partials' gradients are
scaled by cp like the main loss (the DDP average over DP x CP divides by cp). Expert gradients
reduce over the expert-data-parallel group with CP (DP / EP x CP ranks). Compared per iteration:
`lm loss` (relative 1e-5; measured <= 3e-7 on CPU, torch 2.13), and from the log line the
gradient norm (which a missing or doubled CP factor on any gradient changes), the params norm,
`load_balancing_loss` and `z_loss` (relative 1e-3: they are printed with 7 digits).

Layouts: serial [1 rank]; CP1 x EP2 (DP2) [2]; CP2 x EP2 (DP2) allgather and alltoall [4 each].
"""

import pytest

from tests.functional_tests.gpt_utils import run_pretrain
from tests.unit_tests.dist_utils import run_distributed

ITERS = 4
RTOL = 1e-5
QKV_STD = 0.2

MOE_CP_ARGS = [
    '--num-layers',
    '2',
    '--num-experts',
    '4',
    '--moe-router-topk',
    '2',
    '--moe-aux-loss-coeff',
    '1e-1',
    '--moe-z-loss-coeff',
    '1e-2',
    '--ffn-hidden-size',
    '96',
    '--swiglu',
    '--disable-bias-linear',
    '--position-embedding-type',
    'rope',
    '--micro-batch-size',
    '2',
    '--global-batch-size',
    '8',
    '--train-iters',
    str(ITERS),
    '--eval-iters',
    '1',
    '--eod-mask-loss',
    '--log-params-norm',
]

#: name: (world size, cp, ep, extra flags)
LAYOUTS = {
    'cp1_ep2': (2, 1, 2, []),
    'cp2_ep2_allgather': (4, 2, 2, []),
    'cp2_ep2_alltoall': (4, 2, 2, ['--moe-token-dispatcher-type', 'alltoall']),
}


def _run(world, cp, ep, extra, data_prefix, cache):
    flags = MOE_CP_ARGS + list(extra)
    flags += ['--context-parallel-size', str(cp), '--expert-model-parallel-size', str(ep)]
    flags += ['--data-path', data_prefix, '--data-cache-path', cache]
    results = run_distributed(
        run_pretrain,
        world_size=world,
        cp=cp,
        ep=ep,
        args=(flags,),
        kwargs={'reference_weights': QKV_STD, 'capture_stdout': True},
        timeout=600,
    )
    return results[-1]


def _losses(result):
    return [result['train_losses'][i]['lm loss'] for i in range(1, ITERS + 1)]


def _logged(result, field):
    lines = [line for line in result['stdout'].splitlines() if 'consumed samples:' in line]
    assert len(lines) == ITERS
    return [float(line.split(f' {field}: ')[1].split(' ')[0]) for line in lines]


def test_cp2_ep2_matches_serial_and_cp1_ep2(gpt_data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp('moe_cp_cache'))
    reference = _run(1, 1, 1, [], gpt_data_prefix, cache)
    assert _losses(reference)[-1] < _losses(reference)[0]
    results = {}
    for name, (world, cp, ep, extra) in LAYOUTS.items():
        results[name] = result = _run(world, cp, ep, extra, gpt_data_prefix, cache)
        assert _losses(result) == pytest.approx(_losses(reference), rel=RTOL), name
        for field in ('grad norm', 'params norm', 'load_balancing_loss', 'z_loss'):
            assert _logged(result, field) == pytest.approx(
                _logged(reference, field), rel=1e-3
            ), (name, field)
        assert result['valid_losses']['lm loss'] == pytest.approx(
            reference['valid_losses']['lm loss'], rel=RTOL
        )
    # At tp = 1 the two dispatchers hand the experts the same rows: identical losses.
    assert _losses(results['cp2_ep2_allgather']) == _losses(results['cp2_ep2_alltoall'])
