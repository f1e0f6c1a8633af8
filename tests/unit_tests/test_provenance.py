"""The repository holds only text written here.

Two cheap guards that run in CI: no git-tracked file carries another organisation's copyright
header (a copied file keeps its header more often than not), and no Python file contains one of
a list of sentences that appear only in Megatron-LM's own docstrings and comments (a copied
block keeps its comments). Facts carry over (names, keys, messages, formats); text does not.
"""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ORGANISATIONS = (
    r'nvidia|meta platforms|facebook|microsoft|google|hugging ?face|openai|deepmind|'
    r'alibaba|amazon|ibm|intel|baidu|tencent'
)
# The usual shapes: "<C> (c) <year>, <Company>", "<C> <year> The <Company> ... Authors",
# "(c) <Company>, Inc. and affiliates", "<Company> ... All rights reserved." (<C>: the word).
FOREIGN_HEADER = re.compile(
    rf'copyright\s*(\(c\)|©)?\s*(\d{{4}}(\s*-\s*\d{{4}})?)?[ ,]*(the\s+)?[^\n]{{0,60}}?'
    rf'\b({_ORGANISATIONS})\b'
    rf'|\(c\)\s*(\d{{4}}[ ,]*)?({_ORGANISATIONS})\b'
    rf'|\b({_ORGANISATIONS})\b[^\n]{{0,60}}all rights reserved',
    re.IGNORECASE,
)

# Sentences of Megatron-LM's docstrings and comments that no code written here needs.
MEGATRON_ONLY_SENTENCES = (
    'Abstract method implementation',
    'Copy of decode() method for inference pipeline compatibility',
    'The highest-level wrapper class from which all dataset classes should inherit',
    'Pad vocab size so it is divisible by model parallel size',
    'Batch padding sequence so we mask the loss',
    'Retain the grad on the input_tensor.',
    'Handle single skip connection if it exists',
    'Do asserts and set fields post init',
    'Get the text (token ids) and document ids for a given index',
    'Collect the grad of the input_tensor.',
    'Original BERT wordpiece tokenizer.',
    'SentencePieceTokenizer-Megatron wrapper',
)

_SKIP_SUFFIXES = ('.bin', '.idx', '.npy', '.pt', '.so', '.png', '.gz', '.model', '.safetensors')


def _tracked_files():
    try:
        out = subprocess.run(
            ['git', 'ls-files', '-z'], cwd=REPO, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip('not a git checkout')
    return [p for p in out.decode().split('\0') if p and not p.endswith(_SKIP_SUFFIXES)]


def _text(path):
    try:
        with open(os.path.join(REPO, path), 'rb') as f:
            data = f.read()
    except OSError:  # deleted in the working tree
        return None
    if b'\0' in data[:8192]:
        return None
    return data.decode('utf-8', errors='replace')


def foreign_headers(paths):
    """(path, line) of each header of another organisation in `paths`."""
    found = []
    for path in paths:
        text = _text(path)
        if text is None:
            continue
        for match in FOREIGN_HEADER.finditer(text):
            line = text.count('\n', 0, match.start()) + 1
            found.append((path, line, match.group(0)))
    return found


def test_no_tracked_file_carries_another_organisations_copyright_header():
    found = foreign_headers(_tracked_files())
    assert not found, 'copied text (another organisation\'s header): ' + '; '.join(
        f'{p}:{n}: {m!r}' for p, n, m in found
    )


def test_no_python_file_repeats_a_megatron_only_sentence():
    found = []
    for path in _tracked_files():
        if not path.endswith('.py') or path == 'tests/unit_tests/test_provenance.py':
            continue
        text = _text(path) or ''
        found += [(path, s) for s in MEGATRON_ONLY_SENTENCES if s in text]
    assert not found, f'Megatron docstring/comment text in: {found}'


# Each header is built from pieces so that this file itself carries none (the scan covers it).
@pytest.mark.parametrize(
    'pieces',
    [
        ('# Copy', 'right (c) 2023, ', 'NVIDIA CORPORATION. All ', 'rights reserved.'),
        ('# Copy', 'right (c) ', 'Meta Platforms, Inc. and affiliates.'),
        ('# Copy', 'right 2018 The ', 'Google AI Language Team Authors.'),
        ('# Copy', 'right 2020 The ', 'Hugging', 'Face Team. All rights reserved.'),
        ('// Copy', 'right (c) ', 'Microsoft Corporation.'),
        ('# Copy', 'right (c) ', 'Facebook, Inc. and its affiliates.'),
    ],
)
def test_the_pattern_catches_the_usual_headers(pieces):
    assert FOREIGN_HEADER.search(''.join(pieces))


@pytest.mark.parametrize(
    'line',
    [
        'All rights reserved.',  # a quotation in a text corpus
        'copyright notice for the chat program',
        "print('> building GPT2BPETokenizer tokenizer ...')",
    ],
)
def test_the_pattern_lets_ordinary_text_through(line):
    assert not FOREIGN_HEADER.search(line)
