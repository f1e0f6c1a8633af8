"""Resume from torch_dist checkpoints through pretrain_gpt.py at the same and at other layouts.

One harness pool of 4 gloo ranks runs every job (pretrain() in-process, tiny GPT, mock data):

- an uninterrupted reference run at TP2 x PP2 with the distributed optimizer, which also saves
  `--use-dist-ckpt` at iteration 3; resumed from there (`--ckpt-step 3`) at the same layout, the
  losses equal the reference's bit for bit;
- the same checkpoint resumed with no conversion at TP1 x PP1 x DP4 (fully parallel load), TP4
  (non-distributed optimizer), TP1 x PP4: the losses equal the reference's within reduction noise
  (other summation orders), while `--no-load-optim` gives a trajectory that the same check
  rejects;
- a checkpoint saved at PP2 x VP2 x DP2 (distributed optimizer) resumes at TP2 x PP2 without VP
  and at TP1 x PP4;
- with dropout on, a same-layout resume is bitwise: the RNG states are restored (with async
  saves at every iteration, cached plans, and the dp_zero distributed-optimizer format).
"""

import os

from tests.functional_tests.test_resume import RESUME_ARGS, _hex_losses
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS, STOP_AT = 6, 3
#: The reference run saves at STOP_AT (and at the end); resumed runs load STOP_AT.
SAVE_AT_STOP = ['--save-interval', str(STOP_AT)]
RESUME = ['--ckpt-step', str(STOP_AT)]
#: Relative tolerance for another layout: fp32 with other reduction orders (measured up to
#: 1.2e-7); without the optimizer state the losses move by 6e-4 and more.
RTOL = 1e-5


def _layout(tp, pp, vp=None):
    args = ['--tensor-model-parallel-size', str(tp), '--pipeline-model-parallel-size', str(pp)]
    if vp:
        args += ['--num-layers-per-virtual-pipeline-stage', str(4 // (pp * vp))]
    return args


def _run(args_list, log=None):
    import sys

    from tests.functional_tests.test_resume import REPO

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    try:
        result = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_list=RESUME_ARGS + list(args_list),
        )
    finally:
        destroy_global_vars()
    return _hex_losses(result['train_losses'])


def _jobs(jobs):
    """Run pretrain() jobs one after the other on this rank; the union of every job's losses."""
    return [_run(args) for args in jobs]


def _merged(outs):
    """Per job, the losses of whichever rank is on the last stage."""
    merged = []
    for job in range(len(outs[0])):
        losses = {}
        for rank_out in outs:
            losses.update(rank_out[job])
        merged.append(losses)
    return merged


def _close(a_hex, b_hex):
    a, b = float.fromhex(a_hex), float.fromhex(b_hex)
    return abs(a - b) <= RTOL * abs(b)


def test_dist_ckpt_resume_matrix(tmp_path):
    common = ['--train-iters', str(TRAIN_ITERS), '--use-dist-ckpt']
    ckpt = str(tmp_path / 'ckpt')
    distopt = ['--use-distributed-optimizer']
    jobs = [
        common + _layout(2, 2) + distopt + ['--save', ckpt] + SAVE_AT_STOP,
        common + _layout(2, 2) + distopt + ['--load', ckpt] + RESUME,
        common + _layout(1, 1) + distopt + ['--load', ckpt, '--ckpt-fully-parallel-load'] + RESUME,
        common + _layout(4, 1) + ['--load', ckpt] + RESUME,
        common + _layout(1, 4) + distopt + ['--load', ckpt] + RESUME,
        common + _layout(1, 1) + distopt + ['--load', ckpt, '--no-load-optim'] + RESUME,
    ]
    outs = _merged(run_distributed(_jobs, world_size=4, args=(jobs,), timeout=900))
    reference, same, *resharded, no_optim = outs
    files = sorted(os.listdir(os.path.join(ckpt, f'iter_{STOP_AT:07d}')))
    assert files[:2] == ['.metadata', '__0_0.distcp'] and files[-2:] == [
        'common.pt',
        'metadata.json',
    ]
    assert not any(f.startswith('mp_rank') for f in files)
    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1))
    assert same == {it: reference[it] for it in range(STOP_AT + 1, TRAIN_ITERS + 1)}
    for layout, losses in zip(['TP1 DP4', 'TP4', 'PP4'], resharded):
        assert sorted(losses) == list(range(STOP_AT + 1, TRAIN_ITERS + 1)), layout
        for it, value in losses.items():
            assert _close(value, reference[it]), (layout, it, value, reference[it])
    assert not all(_close(no_optim[it], reference[it]) for it in no_optim)


