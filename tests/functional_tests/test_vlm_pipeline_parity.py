"""pretrain_vlm.py under pipeline parallelism: PP2, TP2 x PP2 (world 4, with and without sequence
parallelism) and PP2 x DP2 of a tiny LLaVA on the bundled digit captions give the serial run's
per-iteration lm loss; --freeze-ViT at PP2 too; TP2 x PP2 resumes exactly.

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
    # name: (world size, tp, pp, extra flags); data-parallel size 1 except pp2_dp2.
    'serial': (1, 1, 1, []),
    'pp2': (2, 1, 2, []),
    'tp2': (2, 2, 1, []),
    'tp2_pp2': (4, 2, 2, []),
    'tp2_pp2_sp': (4, 2, 2, ['--sequence-parallel']),
    'pp2_dp2': (4, 1, 2, []),
}


def _train_losses(tp, pp, extra):
    """pretrain_vlm.py's pretrain() on this rank: {iteration: {'lm loss': ...}} (last stage)."""
    import pretrain_vlm
    from tests.functional_tests.gpt_utils import run_pretrain

    flags = ['--tensor-model-parallel-size', str(tp), '--pipeline-model-parallel-size', str(pp)]
    return run_pretrain(
        flags + list(extra),
        reference_weights=0.2,
        script='pretrain_vlm',
        base_args=VLM_ARGS,
        args_defaults={},
        extra_args_provider=pretrain_vlm.add_vlm_extra_args,
    )['train_losses']


def _train(tp, pp, extra):
    losses = _train_losses(tp, pp, extra)
    return [losses[i]['lm loss'] for i in sorted(losses)]


def _losses(layout, extra=()):
    world, tp, pp, flags = LAYOUTS[layout]
    outs = run_distributed(
        _train, world_size=world, tp=tp, pp=pp, args=(tp, pp, flags + list(extra))
    )
    return outs[-1]  # the losses are logged on the last rank (the last stage)


@pytest.fixture(scope='module')
def serial():
    return _losses('serial')


def test_serial_run_learns(serial):
    assert len(serial) == TRAIN_ITERS
    assert serial[-1] < serial[0], serial


@pytest.mark.parametrize('layout', ['pp2', 'tp2', 'tp2_pp2', 'tp2_pp2_sp', 'pp2_dp2'])
def test_pipeline_layout_matches_serial(layout, serial):
    losses = _losses(layout)
    assert losses == pytest.approx(serial, rel=RTOL), (layout, losses, serial)


def test_freeze_vit_matches_serial():
    """--freeze-ViT freezes a part that only stage 0 holds."""
    serial = _losses('serial', ['--freeze-ViT'])
    assert _losses('pp2', ['--freeze-ViT']) == pytest.approx(serial, rel=RTOL)


def _stop_and_resume(work_dir, train_iters, stop_at):
    import os

    import torch

    from megatron.training import checkpointing

    def losses(flags):
        return {it: float(v['lm loss']).hex() for it, v in _train_losses(2, 2, flags).items()}

    common = ['--train-iters', str(train_iters), '--save-interval', '1000']
    reference = losses(common + ['--save', os.path.join(work_dir, 'ref')])
    resume_dir = os.path.join(work_dir, 'resume')
    again = common + ['--save', resume_dir, '--load', resume_dir]
    stopped = losses(again + ['--exit-interval', str(stop_at)])
    name = checkpointing.get_checkpoint_name(resume_dir, stop_at)
    saved = torch.load(name, weights_only=False)
    resumed = losses(again)
    return reference, stopped, resumed, sorted(k.split('.')[0] for k in saved['model'])


def test_exact_resume_tp2_pp2(tmp_path):
    """A run stopped by --exit-interval and resumed with --load gives the uninterrupted run's
    losses bit for bit; stage 0's checkpoint holds the vision parts, stage 1's only the LM."""
    from tests.functional_tests.test_resume import _check_resume

    train_iters, stop_at = 4, 2
    outs = run_distributed(
        _stop_and_resume, world_size=4, tp=2, pp=2, args=(str(tmp_path), train_iters, stop_at)
    )
    assert set(outs[0][3]) == {'language_model', 'vision_model', 'vision_projection'}
    assert set(outs[-1][3]) == {'language_model'}
    reference, stopped, resumed, _ = outs[-1]
    _check_resume(reference, stopped, resumed, train_iters, stop_at)


def test_uneven_split_matches_serial():
    """Three LM layers over PP2 with --decoder-first-pipeline-num-layers 1 (GPT's uneven split;
    the ViT stays whole on stage 0)."""
    three = ['--num-layers', '3']
    serial = _losses('serial', three)
    uneven = _losses('pp2', three + ['--decoder-first-pipeline-num-layers', '1'])
    assert uneven == pytest.approx(serial, rel=RTOL)
