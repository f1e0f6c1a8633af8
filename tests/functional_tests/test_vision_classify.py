"""End-to-end through pretrain_vision_classify.py on the bundled digits: TP2 with sequence
parallelism and DP2 reproduce the serial run's `loss` and `accuracy`, training and evaluation;
pretrain_vision_inpaint.py at TP2 + SP reproduces its serial `loss`, `psnr` and `ssim`;
pretrain_vision_dino.py at DP2 its serial `loss`; stopped runs resume with the uninterrupted
losses bit for bit; bad inputs stop start-up with one line.

Every layout starts from the same weights (drawn per global parameter name) and reads the same
global batches (`--no-data-sharding`: one permutation dealt over the DP ranks), with the random
crops, flips and colour jitter on: the seeded transforms must give every rank the same images.
"""

import pytest

from tests.functional_tests.vision_utils import prepare_digits, run_vision_classify
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 4
RTOL = 2e-5

LAYOUTS = {
    # name: (world size, tp, extra flags)
    'serial': (1, 1, []),
    'tp2_sp': (2, 2, ['--sequence-parallel']),
    'dp2': (2, 1, []),
}


@pytest.fixture(scope='module')
def digits(tmp_path_factory):
    return prepare_digits(str(tmp_path_factory.getbasetemp() / 'vision_data'))


def _flags(digits, tp, extra, train_iters=TRAIN_ITERS):
    return [
        '--tensor-model-parallel-size', str(tp), '--micro-batch-size', '4',
        '--global-batch-size', '8', '--train-iters', str(train_iters), '--eval-iters', '2',
        '--eval-interval', '2', '--data-path', f'{digits}/train', f'{digits}/val',
    ] + list(extra)  # fmt: skip


def _run(layout, digits):
    world, tp, extra = LAYOUTS[layout]
    results = run_distributed(
        run_vision_classify, world_size=world, tp=tp, args=(_flags(digits, tp, extra),)
    )
    return results[-1]


def _series(result, metric):
    # Like Megatron, the log (and so the record) leaves out a metric whose value is 0.
    return [result['train_losses'][i].get(metric, 0.0) for i in range(1, TRAIN_ITERS + 1)]


@pytest.fixture(scope='module')
def reference(digits):
    return _run('serial', digits)


@pytest.mark.parametrize('layout', ['tp2_sp', 'dp2'])
def test_layout_reproduces_serial_losses(layout, digits, reference):
    result = _run(layout, digits)
    assert len(set(_series(reference, 'loss'))) == TRAIN_ITERS  # the weights change
    for metric in ('loss', 'accuracy'):
        assert _series(result, metric) == pytest.approx(_series(reference, metric), rel=RTOL)
        assert result['valid_losses'][metric] == pytest.approx(
            reference['valid_losses'][metric], rel=RTOL
        )


def test_inpainting_tp2_reproduces_serial_losses(digits):
    flags = _flags(digits, 1, ['--mask-factor', '0.5'], train_iters=3)
    kw = {'script': 'pretrain_vision_inpaint'}
    serial = run_distributed(run_vision_classify, world_size=1, args=(flags,), kwargs=kw)[0]
    flags_tp = _flags(digits, 2, ['--mask-factor', '0.5', '--sequence-parallel'], train_iters=3)
    tp2 = run_distributed(run_vision_classify, world_size=2, tp=2, args=(flags_tp,), kwargs=kw)[-1]
    for metric in ('loss', 'psnr', 'ssim'):
        ours = [tp2['train_losses'][i][metric] for i in (1, 2, 3)]
        assert ours == pytest.approx(
            [serial['train_losses'][i][metric] for i in (1, 2, 3)], rel=RTOL
        )
    assert serial['train_losses'][3]['loss'] < serial['train_losses'][1]['loss']


_DINO = [
    '--dino-local-img-size', '4', '--dino-local-crops-number', '2', '--dino-head-hidden-size',
    '32', '--dino-bottleneck-size', '16', '--dino-out-dim', '64', '--iter-per-epoch', '2',
    '--dino-warmup-teacher-temp-epochs', '2',
    # SGD: Adam turns the reduction-order noise of near-zero gradients (a nearly uniform teacher)
    # into full-size steps, which would hide what this test compares.
    '--optimizer', 'sgd', '--lr', '0.5',
]  # fmt: skip


