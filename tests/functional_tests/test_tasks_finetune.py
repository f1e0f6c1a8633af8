"""BERT fine-tuning through tasks/main.py on the MNLI-layout fixture of
tasks/make_fixture_data.py (the label is which book a passage pair comes from: a test of the code
paths, not of language ability).

A tiny BERT fine-tuned for 4 epochs reaches an accuracy well above chance (1/3); its checkpoint,
evaluated with --epochs 0, gives the same accuracy; bad inputs fail with one line naming the file
and row before any training.
"""

import os
import subprocess
import sys

import pytest

from tests.functional_tests.gpt_utils import REPO
from tests.functional_tests.tasks_utils import accuracy_lines, run_task
from tests.unit_tests.dist_utils import run_distributed

BERT_VOCAB = os.path.join(REPO, 'data', 'bert', 'bert-vocab.txt')
TINY_BERT = [
    '--num-layers',
    '2',
    '--hidden-size',
    '64',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '64',
    '--max-position-embeddings',
    '64',
    '--micro-batch-size',
    '8',
    '--vocab-file',
    BERT_VOCAB,
    '--num-workers',
    '0',
    '--log-interval',
    '10',
    '--hidden-dropout',
    '0.0',
    '--attention-dropout',
    '0.0',
    '--make-vocab-size-divisible-by',
    '32',
    '--seed',
    '1234',
]


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    sys.path.insert(0, REPO)
    from tasks.make_fixture_data import build_all

    return build_all(
        str(tmp_path_factory.mktemp('task_data')),
        race_train_docs=3,
        race_dev_docs=3,
        lambada=2,
        wiki_paragraphs=2,
    )


def _run(args):
    ((result, stdout),) = run_distributed(run_task, world_size=1, args=(args,), timeout=600)
    return result, stdout


def test_mnli_finetune_then_evaluate_only(data, tmp_path):
    save = str(tmp_path / 'mnli')
    dev = os.path.join(data, 'MNLI', 'dev_matched.tsv')
    result, stdout = _run(
        [
            '--task',
            'MNLI',
            '--epochs',
            '4',
            '--lr',
            '1e-3',
            '--train-data',
            os.path.join(data, 'MNLI', 'train.tsv'),
            '--valid-data',
            dev,
            '--save',
            save,
            '--save-interval',
            '10000',
            '--eval-interval',
            '1000',
        ]
        + TINY_BERT
    )
    lines = accuracy_lines(stdout)
    assert [(e, n) for e, n, _, _ in lines] == [(e, 'dev-matched') for e in range(4)]
    assert stdout.count('working on epoch ') == 4 and 'working on epoch 4 ...' in stdout
    _, _, correct, total = lines[-1]
    assert total == 60 and correct / total > 0.45, lines  # chance is 1/3
    assert result[3]['overall'] == (correct, total)
    assert ' >> |epoch: 3| overall: correct / total = ' in stdout

    result, stdout = _run(
        [
            '--task',
            'MNLI',
            '--epochs',
            '0',
            '--valid-data',
            dev,
            '--load',
            save,
            '--no-load-optim',
            '--no-load-rng',
        ]
        + TINY_BERT
    )
    assert accuracy_lines(stdout) == [(-1, 'dev-matched', correct, total)]
    assert result[-1]['overall'] == (correct, total)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _one_line_error(args):
    env = dict(
        os.environ,
        PYTHONPATH=REPO,
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=str(_free_port()),
        RANK='0',
        WORLD_SIZE='1',
        LOCAL_RANK='0',
    )
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, 'tasks', 'main.py'), *args, *TINY_BERT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr
    assert 'working on epoch' not in proc.stdout
    return lines[0]


def test_bad_inputs_fail_before_training(data, tmp_path):
    train = os.path.join(data, 'MNLI', 'train.tsv')
    rows = open(train).read().splitlines()
    bad_columns = tmp_path / 'cols.tsv'
    bad_columns.write_text('\n'.join(rows[:3] + ['\t'.join(rows[3].split('\t')[:9])]) + '\n')
    bad_label = tmp_path / 'label.tsv'
    bad_label.write_text('\n'.join(rows[:2] + [rows[2].rsplit('\t', 1)[0] + '\tmaybe']) + '\n')
    common = ['--epochs', '1', '--lr', '1e-3', '--valid-data', train]
    line = _one_line_error(['--task', 'MNLI', '--train-data', str(bad_columns)] + common)
    assert f'{bad_columns}: row 4: 9 columns, the header has 12' in line
    line = _one_line_error(['--task', 'MNLI', '--train-data', str(bad_label)] + common)
    assert f"{bad_label}: row 3: unknown label 'maybe'" in line
    missing = str(tmp_path / 'nope.tsv')
    line = _one_line_error(['--task', 'MNLI', '--train-data', missing] + common)
    assert f'{missing}: no such file' in line
    line = _one_line_error(['--task', 'MNLX'] + common)
    assert 'Task MNLX is not implemented' in line


