"""Exact resume through pretrain_t5.py with a pipeline split at the encoder/decoder boundary.

TP=2 x PP=2 with --pipeline-model-parallel-split-rank 1 (4 gloo ranks): an uninterrupted reference
run; a run stopped by `--exit-interval` (which saves before leaving); the same command again with
`--load`, on span-corrupted fortunes (T5MaskedWordPieceDataset). The losses of the resumed
iterations equal the reference's bit for bit (fp32 on CPU, compared through float.hex).
"""

import os

from tests.functional_tests.t5_utils import run_pretrain_t5
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS, STOP_AT = 6, 3
LAYOUT = [
    '--tensor-model-parallel-size',
    '2',
    '--pipeline-model-parallel-size',
    '2',
    '--pipeline-model-parallel-split-rank',
    '1',
    '--micro-batch-size',
    '2',
    '--global-batch-size',
    '8',
    '--eval-iters',
    '1',
    '--save-interval',
    '1000',
    '--train-iters',
    str(TRAIN_ITERS),
]


def _hex(result):
    return {int(it): float(v['lm loss']).hex() for it, v in result['train_losses'].items()}


def _stop_and_resume(work_dir, data_args):
    common = LAYOUT + list(data_args)
    run = lambda extra: _hex(run_pretrain_t5(common + extra))  # noqa: E731
    reference = run(['--save', os.path.join(work_dir, 'ref')])
    resume_dir = os.path.join(work_dir, 'resume')
    stopped = run(['--save', resume_dir, '--load', resume_dir, '--exit-interval', str(STOP_AT)])
    resumed = run(['--save', resume_dir, '--load', resume_dir])
    return reference, stopped, resumed


def test_exact_resume_tp2_pp2_split1(tmp_path, t5_data_prefix):
    data_args = ['--data-path', t5_data_prefix, '--data-cache-path', str(tmp_path / 'cache')]
    outs = run_distributed(
        _stop_and_resume,
        world_size=4,
        tp=2,
        pp=2,
        split_rank=1,
        args=(str(tmp_path), data_args),
        timeout=600,
    )
    reference, stopped, resumed = outs[-1]  # the last rank is on the last stage
    assert sorted(reference) == list(range(1, TRAIN_ITERS + 1))
    assert stopped == {it: reference[it] for it in range(1, STOP_AT + 1)}
    assert resumed == {it: reference[it] for it in range(STOP_AT + 1, TRAIN_ITERS + 1)}
