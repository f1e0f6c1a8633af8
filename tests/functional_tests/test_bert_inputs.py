"""Bad BERT inputs stop pretrain_bert.py before training with a one-line ValueError naming the flag
or file: document-level data with the binary head (and the same data trains with
--bert-no-binary-head), a tokenizer or vocabulary without [MASK], a sequence longer than the
position table."""

import json
import os
import subprocess
import sys

import pytest

from tests.functional_tests.bert_utils import BERT_VOCAB, run_bert_pretrain
from tests.functional_tests.gpt_utils import MERGES, REPO, VOCAB
from tests.unit_tests.dist_utils import run_distributed

_RUN = [
    '--micro-batch-size',
    '2',
    '--global-batch-size',
    '2',
    '--train-iters',
    '3',
    '--eval-iters',
    '1',
    '--split',
    '4,1,1',
]


@pytest.fixture(scope='module')
def document_level_prefix(tmp_path_factory):
    """Six multi-sentence documents preprocessed *without* --split-sentences."""
    work = tmp_path_factory.mktemp('doc_level')
    with open(work / 'docs.jsonl', 'w') as f:
        for i in range(6):
            text = ' '.join(
                f'This is sentence {j} of document {i}, about whales.' for j in range(40)
            )
            f.write(json.dumps({'text': text}) + '\n')
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, 'tools', 'preprocess_data.py'),
            '--input',
            str(work / 'docs.jsonl'),
            '--output-prefix',
            str(work / 'docs'),
            '--tokenizer-type',
            'BertWordPieceLowerCase',
            '--vocab-file',
            BERT_VOCAB,
            '--workers',
            '1',
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return str(work / 'docs_text_document')


def _error_of(extra):
    with pytest.raises((RuntimeError, AssertionError)) as info:
        run_distributed(run_bert_pretrain, world_size=1, args=(extra,), timeout=300)
    return str(info.value)


def test_binary_head_needs_sentence_split_data(document_level_prefix, tmp_path):
    message = _error_of(
        _RUN + ['--data-path', document_level_prefix, '--data-cache-path', str(tmp_path)]
    )
    assert (
        f'ValueError: --data-path {document_level_prefix}: every one of its 6 documents is a '
        'single sequence'
    ) in message
    assert '--split-sentences' in message and '--bert-no-binary-head' in message


def test_document_level_data_trains_without_binary_head(document_level_prefix, tmp_path):
    (result,) = run_distributed(
        run_bert_pretrain,
        world_size=1,
        args=(
            _RUN
            + [
                '--bert-no-binary-head',
                '--data-path',
                document_level_prefix,
                '--data-cache-path',
                str(tmp_path),
            ],
        ),
        timeout=300,
    )
    assert result['iteration'] == 3
    assert set(result['train_losses'][1]) == {'lm loss'}


def test_tokenizer_without_mask_token(document_level_prefix, tmp_path):
    message = _error_of(
        _RUN
        + [
            '--tokenizer-type',
            'GPT2BPETokenizer',
            '--vocab-file',
            VOCAB,
            '--merge-file',
            MERGES,
            '--data-path',
            document_level_prefix,
            '--data-cache-path',
            str(tmp_path),
        ]
    )
    assert (
        f'ValueError: --tokenizer-type GPT2BPETokenizer (--vocab-file {VOCAB}): the '
        'vocabulary has no [MASK] token' in message
    )


def test_vocab_file_without_mask_token(document_level_prefix, tmp_path):
    vocab = tmp_path / 'no-mask-vocab.txt'
    with open(BERT_VOCAB) as f:
        vocab.write_text(''.join(line for line in f if line.strip() != '[MASK]'))
    message = _error_of(_RUN + ['--vocab-file', str(vocab), '--data-path', document_level_prefix])
    assert f'ValueError: --vocab-file {vocab}: no [MASK] token' in message


def test_sequence_longer_than_position_table(document_level_prefix):
    message = _error_of(_RUN + ['--seq-length', '128', '--data-path', document_level_prefix])
    assert 'ValueError: --max-position-embeddings (64) must be >= --seq-length (128)' in message