def _pretrain_bert(save, data_prefix):
    from tests.functional_tests.bert_utils import run_bert_pretrain

    return run_bert_pretrain(
        [
            '--micro-batch-size',
            '2',
            '--global-batch-size',
            '2',
            '--train-iters',
            '4',
            '--eval-iters',
            '1',
            '--data-path',
            data_prefix,
            '--save',
            save,
            '--save-interval',
            '4',
            '--bert-no-binary-head',
        ]
    )


@pytest.fixture(scope='module')
def bert_document_prefix(tmp_path_factory):
    """mobydick.jsonl preprocessed with the BERT vocabulary, one sentence per document (no
    NLTK model needed)."""
    from tests.functional_tests.gpt_utils import preprocess_once

    return preprocess_once(
        str(tmp_path_factory.mktemp('bert_doc')),
        'mobydick',
        'document',
        ['--tokenizer-type', 'BertWordPieceLowerCase', '--vocab-file', BERT_VOCAB],
    )


def test_finetune_from_pretrained_bert(data, tmp_path, bert_document_prefix):
    """Weights from --pretrained-checkpoint (a BERT pretrained without the binary head, so its
    pooler starts random too); iteration, optimizer and LR schedule start fresh; the task head
    starts random."""
    from tests.functional_tests.bert_utils import TINY_BERT_ARGS

    pretrained = str(tmp_path / 'bert')
    run_distributed(
        _pretrain_bert, world_size=1, args=(pretrained, bert_document_prefix), timeout=600
    )
    size = TINY_BERT_ARGS[: TINY_BERT_ARGS.index('--lr')]  # the architecture flags, seq 32
    result, stdout = _run(
        [
            '--task',
            'MNLI',
            '--epochs',
            '1',
            '--lr',
            '1e-3',
            '--train-data',
            os.path.join(data, 'MNLI', 'train.tsv'),
            '--valid-data',
            os.path.join(data, 'MNLI', 'dev_matched.tsv'),
            '--pretrained-checkpoint',
            pretrained,
            '--micro-batch-size',
            '8',
            '--vocab-file',
            BERT_VOCAB,
            '--num-workers',
            '0',
            '--log-interval',
            '10',
            '--eval-interval',
            '1000',
        ]
        + size
    )
    assert f'successfully loaded checkpoint from {pretrained}' in stdout
    assert 'at iteration 0' in stdout
    assert 'could not find "classification_head" in the pretrained checkpoint' in stdout
    assert ' iteration       10/      30 |' in stdout
    assert accuracy_lines(stdout)[0][:2] == (0, 'dev-matched')


def test_race_finetune_then_evaluate_only(tmp_path):
    """RACE layout: 4 rows per question (the micro batch counts questions), per-directory names,
    the fine-tuned checkpoint evaluates to the same accuracy with --epochs 0."""
    sys.path.insert(0, REPO)
    from tasks.make_fixture_data import build_all

    data = build_all(
        str(tmp_path / 'data'),
        n_train=3,
        n_dev=3,
        race_train_docs=30,
        race_dev_docs=12,
        lambada=2,
        wiki_paragraphs=2,
    )
    save = str(tmp_path / 'race')
    dev = os.path.join(data, 'RACE', 'dev', 'middle')
    result, stdout = _run(
        [
            '--task',
            'RACE',
            '--epochs',
            '1',
            '--lr',
            '1e-3',
            '--train-data',
            os.path.join(data, 'RACE', 'train', 'middle'),
            '--valid-data',
            dev,
            '--save',
            save,
            '--save-interval',
            '10000',
            '--eval-interval',
            '1000',
            '--micro-batch-size',
            '4',
        ]
        + TINY_BERT[: TINY_BERT.index('--micro-batch-size')]
        + TINY_BERT[TINY_BERT.index('--micro-batch-size') + 2 :]
    )
    ((epoch, name, correct, total),) = accuracy_lines(stdout)
    assert (epoch, name, total) == (0, 'dev-middle', 24)  # 12 documents x 2 questions
    assert 'global batch size:    16 |' in stdout  # 4 questions x 4 options
    result, stdout = _run(
        [
            '--task',
            'RACE',
            '--epochs',
            '0',
            '--valid-data',
            dev,
            '--load',
            save,
            '--no-load-optim',
            '--no-load-rng',
        ]
        + TINY_BERT
    )
    assert accuracy_lines(stdout) == [(-1, 'dev-middle', correct, total)]
