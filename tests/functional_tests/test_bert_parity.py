"""End-to-end parity through pretrain_bert.py: TP/PP/DP layouts of the same tiny BERT give the
serial run's `lm loss` and `sop loss` at every iteration.

Every layout starts from identical weights (`set_reference_weights`: values drawn per global
parameter name, sliced for TP, layer indices offset for PP) and reads the same global batches of
the sentence-split corpus. The micro-batch size is 2 everywhere (global batch 8): BERT's `lm loss`
is a per-micro-batch masked mean, so only layouts with the same micro-batches are comparable.
With dropout off the losses agree up to float32 reduction-order noise: relative 1e-5.
"""

import pytest

from tests.functional_tests.bert_utils import run_bert_pretrain
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 6
RTOL = 1e-5

LAYOUTS = {
    # name: (world size, tp, pp); micro batch 2, global batch 8 everywhere.
    'tp1_pp1_dp1': (1, 1, 1),
    'tp2_pp1': (2, 2, 1),
    'tp1_pp2': (2, 1, 2),
    'tp2_pp2_dp2': (8, 2, 2),
    'dp2_grad_accum': (2, 1, 1),
}
METRICS = ('lm loss', 'sop loss')


def _run(layout, data_prefix, cache):
    world, tp, pp = LAYOUTS[layout]
    extra = [
        '--tensor-model-parallel-size',
        str(tp),
        '--pipeline-model-parallel-size',
        str(pp),
        '--micro-batch-size',
        '2',
        '--global-batch-size',
        '8',
        '--train-iters',
        str(TRAIN_ITERS),
        '--eval-iters',
        '1',
        '--data-path',
        data_prefix,
        '--data-cache-path',
        cache,
    ]
    results = run_distributed(
        run_bert_pretrain,
        world_size=world,
        tp=tp,
        pp=pp,
        args=(extra,),
        kwargs={'reference_weights': True},
        timeout=600,
    )
    return results[-1]  # the last rank is on the last pipeline stage and holds the losses


@pytest.fixture(scope='module')
def reference(bert_data_prefix, tmp_path_factory):
    return _run('tp1_pp1_dp1', bert_data_prefix, str(tmp_path_factory.mktemp('cache')))


def _losses(result, metric):
    return [result['train_losses'][i][metric] for i in range(1, TRAIN_ITERS + 1)]


def test_reference_run_learns(reference):
    lm, sop = _losses(reference, 'lm loss'), _losses(reference, 'sop loss')
    assert 9.8 < lm[0] < 10.8  # ~ln(30528) at initialization
    assert 0.4 < sop[0] < 1.0  # ~ln(2)
    assert lm[-1] < lm[0] - 0.3


@pytest.mark.parametrize('layout', ['tp2_pp1', 'tp1_pp2', 'tp2_pp2_dp2', 'dp2_grad_accum'])
def test_layout_matches_reference(layout, reference, bert_data_prefix, tmp_path_factory):
    result = _run(layout, bert_data_prefix, str(tmp_path_factory.mktemp('cache')))
    assert result['iteration'] == TRAIN_ITERS
    for metric in METRICS:
        expected = _losses(reference, metric)
        assert _losses(result, metric) == pytest.approx(expected, rel=RTOL), metric
        assert result['valid_losses'][metric] == pytest.approx(
            reference['valid_losses'][metric], rel=RTOL
        )
