"""A tiny DeepSeek-V3-style model (multi-latent attention, a dense then an MoE layer with sigmoid
routing, expert bias, group-limited top-k, a shared expert and the sequence-level auxiliary loss,
one multi-token-prediction layer) trained through pretrain_gpt.py: TP2 with sequence parallelism,
and TP2 x EP2 (DP2) with the alltoall dispatcher, reproduce the serial run.

Every layout starts from the same weights (`set_reference_weights`: values by global name, the
TP slice taken); global batches of 8 sequences in micro-batches of 2; dropout off. Compared per
iteration: `lm loss` (relative 1e-5), and from the log line `mtp_1 loss` and
`seq_load_balancing_loss` (7 digits) and the gradient norm (3 decimals). The MTP layer's MoE
router, its eh_proj (gathered then split back to the sequence-parallel slice) and its norms
(gradients summed over tp) all take part: a wrong factor on any of them changes the gradient norm.
"""

import pytest

from tests.functional_tests.gpt_utils import SMALL_VOCAB_ARGS, run_pretrain
from tests.unit_tests.dist_utils import run_distributed

ITERS = 4
RTOL = 1e-5

MODEL_ARGS = [
    *('--num-layers', '2', '--ffn-hidden-size', '64'),
    *('--normalization', 'RMSNorm', '--swiglu', '--disable-bias-linear'),
    *('--untie-embeddings-and-output-weights', '--position-embedding-type', 'rope'),
    *('--multi-latent-attention', '--qk-layernorm', '--q-lora-rank', '32'),
    *('--kv-lora-rank', '16', '--qk-head-dim', '16', '--qk-pos-emb-head-dim', '8'),
    *('--v-head-dim', '16', '--rope-type', 'yarn', '--rotary-scaling-factor', '2'),
    *('--yarn-original-max-position-embeddings', '16', '--mscale', '1.0'),
    *('--mscale-all-dim', '1.0'),
    *('--num-experts', '4', '--moe-layer-freq', '[0,1]', '--moe-ffn-hidden-size', '32'),
    *('--moe-shared-expert-intermediate-size', '32', '--moe-router-topk', '2'),
    *('--moe-router-score-function', 'sigmoid', '--moe-router-enable-expert-bias'),
    *('--moe-router-num-groups', '2', '--moe-router-group-topk', '1'),
    *('--moe-router-topk-scaling-factor', '2.5', '--moe-router-dtype', 'fp32'),
    *('--moe-router-load-balancing-type', 'seq_aux_loss', '--moe-aux-loss-coeff', '1e-2'),
    *('--mtp-num-layers', '1', '--mtp-loss-scaling-factor', '0.3'),
    *('--micro-batch-size', '2', '--global-batch-size', '8', '--train-iters', str(ITERS)),
    *('--eval-iters', '1', '--eod-mask-loss'),
]

#: name: (world size, tp, ep, extra flags)
LAYOUTS = {
    'tp2_sp': (2, 2, 1, ['--sequence-parallel']),
    'tp2_sp_ep2_alltoall': (
        4,
        2,
        2,
        ['--sequence-parallel', '--moe-token-dispatcher-type', 'alltoall'],
    ),
}


def _run(world, tp, ep, extra, data_prefix, cache):
    flags = MODEL_ARGS + SMALL_VOCAB_ARGS + list(extra)
    flags += ['--tensor-model-parallel-size', str(tp), '--expert-model-parallel-size', str(ep)]
    flags += ['--data-path', data_prefix, '--data-cache-path', cache]
    results = run_distributed(
        run_pretrain,
        world_size=world,
        tp=tp,
        ep=ep,
        args=(flags,),
        kwargs={'reference_weights': True, 'capture_stdout': True},
        timeout=600,
    )
    return results[-1]


def _losses(result):
    return [result['train_losses'][i]['lm loss'] for i in range(1, ITERS + 1)]


def _logged(result, field):
    lines = [line for line in result['stdout'].splitlines() if 'consumed samples:' in line]
    assert len(lines) == ITERS
    return [float(line.split(f' {field}: ')[1].split(' ')[0]) for line in lines]


def test_tp2_and_tp2_ep2_match_serial(small_vocab_data_prefix, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp('mla_moe_mtp_cache'))
    reference = _run(1, 1, 1, [], small_vocab_data_prefix, cache)
    assert _losses(reference)[-1] < _losses(reference)[0]
    for name, (world, tp, ep, extra) in LAYOUTS.items():
        result = _run(world, tp, ep, extra, small_vocab_data_prefix, cache)
        assert _losses(result) == pytest.approx(_losses(reference), rel=RTOL), name
        for field, tolerance in (
            ('mtp_1 loss', dict(rel=2e-6)),
            ('seq_load_balancing_loss', dict(rel=2e-6)),
            ('grad norm', dict(abs=1.5e-3)),
        ):
            expected = pytest.approx(_logged(reference, field), **tolerance)
            assert _logged(result, field) == expected, (name, field)
