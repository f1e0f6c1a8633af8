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
`lm loss` (relative 1e-5; measured <= 2e-7 on CPU, torch 2.13), and from the log line the
gradient norm (which a missing or doubled CP factor on any gradient changes), the params norm
(3 decimals), `load_balancing_loss` and `z_loss` (7 digits; measured: equal as printed). Without
the factor cp on the auxiliary losses' gradients the router drifts: from iteration 3 the losses
differ by 3e-5 and `z_loss` by 3e-3 (relative).

Layouts: serial [1 rank]; CP1 x EP2 (DP2) [2]; CP2 x EP2 (DP2) with the allgather dispatcher [4],
and with the alltoall dispatcher, grouped experts and the distributed optimizer (expert state
sharded over the 2 ranks of the expert-data-parallel group, which are CP ranks) [4]; CP2 x TP2
with sequence parallelism, allgather (load-balancing counts summed over the tp x cp group) [4].
"""

import pytest

from tests.functional_tests.gpt_utils import SMALL_VOCAB_ARGS, run_pretrain
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

#: name: (world size, tp, cp, ep, extra flags)
LAYOUTS = {
    'cp1_ep2': (2, 1, 1, 2, []),
    'cp2_ep2_allgather': (4, 1, 2, 2, []),
    'cp2_ep2_alltoall_distopt_grouped': (
        4,
        1,
        2,
        2,
        [
            '--moe-token-dispatcher-type',
            'alltoall',
            '--use-distributed-optimizer',
            '--moe-grouped-gemm',
        ],
    ),
    'cp2_tp2_sp_allgather': (4, 2, 2, 1, ['--sequence-parallel']),
}


def _run(world, tp, cp, ep, extra, data_prefix, cache):
    flags = MOE_CP_ARGS + SMALL_VOCAB_ARGS + list(extra)
    flags += ['--tensor-model-parallel-size', str(tp)]
    flags += ['--context-parallel-size', str(cp), '--expert-model-parallel-size', str(ep)]
    flags += ['--data-path', data_prefix, '--data-cache-path', cache]
    results = run_distributed(
        run_pretrain,
        world_size=world,
        tp=tp,
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


def test_moe_under_context_parallelism_matches_serial(small_vocab_data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp('moe_cp_cache'))
    reference = _run(1, 1, 1, 1, [], small_vocab_data_prefix, cache)
    assert _losses(reference)[-1] < _losses(reference)[0]
    for name, (world, tp, cp, ep, extra) in LAYOUTS.items():
        result = _run(world, tp, cp, ep, extra, small_vocab_data_prefix, cache)
        assert _losses(result) == pytest.approx(_losses(reference), rel=RTOL), name
        assert result['valid_losses']['lm loss'] == pytest.approx(
            reference['valid_losses']['lm loss'], rel=RTOL
        )
        # Logged with 3 decimals (norms) and 7 digits (MoE losses).
        for field, tolerance in (
            ('grad norm', dict(abs=1.5e-3)),
            ('params norm', dict(abs=1.5e-3)),
            ('load_balancing_loss', dict(rel=2e-6)),
            ('z_loss', dict(rel=2e-6)),
        ):
            expected = pytest.approx(_logged(reference, field), **tolerance)
            assert _logged(result, field) == expected, (name, field)


def test_seq_aux_loss_under_context_parallelism(small_vocab_data_prefix, tmp_path_factory):
    """seq_aux_loss (DeepSeek-V3's per-sequence loss) at CP2 x TP2 with sequence parallelism:
    each rank holds a quarter of every sequence, the per-sequence counts are summed over the
    tp x cp group, and the losses and the logged `seq_load_balancing_loss` equal the serial
    run's."""
    cache = str(tmp_path_factory.mktemp('moe_cp_seq_aux_cache'))
    seq_aux = ['--moe-router-load-balancing-type', 'seq_aux_loss']
    reference = _run(1, 1, 1, 1, seq_aux, small_vocab_data_prefix, cache)
    result = _run(4, 2, 2, 1, seq_aux + ['--sequence-parallel'], small_vocab_data_prefix, cache)
    assert _losses(result) == pytest.approx(_losses(reference), rel=RTOL)
    balance = _logged(reference, 'seq_load_balancing_loss')
    assert all(value > 1.0 for value in balance), balance  # 1.0 is perfect balance
    assert _logged(result, 'seq_load_balancing_loss') == pytest.approx(balance, rel=2e-6)
    assert _logged(result, 'grad norm') == pytest.approx(
        _logged(reference, 'grad norm'), abs=1.5e-3
    )
