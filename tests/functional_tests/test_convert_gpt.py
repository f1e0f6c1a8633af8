"""tools/checkpoint/convert.py on a GPT (learned positions, tied output layer).

The source is trained with pretrain_gpt.py at TP2 x PP2 with an interleaved (virtual) pipeline
and the distributed optimizer. It is converted TP2xPP2(VP2) -> TP1xPP1 -> TP4xPP1 -> TP2xPP2:
every tensor of every step equals the source bit for bit, the TP1 file holds the literal
concatenation of the source's shards (layers renumbered from the chunk-major interleaved
order), the files follow Megatron's layout, and the TP1 checkpoint fine-tunes through
pretrain_gpt.py --use-checkpoint-args with the source's first loss.
"""

import os

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.unit_tests.dist_utils import run_distributed

SOURCE_LAYOUT = [
    '--tensor-model-parallel-size',
    '2',
    '--pipeline-model-parallel-size',
    '2',
    '--num-layers-per-virtual-pipeline-stage',
    '1',
    '--use-distributed-optimizer',
]


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp('convert_gpt')
    src, tp1, tp4, back = (str(root / n) for n in ('src', 'tp1', 'tp4', 'tp2pp2'))
    cu.make_source_checkpoint(src, cu.GPT_ARCH, SOURCE_LAYOUT, world_size=4, tp=2, pp=2)
    cu.convert(
        '--loader',
        'mcore',
        '--saver',
        'mcore',
        '--load-dir',
        src,
        '--save-dir',
        tp1,
        '--target-tensor-parallel-size',
        '1',
        '--target-pipeline-parallel-size',
        '1',
    )
    # tools/checkpoint_util.py: the older name of the same tool.
    cu.convert(
        '--loader',
        'megatron',
        '--saver',
        'megatron',
        '--load-dir',
        tp1,
        '--save-dir',
        tp4,
        '--target-tensor-parallel-size',
        '4',
        '--true-vocab-size',
        '4096',
        script=cu.CHECKPOINT_UTIL,
    )
    proc = cu.convert(
        '--load-dir',
        tp4,
        '--save-dir',
        back,
        '--target-tensor-parallel-size',
        '2',
        '--target-pipeline-parallel-size',
        '2',
        '--vocab-file',
        _vocab_json(root),
    )
    return dict(src=src, tp1=tp1, tp4=tp4, back=back, log=proc.stdout)


def _vocab_json(root):
    """A JSON vocabulary with the NullTokenizer's 4096 entries (--vocab-file is JSON)."""
    import json

    path = os.path.join(str(root), 'vocab.json')
    with open(path, 'w') as f:
        json.dump({str(i): i for i in range(4096)}, f)
    return path


def test_round_trip_is_bitwise_exact(checkpoints):
    source, src_reader = cu.full_model(checkpoints['src'])
    assert (src_reader.tp, src_reader.pp, src_reader.vp) == (2, 2, 2)
    names = sorted(k for k in source if not k.endswith('(copy)'))
    assert len(names) == 2 + 4 * 12 + 2  # embeddings, 4 layers with biases, final norm
    for key in ('tp1', 'tp4', 'back'):
        converted, reader = cu.full_model(checkpoints[key])
        assert sorted(k for k in converted if not k.endswith('(copy)')) == names, key
        for name in names:
            assert torch.equal(converted[name], source[name]), f'{key}: {name} differs'
        assert reader.iteration == 3
    # Tied embeddings with PP > 1: the last stage holds a copy of the word embeddings.
    back, _ = cu.full_model(checkpoints['back'])
    assert torch.equal(
        back['output_layer.weight (copy)'], source['embedding.word_embeddings.weight']
    )


def test_tp1_file_is_the_concatenation_of_source_shards(checkpoints):
    """Literal checks on the raw files, independent of the conversion helpers."""
    src = [[cu.read_rank_file(checkpoints['src'], t, p, pp=2) for t in range(2)] for p in range(2)]
    tp1 = cu.read_rank_file(checkpoints['tp1'], 0, 0, pp=1)['model']
    # Interleaved order: chunk 0 of stages 0, 1 holds layers 0, 1; chunk 1 holds layers 2, 3.
    qkv = 'decoder.layers.0.self_attention.linear_qkv.weight'
    proj = 'decoder.layers.0.self_attention.linear_proj.weight'
    assert torch.equal(
        tp1['decoder.layers.2.self_attention.linear_qkv.weight'],
        torch.cat([src[0][t]['model1'][qkv] for t in range(2)], dim=0),
    )
    assert torch.equal(
        tp1['decoder.layers.1.self_attention.linear_proj.weight'],
        torch.cat([src[1][t]['model0'][proj] for t in range(2)], dim=1),
    )
    assert torch.equal(
        tp1['decoder.layers.3.mlp.linear_fc2.bias'],
        src[1][1]['model1']['decoder.layers.0.mlp.linear_fc2.bias'],
    )
    assert torch.equal(
        tp1['embedding.word_embeddings.weight'],
        torch.cat(
            [src[0][t]['model0']['embedding.word_embeddings.weight'] for t in range(2)], dim=0
        ),
    )


def test_megatron_file_layout_and_args(checkpoints):
    back = checkpoints['back']
    with open(os.path.join(back, 'latest_checkpointed_iteration.txt')) as f:
        assert f.read() == '3'
    assert sorted(os.listdir(os.path.join(back, 'iter_0000003'))) == [
        'mp_rank_00_000',
        'mp_rank_00_001',
        'mp_rank_01_000',
        'mp_rank_01_001',
    ]
    state = cu.read_rank_file(back, 1, 1, pp=2)
    assert sorted(state) == [
        'args',
        'checkpoint_version',
        'iteration',
        'model',
        'num_floating_point_operations_so_far',
    ]
    assert state['checkpoint_version'] == 3.0 and state['iteration'] == 3
    args = state['args']
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (2, 2)
    assert args.virtual_pipeline_model_parallel_size is None
    assert args.consumed_train_samples == 12  # 3 iterations x global batch 4
    assert args.padded_vocab_size == 4096
    assert os.listdir(os.path.join(checkpoints['tp1'], 'iter_0000003')) == ['mp_rank_00']
    # Megatron's message names, in order, on the loader side.
    log = checkpoints['log']
    sent = [line[len('sending ') :] for line in log.splitlines() if line.startswith('sending ')]
    assert sent == ['embeddings'] + [f'transformer layer {i}' for i in range(4)] + ['final norm']


def _finetune_first_loss(load_dir):
    losses = cu.run_pretrain(
        cu.GPT_ARCH
        + [
            '--load',
            load_dir,
            '--use-checkpoint-args',
            '--finetune',
            '--train-iters',
            '1',
            '--lr-warmup-iters',
            '0',
        ]
    )
    return losses.get(1)


def test_converted_checkpoint_finetunes_with_the_source_first_loss(checkpoints):
    expected = [
        o
        for o in run_distributed(
            _finetune_first_loss, world_size=4, tp=2, pp=2, args=(checkpoints['src'],), timeout=600
        )
        if o
    ]
    (got,) = run_distributed(
        _finetune_first_loss, world_size=1, args=(checkpoints['tp1'],), timeout=600
    )
    assert expected and got is not None
    assert got == pytest.approx(expected[0], rel=1e-5)