def test_dino_dp2_reproduces_serial_losses_and_resumes(digits, tmp_path):
    """Data parallel: the center is all-reduced over DP and the EMA teacher follows the student;
    a run stopped at iteration 2 (teacher and center in the checkpoint) resumes exactly. The
    center moves once per micro-batch, so the serial run takes the global batch in one."""
    kw = {'script': 'pretrain_vision_dino'}
    one_micro_batch = _DINO + ['--micro-batch-size', '8']
    serial = run_distributed(
        run_vision_classify,
        world_size=1,
        args=(_flags(digits, 1, one_micro_batch, train_iters=3),),
        kwargs=kw,
    )[0]
    dp2 = run_distributed(
        run_vision_classify,
        world_size=2,
        args=(_flags(digits, 1, _DINO, train_iters=3),),
        kwargs=kw,
    )[-1]
    losses = [serial['train_losses'][i]['loss'] for i in (1, 2, 3)]
    assert [dp2['train_losses'][i]['loss'] for i in (1, 2, 3)] == pytest.approx(losses, rel=RTOL)
    ckpt = str(tmp_path / 'dino')
    save = one_micro_batch + ['--save', ckpt, '--load', ckpt, '--save-interval', '2']
    run_distributed(
        run_vision_classify,
        world_size=1,
        args=(_flags(digits, 1, save + ['--exit-interval', '2'], train_iters=3),),
        kwargs=kw,
    )
    resumed = run_distributed(
        run_vision_classify, world_size=1, args=(_flags(digits, 1, save, train_iters=3),), kwargs=kw
    )[0]
    assert resumed['train_losses'][3]['loss'] == serial['train_losses'][3]['loss']
    # Megatron's k-NN evaluation of the teacher's features (bank of the training digits, gathered
    # over DP). The barely trained teacher's features are close together, so the reduction noise
    # between the two runs' weights may flip a near-tied vote: at most two of the 16 images.
    for k in (10, 20, 100, 200):
        accuracy = serial['valid_losses'][f'knn_acc_{k}']
        assert 0.0 <= accuracy <= 1.0
        assert dp2['valid_losses'][f'knn_acc_{k}'] == pytest.approx(accuracy, abs=0.126)
    assert serial['valid_losses']['knn_acc_10'] > 0.2  # well above chance (0.1), untrained


def test_exact_resume(digits, reference, tmp_path):
    ckpt = str(tmp_path / 'ckpt')
    save = ['--save', ckpt, '--load', ckpt, '--save-interval', '2']
    stopped = run_distributed(
        run_vision_classify,
        world_size=1,
        args=(_flags(digits, 1, save + ['--exit-interval', '2']),),
    )[0]
    assert stopped['iteration'] == 2
    resumed = run_distributed(run_vision_classify, world_size=1, args=(_flags(digits, 1, save),))[0]
    for it in (3, 4):
        assert resumed['train_losses'][it]['loss'] == reference['train_losses'][it]['loss']


def _start_error(digits, extra):
    try:
        run_vision_classify(_flags(digits, 1, extra, train_iters=1))
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    'extra, message',
    [
        (
            ['--num-classes', '7'],
            '--num-classes 7 does not match the data: the image folders hold 10',
        ),
        (['--patch-dim', '3'], '--img-h 8 x --img-w 8 is not divisible by --patch-dim 3'),
        (['--num-channels', '3'], "--num-channels 3 does not match the data"),
        (['--vision-backbone-type', 'mit'], 'the Swin and MiT backbones are not included'),
        (['--pipeline-model-parallel-size', '2'], 'the vision models run on one pipeline stage'),
    ],
)
def test_bad_inputs_stop_before_training(digits, extra, message):
    world = 2 if '--pipeline-model-parallel-size' in extra else 1
    errors = run_distributed(_start_error, world_size=world, pp=1, args=(digits, extra))
    assert errors[0] is not None and message in errors[0], errors[0]
    assert '\n' not in errors[0]
