"""A tiny DeepSeek-V3-style model (multi-latent attention, a dense then an MoE layer with sigmoid
routing, expert bias, group-limited top-k, a shared expert and the sequence-level auxiliary loss,
one multi-token-prediction layer) trained through pretrain_gpt.py: TP2 with sequence parallelism,
TP2 x EP2 (DP2) with the alltoall dispatcher, and PP2 (the MTP layer on the last stage with its
own copy of the word embedding, kept equal to the first stage's), reproduce the serial run. A
dense model with tied embeddings does the same at PP2 (the last stage's MTP embedding is the
output layer's copy of the table).

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

#: name: (world size, tp, ep, pp, extra flags)
LAYOUTS = {
    'tp2_sp': (2, 2, 1, 1, ['--sequence-parallel']),
    'tp2_sp_ep2_alltoall': (
        4,
        2,
        2,
        1,
        ['--sequence-parallel', '--moe-token-dispatcher-type', 'alltoall'],
    ),
    'pp2': (2, 1, 1, 2, []),
}


def _run(world, tp, ep, extra, data_prefix, cache, pp=1, model_args=MODEL_ARGS):
    flags = model_args + SMALL_VOCAB_ARGS + list(extra)
    flags += ['--tensor-model-parallel-size', str(tp), '--expert-model-parallel-size', str(ep)]
    flags += ['--pipeline-model-parallel-size', str(pp)]
    flags += ['--data-path', data_prefix, '--data-cache-path', cache]
    results = run_distributed(
        run_pretrain,
        world_size=world,
        tp=tp,
        ep=ep,
        pp=pp,
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
    for name, (world, tp, ep, pp, extra) in LAYOUTS.items():
        result = _run(world, tp, ep, extra, small_vocab_data_prefix, cache, pp=pp)
        assert _losses(result) == pytest.approx(_losses(reference), rel=RTOL), name
        for field, tolerance in (
            ('mtp_1 loss', dict(rel=2e-6)),
            ('seq_load_balancing_loss', dict(rel=2e-6)),
            ('grad norm', dict(abs=1.5e-3)),
        ):
            expected = pytest.approx(_logged(reference, field), **tolerance)
            assert _logged(result, field) == expected, (name, field)
    # PP2's torch_dist checkpoint (the last stage's untied table copy a non-main replica)
    # resumes at TP2 with the serial losses.
    ckpt = str(tmp_path_factory.mktemp('mla_moe_mtp_ckpt'))
    save = ['--save', ckpt, '--load', ckpt, '--save-interval', '2', '--ckpt-format', 'torch_dist']
    _run(2, 1, 1, save + ['--exit-interval', '2'], small_vocab_data_prefix, cache, pp=2)
    resumed = _run(2, 2, 1, save + ['--sequence-parallel'], small_vocab_data_prefix, cache)
    assert sorted(resumed['train_losses']) == [3, 4]
    for it in (3, 4):
        expected = reference['train_losses'][it]['lm loss']
        assert resumed['train_losses'][it]['lm loss'] == pytest.approx(expected, rel=RTOL)
    _check_converted_mtp(ckpt, str(tmp_path_factory.mktemp('mla_moe_mtp_legacy')))


def _check_converted_mtp(dist_dir, save_dir):
    """convert.py reads the MTP module of a torch_dist checkpoint (its inner MoE layer's experts
    stacked like a decoder layer's) into the legacy layout."""
    import os
    import sys

    import torch

    from tests.functional_tests import convert_utils as cu

    tools = os.path.join(cu.REPO, 'tools', 'checkpoint')
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import convert

    argv = ['--model-type', 'GPT', '--loader', 'torch_dist', '--saver', 'mcore']
    assert convert.main(argv + ['--load-dir', dist_dir, '--save-dir', save_dir]) == 0
    tracker = open(os.path.join(save_dir, 'latest_checkpointed_iteration.txt')).read().strip()
    name = os.path.join(save_dir, f'iter_{int(tracker):07d}', 'mp_rank_00', 'model_optim_rng.pt')
    model = torch.load(name, weights_only=False)['model']
    inner = 'mtp.layers.0.transformer_layer.mlp.experts.local_experts.'
    assert {k for k in model if k.startswith(inner) and k.endswith('linear_fc1.weight')} == {
        f'{inner}{e}.linear_fc1.weight' for e in range(4)
    }
    assert 'mtp.layers.0.eh_proj.weight' in model


TIED_DENSE_ARGS = [
    *('--num-layers', '2', '--position-embedding-type', 'rope', '--mtp-num-layers', '1'),
    *('--micro-batch-size', '2', '--global-batch-size', '8', '--train-iters', str(ITERS)),
    *('--eval-iters', '1', '--eod-mask-loss'),
]


def test_tied_embeddings_pp2_match_serial_and_resume_at_pp1(
    small_vocab_data_prefix, tmp_path_factory
):
    cache = str(tmp_path_factory.mktemp('mtp_tied_cache'))
    runs = [
        _run(world, 1, 1, [], small_vocab_data_prefix, cache, pp=world, model_args=TIED_DENSE_ARGS)
        for world in (1, 2)
    ]
    # A torch_dist checkpoint of the PP2 run (the last stage's table copy stored as a replica)
    # resumes at PP1 with the serial run's losses.
    ckpt = str(tmp_path_factory.mktemp('mtp_tied_ckpt'))
    save = ['--save', ckpt, '--load', ckpt, '--save-interval', '2', '--ckpt-format', 'torch_dist']
    prefix, args = small_vocab_data_prefix, TIED_DENSE_ARGS
    _run(2, 1, 1, save + ['--exit-interval', '2'], prefix, cache, pp=2, model_args=args)
    resumed = _run(1, 1, 1, save, prefix, cache, pp=1, model_args=args)
    assert sorted(resumed['train_losses']) == [3, 4]  # it resumed (a fresh run repeats 1-4)
    for it in (3, 4):
        expected = runs[0]['train_losses'][it]['lm loss']
        assert resumed['train_losses'][it]['lm loss'] == pytest.approx(expected, rel=RTOL)
    assert _losses(runs[1]) == pytest.approx(_losses(runs[0]), rel=RTOL)
    assert _logged(runs[1], 'mtp_1 loss') == pytest.approx(_logged(runs[0], 'mtp_1 loss'), rel=2e-6)
    assert _logged(runs[1], 'grad norm') == pytest.approx(_logged(runs[0], 'grad norm'), abs=1.5e-3)


def test_muon_tp2_ep2_resumes_at_tp1(small_vocab_data_prefix, tmp_path_factory):
    """Issue 39's fine-tuning layout: the MLA + MoE + MTP model with Muon at TP2 x EP2 (+ SP);
    its torch_dist checkpoint (Muon's momentum included) resumes at TP1 x EP2 with the
    uninterrupted run's losses (Muon orthogonalises whole matrices, the same at any TP)."""
    cache = str(tmp_path_factory.mktemp('mtp_muon_cache'))
    muon = ['--optimizer', 'muon', '--moe-token-dispatcher-type', 'alltoall']
    ckpt = str(tmp_path_factory.mktemp('mtp_muon_ckpt'))
    save = ['--save', ckpt, '--load', ckpt, '--save-interval', '2', '--ckpt-format', 'torch_dist']
    prefix, sp = small_vocab_data_prefix, ['--sequence-parallel']
    reference = _run(4, 2, 2, muon + sp, prefix, cache)
    _run(4, 2, 2, muon + sp + save + ['--exit-interval', '2'], prefix, cache)
    resumed = _run(2, 1, 2, muon + save, prefix, cache)
    assert sorted(resumed['train_losses']) == [3, 4]
    for it in (3, 4):
        expected = reference['train_losses'][it]['lm loss']
        assert resumed['train_losses'][it]['lm loss'] == pytest.approx(expected, rel=RTOL)
