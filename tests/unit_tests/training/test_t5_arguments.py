"""Encoder-decoder (T5) flags: bad inputs fail before any work with one ValueError line naming the
flag and the numbers; --decoder-num-layers defaults to the encoder depth."""

import os
import subprocess
import sys

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.validation.argument_validation import validate_encoder_decoder_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BASE = [
    '--encoder-num-layers',
    '4',
    '--decoder-num-layers',
    '4',
    '--hidden-size',
    '64',
    '--num-attention-heads',
    '4',
    '--encoder-seq-length',
    '32',
    '--decoder-seq-length',
    '16',
    '--max-position-embeddings',
    '32',
    '--micro-batch-size',
    '2',
    '--train-iters',
    '10',
    '--lr',
    '1e-3',
    '--vocab-extra-ids',
    '100',
]


PP, SPLIT = '--pipeline-model-parallel-size', '--pipeline-model-parallel-split-rank'


def _validate(extra=(), world_size=1, drop=()):
    argv = list(BASE)
    for flag in drop:
        i = argv.index(flag)
        del argv[i : i + 2]
    args = parse_args(args_list=argv + list(extra))
    args.world_size, args.rank = world_size, 0
    args = validate_args(args, {'tokenizer_type': 'BertWordPieceLowerCase'})
    return validate_encoder_decoder_args(args)


def test_valid_t5_layout():
    args = _validate([PP, '4', SPLIT, '2'], world_size=4)
    assert args.num_layers == args.encoder_num_layers == 4
    assert args.seq_length == args.encoder_seq_length == 32


def test_decoder_num_layers_defaults_to_encoder_depth():
    args = _validate(drop=['--decoder-num-layers'])
    assert args.decoder_num_layers == 4


@pytest.mark.parametrize(
    'extra, world_size, drop, message',
    [
        (
            [PP, '2', SPLIT, '2'],
            2,
            (),
            '--pipeline-model-parallel-split-rank (2) must be < --pipeline-model-parallel-size (2)',
        ),
        (
            [SPLIT, '1'],
            1,
            (),
            '--pipeline-model-parallel-split-rank (1) needs --pipeline-model-parallel-size > 1',
        ),
        ([PP, '2', SPLIT, '0'], 2, (), '--pipeline-model-parallel-split-rank (0) must be >= 1'),
        (
            [PP, '2'],
            2,
            (),
            '--pipeline-model-parallel-split-rank is required with '
            '--pipeline-model-parallel-size 2',
        ),
        ([], 1, ['--decoder-seq-length'], '--decoder-seq-length is required'),
        (
            ['--data-path', 'corpus_text_document'],
            1,
            ['--vocab-extra-ids'],
            '--vocab-extra-ids (0) must be > 0 for T5 data',
        ),
        (
            [PP, '2', SPLIT, '1', '--num-layers-per-virtual-pipeline-stage', '1'],
            2,
            (),
            '--num-layers-per-virtual-pipeline-stage: interleaved (virtual) pipelines are not '
            'supported',
        ),
        (
            [PP, '4', SPLIT, '3'],
            4,
            (),
            '--encoder-num-layers (4) is not divisible by the 3 encoder stages',
        ),
        (
            [PP, '4', SPLIT, '1'],
            4,
            (),
            '--decoder-num-layers (4) is not divisible by the 3 decoder stages',
        ),
    ],
)
def test_bad_inputs_name_the_flag(extra, world_size, drop, message):
    with pytest.raises(ValueError) as err:
        _validate(extra, world_size, drop)
    assert message in str(err.value)
    assert '\n' not in str(err.value)


def test_pretrain_t5_fails_before_training(tmp_path):
    """The script itself: one ValueError line, no model built, no iteration run."""
    env = dict(
        os.environ,
        RANK='0',
        WORLD_SIZE='1',
        LOCAL_RANK='0',
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT='29517',
        OMP_NUM_THREADS='1',
        PYTHONPATH=REPO,
    )
    argv = [a for a in BASE]
    i = argv.index('--decoder-seq-length')
    del argv[i : i + 2]
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, 'pretrain_t5.py'),
            *argv,
            '--vocab-file',
            os.path.join(REPO, 'data', 'bert', 'bert-vocab.txt'),
            '--distributed-backend',
            'gloo',
            '--data-path',
            str(tmp_path / 'none'),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    # One line, no traceback (the entry script's run_main).
    assert proc.stderr.strip().splitlines() == [
        'error: --decoder-seq-length is required for encoder-decoder (T5) models'
    ], proc.stderr
    assert 'building T5 model' not in proc.stdout and ' iteration ' not in proc.stdout
