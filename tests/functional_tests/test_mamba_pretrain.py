"""pretrain_mamba.py end to end on a tiny hybrid (pattern M*M-, GPT-2 BPE corpus): the loss
falls, and tensor-parallel 2, pipeline-parallel 2 and data-parallel 2 reproduce the serial
losses from the same reference weights (the mixer's in_proj / conv sliced per segment)."""

import pytest

from tests.functional_tests.mamba_utils import run_mamba_pretrain
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 8
RTOL = 1e-5


def _run(data_prefix, cache, world=1, tp=1, pp=1, mbs=4):
    extra = [
        '--tensor-model-parallel-size', str(tp),
        '--pipeline-model-parallel-size', str(pp),
        '--micro-batch-size', str(mbs),
        '--global-batch-size', '8',
        '--train-iters', str(TRAIN_ITERS),
        '--eval-iters', '1',
        '--data-path', data_prefix,
        '--data-cache-path', cache,
    ]  # fmt: skip
    results = run_distributed(
        run_mamba_pretrain, world_size=world, tp=tp, pp=pp, args=(extra,), timeout=600
    )
    result = results[-1]  # the last rank is on the last stage and holds the losses
    return [float(result['train_losses'][i]['lm loss']) for i in range(1, TRAIN_ITERS + 1)]


@pytest.fixture(scope='module')
def serial(gpt_data_prefix, tmp_path_factory):
    return _run(gpt_data_prefix, str(tmp_path_factory.mktemp('mamba_cache')))


def test_hybrid_loss_falls(serial):
    assert len(serial) == TRAIN_ITERS
    assert 10.0 < serial[0] < 11.5, serial  # ~ln(50304) at initialization
    assert serial[-1] < serial[0] - 0.3, serial


@pytest.mark.parametrize('layout', [dict(tp=2), dict(pp=2), dict()], ids=['tp2', 'pp2', 'dp2'])
def test_parallel_layouts_match_serial(layout, serial, gpt_data_prefix, tmp_path_factory):
    losses = _run(gpt_data_prefix, str(tmp_path_factory.mktemp('mamba_cache')), world=2, **layout)
    for step, (a, b) in enumerate(zip(losses, serial)):
        assert a == pytest.approx(b, rel=RTOL), (step, losses, serial)
