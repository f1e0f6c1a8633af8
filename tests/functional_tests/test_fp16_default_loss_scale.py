"""--fp16 with Megatron's default loss scaling (--initial-loss-scale 2**32, --hysteresis 2) trains
on CPU: the first steps overflow and are skipped while the scale backs off as Megatron logs it,
then training proceeds with finite losses. An overflow at the minimum loss scale is a real NaN and
stops the run."""

import re

import pytest

from tests.functional_tests.gpt_utils import run_pretrain
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 20
#: Mock data with a 4096-id vocabulary: fp16 matrix products are slow on a CPU, and the output
#: layer over GPT-2's 50304 ids was most of this test's time.
SMALL = [
    '--tokenizer-type',
    'NullTokenizer',
    '--vocab-size',
    '4095',
    '--hidden-size',
    '32',
    '--micro-batch-size',
    '2',
    '--global-batch-size',
    '4',
    '--mock-data',
    '--eval-iters',
    '1',
    '--lr',
    '1e-3',
]


def _log(stdout):
    """{iteration: (loss scale, skipped count, lm loss or None)} from the training log lines."""
    out = {}
    for line in stdout.splitlines():
        m = re.search(r'iteration +(\d+)/', line)
        if not m or 'loss scale:' not in line:
            continue
        scale = float(re.search(r'loss scale: ([0-9.]+) \|', line).group(1))
        skipped = int(re.search(r'number of skipped iterations: +(\d+) \|', line).group(1))
        loss = re.search(r'lm loss: ([0-9.E+-]+) \|', line)
        out[int(m.group(1))] = (scale, skipped, float(loss.group(1)) if loss else None)
    return out


def test_fp16_default_loss_scale_skips_overflow_then_trains():
    extra = SMALL + ['--fp16', '--train-iters', str(TRAIN_ITERS)]
    result = run_distributed(
        run_pretrain, world_size=1, args=(extra,), kwargs={'capture_stdout': True}, timeout=600
    )[0]
    log = _log(result['stdout'])
    assert sorted(log) == list(range(1, TRAIN_ITERS + 1))
    # Hysteresis 2: the first overflow only spends the hysteresis, every further one halves.
    assert log[1] == (2.0**32, 1, None)
    first_trained = min(it for it, (_, skipped, _) in log.items() if skipped == 0)
    assert 2 < first_trained < TRAIN_ITERS
    for it in range(2, first_trained):
        assert log[it] == (2.0 ** (33 - it), 1, None), (it, log[it])
    for it in range(first_trained, TRAIN_ITERS + 1):
        scale, skipped, loss = log[it]
        assert skipped == 0 and loss is not None and 5.0 < loss < 12.0, (it, log[it])
        assert scale == log[first_trained - 1][0]


def test_fp16_overflow_at_minimum_scale_is_a_real_nan():
    extra = SMALL + ['--fp16', '--train-iters', '6', '--min-loss-scale', str(2.0**30)]
    with pytest.raises(
        RuntimeError,
        match=r'iteration 4: inf/NaN gradients at the minimum loss '
        r'scale \(1073741824.0, --min-loss-scale\)',
    ):
        run_distributed(run_pretrain, world_size=1, args=(extra,), timeout=600)
