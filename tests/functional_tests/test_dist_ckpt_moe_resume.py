"""An MoE GPT resumes from a torch_dist checkpoint at other expert / tensor / pipeline layouts,
through pretrain_gpt.py, with its optimizer state.

One harness pool of 4 gloo ranks runs every job (pretrain() in-process; 2 layers of 4 SwiGLU
experts, top-2, load-balancing loss, mock data):

- the uninterrupted reference at EP2 x TP2 (sequence parallel) x DP2 with the distributed
  optimizer (a dense and an expert optimizer) and the alltoall dispatcher, saving
  `--use-dist-ckpt --async-save` at iteration 3;
- resumed from there at the same layout: the losses equal the reference's bit for bit (RNG,
  optimizer, data position restored); likewise from a save with the distributed-optimizer
  state gathered per (expert) data-parallel group (`--no-ckpt-fully-parallel-save`);
- resumed at EP1 (one optimizer instead of the chain), EP4 x TP1 (fully parallel load: each
  shard the data-parallel ranks share is read once and broadcast), EP2 x TP1 x DP4 (expert data
  parallel 2) with grouped GEMM and the allgather dispatcher, EP2 x PP2, and at EP2 x TP2 with
  grouped GEMM and the non-distributed optimizer: the losses equal the reference's within
  reduction noise, while `--no-load-optim` gives a trajectory the same check rejects;
- the grouped-GEMM EP2 x DP4 run saves again (each expert-data-parallel rank its slice of the
  grouped expert weights' optimizer state); the reference layout resumes from that checkpoint
  and continues the reference's curve.
"""

import os

from tests.functional_tests.test_dist_ckpt_resume import _close, _jobs, _merged
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS, STOP_AT, RESAVE_AT = 6, 3, 5
MOE = [
    '--num-layers',
    '2',
    '--num-experts',
    '4',
    '--moe-router-topk',
    '2',
    '--moe-aux-loss-coeff',
    '1e-2',
    '--swiglu',
    '--ffn-hidden-size',
    '64',
    '--disable-bias-linear',
    '--train-iters',
    str(TRAIN_ITERS),
    '--use-dist-ckpt',
]
DISTOPT = ['--use-distributed-optimizer']


def _layout(tp, ep, pp=1, dispatcher='alltoall', grouped=False):
    args = ['--tensor-model-parallel-size', str(tp), '--pipeline-model-parallel-size', str(pp)]
    args += ['--expert-model-parallel-size', str(ep), '--moe-token-dispatcher-type', dispatcher]
    if tp > 1:
        args.append('--sequence-parallel')
    if grouped:
        args.append('--moe-grouped-gemm')
    return MOE + args


def _resume(ckpt, step=STOP_AT):
    return ['--load', ckpt, '--ckpt-step', str(step)]


def _check_close(reference, losses, first, name):
    assert sorted(losses) == list(range(first, TRAIN_ITERS + 1)), name
    for it, value in losses.items():
        assert _close(value, reference[it]), (name, it, value, reference[it])


def test_moe_dist_ckpt_resume_matrix(tmp_path):
    ckpt, resaved, dp_zero = (str(tmp_path / n) for n in ('ckpt', 'resaved', 'dp_zero'))
    reference_layout = _layout(2, 2) + DISTOPT
    jobs = {
        'reference': reference_layout
        + ['--save', ckpt, '--save-interval', str(STOP_AT), '--async-save'],
        'same layout': reference_layout + _resume(ckpt),
        'EP1': _layout(2, 1) + DISTOPT + _resume(ckpt),
        'EP4 TP1': _layout(1, 4) + DISTOPT + _resume(ckpt) + ['--ckpt-fully-parallel-load'],
        'TP1 EDP2 grouped allgather': _layout(1, 2, dispatcher='allgather', grouped=True)
        + DISTOPT
        + _resume(ckpt)
        + ['--save', resaved, '--save-interval', str(RESAVE_AT)],
        'PP2': _layout(1, 2, pp=2) + DISTOPT + _resume(ckpt),
        'grouped non-distributed optimizer': _layout(2, 2, grouped=True) + _resume(ckpt),
        'from the grouped EDP2 save': reference_layout + _resume(resaved, RESAVE_AT),
        'no optimizer state': _layout(2, 1) + DISTOPT + _resume(ckpt) + ['--no-load-optim'],
        'dp_zero save': reference_layout
        + ['--save', dp_zero, '--save-interval', str(STOP_AT), '--exit-interval', str(STOP_AT)]
        + ['--no-ckpt-fully-parallel-save'],
        'dp_zero resume': reference_layout + _resume(dp_zero),
    }
    outs = _merged(run_distributed(_jobs, world_size=4, args=(list(jobs.values()),), timeout=900))
    losses = dict(zip(jobs, outs))
    reference = losses.pop('reference')
    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1))
    resumed = {it: reference[it] for it in range(STOP_AT + 1, TRAIN_ITERS + 1)}
    assert losses.pop('same layout') == resumed
    # The distributed optimizer gathered on DP rank 0 of each (expert) data-parallel group.
    assert losses.pop('dp_zero save') == {it: reference[it] for it in range(1, STOP_AT + 1)}
    assert losses.pop('dp_zero resume') == resumed
    no_optim = losses.pop('no optimizer state')
    assert not all(_close(no_optim[it], reference[it]) for it in no_optim)
    for name, resumed in losses.items():
        first = RESAVE_AT + 1 if name == 'from the grouped EDP2 save' else STOP_AT + 1
        _check_close(reference, resumed, first, name)

    from megatron.core.dist_checkpointing.strategies.torch import read_metadata

    stored = read_metadata(os.path.join(ckpt, f'iter_{STOP_AT:07d}')).state_dict_metadata
    fc1 = 'decoder.layers.mlp.experts.experts.linear_fc1.weight'
    assert tuple(stored[fc1].size) == (2, 4, 128, 32)  # [L, E, 2 ffn, h]
    # The chained optimizer: dense state under chained_0, the experts' under chained_1.
    assert tuple(stored[f'chained_1.optimizer.state.exp_avg.{fc1}'].size) == (2, 4, 128, 32)
    assert 'chained_0.optimizer.state.exp_avg.decoder.layers.mlp.router.weight' in stored
    # RNG states per (pp, tp, ep) cell: the expert-parallel ranks' streams differ.
    rng = sorted(k for k in stored if k.startswith('rng_state/'))
    assert rng == [f'rng_state/shard_0.{t}.{e}_1.2.2' for t in (0, 1) for e in (0, 1)]
