"""pretrain_vlm.py under pipeline parallelism: PP2 and TP2 x PP2 (world 4) of a tiny LLaVA on the
bundled digit captions give the serial run's per-iteration lm loss.

Every layout starts from the same weights (gpt_utils.set_reference_weights: values drawn per
global parameter name, sliced for TP, decoder layer indices offset for PP; the ViT and projector
live on stage 0 only) and reads the same micro-batches, so with dropout off the losses agree up
to float32 reduction-order noise. The first stage merges the images into the text and sends
[S, b, h]; the last stage rebuilds the expanded labels and loss mask from the ids on its own, so a
wrong layout there shows as a different loss.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 3
RTOL = 1e-5

VLM_ARGS = [
    '--num-layers', '2', '--vision-num-layers', '1', '--hidden-size', '32',
    '--num-attention-heads', '4', '--seq-length', '16', '--max-position-embeddings', '32',
    '--img-h', '8', '--img-w', '8', '--patch-dim', '4', '--disable-vision-class-token',
    '--tokenizer-type', 'NullTokenizer', '--vocab-size', '20', '--micro-batch-size', '2',
    '--global-batch-size', '4', '--train-iters', str(TRAIN_ITERS), '--lr', '1e-2',
    '--attention-dropout', '0.0', '--hidden-dropout', '0.0', '--num-workers', '0',
    '--distributed-backend', 'gloo', '--position-embedding-type', 'rope', '--eval-iters', '0',
    '--log-interval', '1', '--make-vocab-size-divisible-by', '16',
]  # fmt: skip

LAYOUTS = {
    # name: (world size, tp, pp, extra flags); data-parallel size 1 everywhere.
    'serial': (1, 1, 1, []),
    'pp2': (2, 1, 2, []),
    'tp2': (2, 2, 1, []),
    'tp2_pp2': (4, 2, 2, []),
    'tp2_pp2_sp': (4, 2, 2, ['--sequence-parallel']),
}


def _train(tp, pp, extra):
    import pretrain_vlm
    from tests.functional_tests.gpt_utils import run_pretrain

    flags = ['--tensor-model-parallel-size', str(tp), '--pipeline-model-parallel-size', str(pp)]
    result = run_pretrain(
        flags + list(extra),
        reference_weights=0.2,
        script='pretrain_vlm',
        base_args=VLM_ARGS,
        args_defaults={},
        extra_args_provider=pretrain_vlm.add_vlm_extra_args,
    )
    return [result['train_losses'][i]['lm loss'] for i in sorted(result['train_losses'])]


def _losses(layout, extra=()):
    world, tp, pp, flags = LAYOUTS[layout]
    outs = run_distributed(_train, world_size=world, tp=tp, pp=pp, args=(tp, pp, flags + list(extra)))
    return outs[-1]  # the losses are logged on the last rank (the last stage)


@pytest.fixture(scope='module')
def serial():
    return _losses('serial')


def test_serial_run_learns(serial):
    assert len(serial) == TRAIN_ITERS
    assert serial[-1] < serial[0], serial


@pytest.mark.parametrize('layout', ['pp2', 'tp2', 'tp2_pp2', 'tp2_pp2_sp'])
def test_pipeline_layout_matches_serial(layout, serial):
    losses = _losses(layout)
    assert losses == pytest.approx(serial, rel=RTOL), (layout, losses, serial)


def test_freeze_vit_matches_serial():
    """--freeze-ViT freezes a part that only stage 0 holds."""
    serial = _losses('serial', ['--freeze-ViT'])
    assert _losses('pp2', ['--freeze-ViT']) == pytest.approx(serial, rel=RTOL)
