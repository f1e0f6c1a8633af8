"""pretrain_mamba.py end to end on a tiny hybrid (pattern M*M-, GPT-2 BPE corpus): the loss
falls, and tensor-parallel 2, pipeline-parallel 2, data-parallel 2 and context-parallel 2 (the
mixer's sequence -> heads all-to-all; also with --reset-attention-mask documents) reproduce the
serial losses from the same reference weights (the mixer's in_proj / conv sliced per segment)."""

import os

import pytest

from tests.functional_tests.mamba_utils import run_mamba_pretrain
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 8
RTOL = 1e-5


def _run(data_prefix, cache, world=1, tp=1, pp=1, cp=1, mbs=4, extra=(), first=1):
    extra = [
        '--tensor-model-parallel-size', str(tp),
        '--pipeline-model-parallel-size', str(pp),
        '--context-parallel-size', str(cp),
        '--micro-batch-size', str(mbs),
        '--global-batch-size', '8',
        '--train-iters', str(TRAIN_ITERS),
        '--eval-iters', '1',
        '--data-path', data_prefix,
        '--data-cache-path', cache,
        *extra,
    ]  # fmt: skip
    results = run_distributed(
        run_mamba_pretrain, world_size=world, tp=tp, pp=pp, cp=cp, args=(extra,), timeout=600
    )
    result = results[-1]  # the last rank is on the last stage and holds the losses
    losses = result['train_losses']
    return [float(losses[i]['lm loss']) for i in range(first, TRAIN_ITERS + 1) if i in losses]


@pytest.fixture(scope='module')
def serial(gpt_data_prefix, tmp_path_factory):
    return _run(gpt_data_prefix, str(tmp_path_factory.mktemp('mamba_cache')))


def test_hybrid_loss_falls(serial):
    assert len(serial) == TRAIN_ITERS
    assert 10.0 < serial[0] < 11.5, serial  # ~ln(50304) at initialization
    assert serial[-1] < serial[0] - 0.3, serial


@pytest.mark.parametrize(
    'layout', [dict(tp=2), dict(pp=2), dict(), dict(cp=2)], ids=['tp2', 'pp2', 'dp2', 'cp2']
)
def test_parallel_layouts_match_serial(layout, serial, gpt_data_prefix, tmp_path_factory):
    losses = _run(gpt_data_prefix, str(tmp_path_factory.mktemp('mamba_cache')), world=2, **layout)
    for step, (a, b) in enumerate(zip(losses, serial)):
        assert a == pytest.approx(b, rel=RTOL), (step, losses, serial)


def test_torch_dist_resume_tp2_to_tp1(serial, gpt_data_prefix, tmp_path_factory):
    """A TP2 run saved (torch_dist) at iteration 4 and resumed at TP1 continues the serial
    run: the mixer's per-segment keys make the checkpoint TP-invariant."""
    ckpt = str(tmp_path_factory.mktemp('mamba_ckpt'))
    cache = str(tmp_path_factory.mktemp('mamba_cache'))
    save = ['--save', ckpt, '--save-interval', '4', '--exit-interval', '4',
            '--ckpt-format', 'torch_dist']  # fmt: skip
    _run(gpt_data_prefix, cache, world=2, tp=2, extra=save)
    from megatron.core.dist_checkpointing.serialization import load_tensors_metadata

    metadata = load_tensors_metadata(os.path.join(ckpt, 'iter_0000004'))
    keys = set(metadata)
    mixer = 'decoder.layers.2.mixer.'
    for name in ('in_proj.weight.z', 'in_proj.weight.dt', 'conv1d.weight.B', 'conv1d.bias.C',
                 'A_log', 'norm.weight', 'in_proj.layer_norm_weight'):  # fmt: skip
        assert mixer + name in keys, sorted(keys)
    assert mixer + 'in_proj.weight' not in keys
    # Global (tp = 1) sizes: d_inner = 128 rows of hidden 64; 8 heads.
    assert tuple(metadata[mixer + 'in_proj.weight.z'].global_shape) == (128, 64)
    assert tuple(metadata[mixer + 'A_log'].global_shape) == (8,)
    resumed = _run(gpt_data_prefix, cache, extra=['--load', ckpt, '--ckpt-format', 'torch_dist'],
                   first=5)  # fmt: skip
    assert len(resumed) == TRAIN_ITERS - 4
    for step, (a, b) in enumerate(zip(resumed, serial[4:])):
        assert a == pytest.approx(b, rel=1e-4), (step, resumed, serial)


def test_cp2_documents_match_serial(gpt_data_prefix, tmp_path_factory):
    """--reset-attention-mask under CP2 on an attention-free pattern: the document ids are
    counted over the whole row (both chunks of every CP rank), so the losses are the serial
    ones."""
    docs = ['--reset-attention-mask', '--hybrid-override-pattern', 'M-M-']
    runs = [
        _run(gpt_data_prefix, str(tmp_path_factory.mktemp('mamba_cache')), extra=docs),
        _run(
            gpt_data_prefix, str(tmp_path_factory.mktemp('mamba_cache')), world=2, cp=2, extra=docs
        ),  # fmt: skip
    ]
    assert len(runs[0]) == TRAIN_ITERS
    for step, (a, b) in enumerate(zip(runs[1], runs[0])):
        assert a == pytest.approx(b, rel=RTOL), (step, runs)
