"""End-to-end parity: TP/PP/DP layouts of the same tiny GPT give the same per-iteration lm loss.

Every layout starts from identical weights (`set_reference_weights`: values drawn per global
parameter name, sliced for TP, layer indices offset for PP) and reads the same global batches of the
preprocessed corpus (folded into a 4096-id vocabulary, gpt_utils.SMALL_VOCAB_ARGS), so with
dropout off the losses agree up to float32 reduction-order noise. Tolerance: relative 1e-5 on every
iteration's lm loss (12 iterations, Adam, fp32) and on the final validation loss.
"""

import pytest

from tests.functional_tests.gpt_utils import SMALL_VOCAB_ARGS, run_pretrain
from tests.unit_tests.dist_utils import run_distributed

TRAIN_ITERS = 12
RTOL = 1e-5

LAYOUTS = {
    # name: (world size, tp, pp, micro batch size); global batch 8 everywhere.
    'tp1_pp1_dp1': (1, 1, 1, 4),
    'tp2_pp1': (2, 2, 1, 4),
    'tp1_pp2': (2, 1, 2, 4),
    'tp2_pp2_dp2': (8, 2, 2, 2),
    'dp2_grad_accum': (2, 1, 1, 2),
    'tp2_sp_comm_overlap': (2, 2, 1, 4),
    'pp2_standalone_embedding': (2, 1, 2, 4),
}
#: Flags a layout adds: --tp-comm-overlap pipelines the sequence-parallel collectives with the
#: GEMMs of every linear layer (tensor_parallel/comm_overlap.py).
#: --standalone-embedding-stage leaves stage 0 with the embedding only (both layers on stage 1).
LAYOUT_FLAGS = {
    'tp2_sp_comm_overlap': ['--sequence-parallel', '--tp-comm-overlap'],
    'pp2_standalone_embedding': ['--standalone-embedding-stage'],
}


def _run(layout, data_prefix, cache):
    world, tp, pp, mbs = LAYOUTS[layout]
    extra = (
        SMALL_VOCAB_ARGS
        + [
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
            '2',
            '--data-path',
            data_prefix,
            '--data-cache-path',
            cache,
        ]
        + LAYOUT_FLAGS.get(layout, [])
    )
    results = run_distributed(
        run_pretrain,
        world_size=world,
        tp=tp,
        pp=pp,
        args=(extra,),
        kwargs={'reference_weights': True},
        timeout=600,
    )
    return results[-1]  # the last rank is on the last pipeline stage and holds the losses


@pytest.fixture(scope='module')
def reference(small_vocab_data_prefix, tmp_path_factory):
    return _run('tp1_pp1_dp1', small_vocab_data_prefix, str(tmp_path_factory.mktemp('cache')))


def _losses(result):
    return [result['train_losses'][i]['lm loss'] for i in range(1, TRAIN_ITERS + 1)]


def test_reference_run_learns(reference):
    losses = _losses(reference)
    assert len(losses) == TRAIN_ITERS
    assert 7.8 < losses[0] < 9.0  # ~ln(4096) at initialization
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.parametrize(
    'layout',
    [
        'tp2_pp1',
        'tp1_pp2',
        'tp2_pp2_dp2',
        'dp2_grad_accum',
        'tp2_sp_comm_overlap',
        'pp2_standalone_embedding',
    ],
)
def test_layout_matches_reference(layout, reference, small_vocab_data_prefix, tmp_path_factory):
    result = _run(layout, small_vocab_data_prefix, str(tmp_path_factory.mktemp('cache')))
    assert result['iteration'] == TRAIN_ITERS
    assert _losses(result) == pytest.approx(_losses(reference), rel=RTOL)
    assert result['valid_losses']['lm loss'] == pytest.approx(
        reference['valid_losses']['lm loss'], rel=RTOL
    )


def test_interleaved_pipeline_matches_reference(small_vocab_data_prefix, tmp_path_factory):
    """4 layers: TP1/PP2 with 2 virtual stages per rank (interleaved schedule) vs one process."""
    base = SMALL_VOCAB_ARGS + [
        '--num-layers',
        '4',
        '--micro-batch-size',
        '2',
        '--global-batch-size',
        '8',
        '--train-iters',
        '10',
        '--eval-iters',
        '1',
        '--data-path',
        small_vocab_data_prefix,
    ]
    ref = run_distributed(
        run_pretrain,
        world_size=1,
        args=(base + ['--data-cache-path', str(tmp_path_factory.mktemp('c'))],),
        kwargs={'reference_weights': True},
        timeout=600,
    )[-1]
    vpp = run_distributed(
        run_pretrain,
        world_size=2,
        pp=2,
        vpp=2,
        args=(
            base
            + [
                '--pipeline-model-parallel-size',
                '2',
                '--num-layers-per-virtual-pipeline-stage',
                '1',
                '--data-cache-path',
                str(tmp_path_factory.mktemp('c')),
            ],
        ),
        kwargs={'reference_weights': True},
        timeout=600,
    )[-1]
    ref_losses = [ref['train_losses'][i]['lm loss'] for i in range(1, 11)]
    vpp_losses = [vpp['train_losses'][i]['lm loss'] for i in range(1, 11)]
    assert vpp_losses == pytest.approx(ref_losses, rel=RTOL)
    assert ref_losses[-1] < ref_losses[0] - 0.3
