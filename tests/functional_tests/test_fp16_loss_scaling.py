"""fp16 with dynamic loss scaling trains, and an injected overflow is skipped: the optimizer step
and the scheduler step are skipped, the loss scale halves (--hysteresis 1), and the log line counts
one skipped iteration. Values are read back from the run's TensorBoard event files."""

import re

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.functional_tests.gpt_utils import run_pretrain
from tests.unit_tests.dist_utils import run_distributed

INJECT_AT = 6
TRAIN_ITERS = 12


def _scalars(acc, tag):
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_fp16_overflow_is_skipped_and_loss_falls(gpt_data_prefix, tmp_path):
    tb_dir = tmp_path / 'tb'
    extra = [
        '--fp16',
        '--initial-loss-scale',
        '4096',
        '--hysteresis',
        '1',
        # 64 tokens a step: fp16 matrix products are slow on a CPU, and the output layer over
        # GPT-2's 50304 ids is most of the time.
        '--seq-length',
        '16',
        '--micro-batch-size',
        '2',
        '--global-batch-size',
        '4',
        '--train-iters',
        str(TRAIN_ITERS),
        '--eval-iters',
        '1',
        '--no-check-for-nan-in-loss-and-grad',
        '--data-path',
        gpt_data_prefix,
        '--data-cache-path',
        str(tmp_path / 'cache'),
        '--tensorboard-dir',
        str(tb_dir),
    ]
    result = run_distributed(
        run_pretrain,
        world_size=1,
        args=(extra,),
        kwargs={'inject_overflow_at': INJECT_AT, 'capture_stdout': True},
        timeout=600,
    )[0]
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    scale = _scalars(acc, 'loss-scale')
    lr = _scalars(acc, 'learning-rate')
    losses = _scalars(acc, 'lm loss')
    assert sorted(scale) == list(range(1, TRAIN_ITERS + 1))

    # Only the injected iteration was skipped: the scale halves there and nowhere else.
    for it in range(2, TRAIN_ITERS + 1):
        expected = scale[it - 1] / 2 if it == INJECT_AT else scale[it - 1]
        assert scale[it] == expected, (it, scale)
    assert scale[1] == 4096.0
    # The scheduler did not advance on the skipped step (lr changes every other iteration).
    assert lr[INJECT_AT] == lr[INJECT_AT - 1]
    assert all(lr[it] != lr[it - 1] for it in range(2, TRAIN_ITERS + 1) if it != INJECT_AT)

    lines = [l for l in result['stdout'].splitlines() if 'consumed samples:' in l]
    skipped = [
        int(re.search(r'number of skipped iterations: +(\d+) \|', l).group(1)) for l in lines
    ]
    assert skipped == [1 if it == INJECT_AT else 0 for it in range(1, TRAIN_ITERS + 1)]
    assert (
        ' validation loss at iteration 12 on 4-sample draw from validation set |'
        in result['stdout']
    )

    # fp16 training still learns on real text.
    assert losses[TRAIN_ITERS] < losses[1] - 0.5
    assert result['valid_losses']['lm loss'] < losses[1] - 0.5