def test_dist_ckpt_resume_from_vp2_dp2(tmp_path):
    common = ['--train-iters', str(TRAIN_ITERS), '--use-dist-ckpt']
    ckpt = str(tmp_path / 'ckpt')
    saved_layout = _layout(1, 2, vp=2) + ['--use-distributed-optimizer']
    jobs = [
        common + saved_layout + ['--save', ckpt] + SAVE_AT_STOP,
        common + _layout(2, 2) + ['--load', ckpt] + RESUME,
        common + _layout(1, 4) + ['--use-distributed-optimizer', '--load', ckpt] + RESUME,
    ]
    reference, *resharded = _merged(run_distributed(_jobs, world_size=4, args=(jobs,), timeout=900))
    for losses in resharded:
        assert sorted(losses) == list(range(STOP_AT + 1, TRAIN_ITERS + 1))
        for it, value in losses.items():
            assert _close(value, reference[it]), (it, value, reference[it])


def test_dist_ckpt_same_layout_async_dp_zero_restores_rng(tmp_path):
    """TP2 x DP2, dropout on, --async-save every iteration, distributed optimizer gathered on
    DP rank 0 (--no-ckpt-fully-parallel-save): the resumed losses are bitwise the reference's
    (RNG, optimizer and data position restored; the async saves completed in order)."""
    dropout = ['--hidden-dropout', '0.1', '--attention-dropout', '0.1']
    common = ['--train-iters', '4', '--use-dist-ckpt'] + _layout(2, 1) + dropout
    common += ['--use-distributed-optimizer', '--no-ckpt-fully-parallel-save']
    ckpt = str(tmp_path / 'ckpt')
    jobs = [
        common + ['--save', str(tmp_path / 'ref')],
        common
        + ['--save', ckpt, '--exit-interval', '2', '--async-save', '--save-interval', '1']
        + ['--ckpt-assume-constant-structure'],
        common + ['--load', ckpt, '--async-save', '--save', ckpt],
    ]
    reference, stopped, resumed = _merged(
        run_distributed(_jobs, world_size=4, args=(jobs,), timeout=900)
    )
    assert stopped == {it: reference[it] for it in (1, 2)}
    assert resumed == {it: reference[it] for it in (3, 4)}
    with open(os.path.join(ckpt, 'latest_checkpointed_iteration.txt')) as f:
        assert f.read() == '4'
    assert sorted(os.listdir(ckpt)) == [
        'iter_0000001',
        'iter_0000002',
        'iter_0000004',
        'latest_checkpointed_iteration.txt',
    ]


def _bert_jobs(jobs):
    from tests.functional_tests.bert_utils import run_bert_pretrain

    return [
        {
            int(it): float(v['lm loss']).hex()
            for it, v in run_bert_pretrain(args)['train_losses'].items()
        }
        for args in jobs
    ]


def _t5_jobs(jobs):
    from tests.functional_tests.t5_utils import run_pretrain_t5

    return [
        {
            int(it): float(v['lm loss']).hex()
            for it, v in run_pretrain_t5(args)['train_losses'].items()
        }
        for args in jobs
    ]


def _check_reshard(reference, resumed):
    assert sorted(resumed) == list(range(STOP_AT + 1, TRAIN_ITERS + 1))
    for it, value in resumed.items():
        assert _close(value, reference[it]), (it, value, reference[it])


def test_bert_dist_ckpt_tp2_pp2_to_tp1_dp2(tmp_path, bert_data_prefix):
    # Same micro-batch size: BERT's loss is a per-micro-batch masked mean.
    common = [
        '--train-iters',
        str(TRAIN_ITERS),
        '--global-batch-size',
        '4',
        '--eval-iters',
        '1',
        '--data-path',
        bert_data_prefix,
        '--data-cache-path',
        str(tmp_path / 'cache'),
        '--save-interval',
        '1000',
        '--use-dist-ckpt',
        '--micro-batch-size',
        '2',
    ]
    saved = common + _layout(2, 2)
    ckpt = str(tmp_path / 'ckpt')
    jobs = [
        saved + ['--save', ckpt, '--save-interval', str(STOP_AT)],
        common + _layout(1, 2) + ['--load', ckpt] + RESUME,
    ]
    reference, resumed = _merged(
        run_distributed(_bert_jobs, world_size=4, args=(jobs,), timeout=900)
    )
    _check_reshard(reference, resumed)


def test_t5_dist_ckpt_tp2_pp2_split_to_tp1(tmp_path, t5_data_prefix):
    common = [
        '--train-iters',
        str(TRAIN_ITERS),
        '--global-batch-size',
        '8',
        '--micro-batch-size',
        '2',
        '--eval-iters',
        '1',
        '--data-path',
        t5_data_prefix,
        '--data-cache-path',
        str(tmp_path / 'cache'),
        '--save-interval',
        '1000',
        '--use-dist-ckpt',
    ]
    saved = common + _layout(2, 2) + ['--pipeline-model-parallel-split-rank', '1']
    ckpt = str(tmp_path / 'ckpt')
    jobs = [
        saved + ['--save', ckpt, '--save-interval', str(STOP_AT)],
        common + _layout(1, 1) + ['--use-distributed-optimizer', '--load', ckpt] + RESUME,
    ]
    reference, resumed = _merged(run_distributed(_t5_jobs, world_size=4, args=(jobs,), timeout=900))
    _check_reshard(reference, resumed)
