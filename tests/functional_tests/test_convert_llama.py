"""tools/checkpoint/convert.py on a Llama-style GPT: RoPE, RMSNorm, SwiGLU, GQA 8 heads / 2
query groups, no biases, untied output layer, with the distributed optimizer in the source.

TP2xPP2 -> TP1xPP1 -> TP1xPP4 -> TP2xPP2 (TP4 is refused: it does not divide 2 query groups).
--make-vocab-size-divisible-by 1000 makes the padded vocabulary depend on TP (6000 rows at TP2,
5000 at TP1), so the saver's re-padding runs: a smaller table keeps its leading rows, a larger
one repeats its last row. Every other tensor is bitwise equal at every step, and the model's
logits, built from the saved args alone, agree at every layout.
"""

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.unit_tests.dist_utils import run_distributed

ARCH = cu.LLAMA_ARCH + ['--make-vocab-size-divisible-by', '1000']
SOURCE_LAYOUT = [
    '--tensor-model-parallel-size',
    '2',
    '--pipeline-model-parallel-size',
    '2',
    '--use-distributed-optimizer',
]
VOCAB_TABLES = ('embedding.word_embeddings.weight', 'output_layer.weight')


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp('convert_llama')
    src, tp1, pp4, back = (str(root / n) for n in ('src', 'tp1', 'pp4', 'tp2pp2'))
    cu.make_source_checkpoint(src, ARCH, SOURCE_LAYOUT, world_size=4, tp=2, pp=2)
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
        '--true-vocab-size',
        '4096',
    )
    refused = cu.convert(
        '--loader',
        'mcore',
        '--saver',
        'mcore',
        '--load-dir',
        tp1,
        '--save-dir',
        str(root / 'tp4'),
        '--target-tensor-parallel-size',
        '4',
        check=False,
    )
    cu.convert(
        '--loader',
        'mcore',
        '--saver',
        'mcore',
        '--load-dir',
        tp1,
        '--save-dir',
        pp4,
        '--target-pipeline-parallel-size',
        '4',
        '--true-vocab-size',
        '4096',
    )
    cu.convert(
        '--loader',
        'mcore',
        '--saver',
        'mcore',
        '--load-dir',
        pp4,
        '--save-dir',
        back,
        '--target-tensor-parallel-size',
        '2',
        '--target-pipeline-parallel-size',
        '2',
        '--true-vocab-size',
        '4096',
    )
    return dict(src=src, tp1=tp1, pp4=pp4, back=back, refused=refused)


def test_tp4_refused_before_any_work(checkpoints):
    refused = checkpoints['refused']
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1] == (
        'error: --target-tensor-parallel-size 4 does not divide the number of query groups (2)'
    )
    assert 'Starting saver' not in refused.stdout


def test_round_trip_exact_with_vocab_repadding(checkpoints):
    source, _ = cu.full_model(checkpoints['src'])
    assert source['embedding.word_embeddings.weight'].shape == (6000, 64)
    names = sorted(source)
    assert 'output_layer.weight' in names and 'embedding.position_embeddings.weight' not in names
    expected_rows = {'tp1': 5000, 'pp4': 5000, 'back': 6000}
    for key, rows in expected_rows.items():
        converted, reader = cu.full_model(checkpoints[key])
        assert sorted(converted) == names, key
        assert reader.args.padded_vocab_size == rows
        for name in names:
            if name in VOCAB_TABLES:
                table = converted[name]
                assert table.shape[0] == rows
                assert torch.equal(table[:5000], source[name][:5000]), f'{key}: {name}'
                # Grown tables repeat the last row they were given (row 4999 of the TP1 table).
                assert torch.equal(table[5000:], source[name][4999:5000].expand(rows - 5000, -1))
            else:
                assert torch.equal(converted[name], source[name]), f'{key}: {name} differs'
    pp4, reader = cu.full_model(checkpoints['pp4'])
    assert (reader.tp, reader.pp) == (1, 4)


def test_tp1_swiglu_and_grouped_qkv_are_concatenated_shards(checkpoints):
    src = [cu.read_rank_file(checkpoints['src'], t, 1, pp=2)['model'] for t in range(2)]
    tp1 = cu.read_rank_file(checkpoints['tp1'], 0, 0, pp=1)['model']
    fc1 = 'decoder.layers.{}.mlp.linear_fc1.weight'
    gates, ups = zip(*(s[fc1.format(0)].chunk(2, dim=0) for s in src))  # rank r: [gate_r; up_r]
    assert torch.equal(tp1[fc1.format(2)], torch.cat(gates + ups, dim=0))
    qkv = 'decoder.layers.{}.self_attention.linear_qkv.weight'
    assert tp1[qkv.format(3)].shape == ((8 + 2 * 2) * 8, 64)
    assert torch.equal(tp1[qkv.format(3)], torch.cat([s[qkv.format(1)] for s in src], dim=0))


def _logits(load_dir, tokens):
    return cu.logits_from_checkpoint(load_dir, tokens)


def test_logits_agree_at_every_layout(checkpoints):
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = [
        o
        for o in run_distributed(
            _logits, world_size=4, tp=2, pp=2, args=(checkpoints['src'], tokens)
        )
        if o is not None
    ][0]
    (tp1,) = run_distributed(_logits, world_size=1, args=(checkpoints['tp1'], tokens))
    back = [
        o
        for o in run_distributed(
            _logits, world_size=4, tp=2, pp=2, args=(checkpoints['back'], tokens)
        )
        if o is not None
    ][0]
    assert reference.shape == (2, 16, 6000) and tp1.shape == (2, 16, 5000)
    torch.testing.assert_close(tp1[..., :4096], reference[..., :4096], atol=1e-5, rtol=0)
    assert torch.equal(back[..., :5000], reference[..., :5000])
