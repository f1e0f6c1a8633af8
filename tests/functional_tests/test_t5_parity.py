"""End-to-end parity through pretrain_t5.py: TP/PP layouts of the same tiny T5 (pipeline splits
at the encoder/decoder boundary included) give the serial run's lm loss at every iteration.

The data are 3,000 quotations of the bundled fortunes corpus, span-corrupted by
T5MaskedWordPieceDataset. Every layout starts from identical weights (`set_t5_reference_weights`:
values drawn per global parameter name, sliced for TP, layer indices taken per stack) and reads the
same global batches,
so with dropout off the losses agree up to float32 reduction-order noise (relative 1e-5).
"""

import pytest

from tests.functional_tests.t5_utils import run_pretrain_t5
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 8
RTOL = 1e-5

LAYOUTS = {
    # name: (world size, tp, pp, split rank, micro batch size); global batch 8 everywhere. The
    # micro-batch size stays 2: T5's gradient is the mean over micro-batches of per-micro-batch
    # token means, so micro-batches must hold the same samples in every layout.
    'serial': (1, 1, 1, None, 2),
    'tp2': (2, 2, 1, None, 2),
    'pp2_split1': (2, 1, 2, 1, 2),
    'pp4_split2': (4, 1, 4, 2, 2),
    'tp2_pp2_split1_dp2': (8, 2, 2, 1, 2),
}


def _run(layout, data_args):
    world, tp, pp, split, mbs = LAYOUTS[layout]
    extra = [
        '--tensor-model-parallel-size',
        str(tp),
        '--pipeline-model-parallel-size',
        str(pp),
        '--micro-batch-size',
        str(mbs),
        '--global-batch-size',
        '8',
        '--train-iters',
        str(TRAIN_ITERS),
        '--eval-iters',
        '1',
    ] + list(data_args)
    if split is not None:
        extra += ['--pipeline-model-parallel-split-rank', str(split)]
    results = run_distributed(
        run_pretrain_t5,
        world_size=world,
        tp=tp,
        pp=pp,
        split_rank=split,
        args=(extra,),
        kwargs={'reference_weights': True},
        timeout=600,
    )
    return results[-1]  # the last rank is on the last pipeline stage and holds the losses


def _losses(result):
    return [result['train_losses'][i]['lm loss'] for i in range(1, TRAIN_ITERS + 1)]


def _data_args(prefix, tmp_path_factory):
    return ['--data-path', prefix, '--data-cache-path', str(tmp_path_factory.mktemp('cache'))]


@pytest.fixture(scope='module')
def reference(t5_data_prefix, tmp_path_factory):
    return _run('serial', _data_args(t5_data_prefix, tmp_path_factory))


def test_reference_run_learns(reference):
    losses = _losses(reference)
    assert 9.5 < losses[0] < 11.5  # ~ln(30720) at initialization
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize('layout', ['tp2', 'pp2_split1', 'pp4_split2', 'tp2_pp2_split1_dp2'])
def test_layout_matches_serial(layout, reference, t5_data_prefix, tmp_path_factory):
    result = _run(layout, _data_args(t5_data_prefix, tmp_path_factory))
    assert result['iteration'] == TRAIN_ITERS
    assert _losses(result) == pytest.approx(_losses(reference), rel=RTOL)
    assert result['valid_losses']['lm loss'] == pytest.approx(
        reference['valid_losses']['lm loss'], rel=RTOL
    )
