"""Detokenizers against hand-written pairs (one per rule), the WikiText windows' coverage, the
task registry's one-line errors and LAMBADA input errors."""

import json
import os
import subprocess
import sys

import pytest

from tasks.zeroshot_gpt.datasets import LambadaDataset, LMDataset, count_original_tokens
from tasks.zeroshot_gpt.detokenizer import (
    get_detokenizer,
    lambada_detokenizer,
    ptb_detokenizer,
    wikitext_detokenizer,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PTB_PAIRS = [
    ("the dog 's bone", "the dog's bone"),
    ("end \nnext", "end\nnext"),
    ("end\n next", "end\nnext"),
    ("they do n't go", "they don't go"),
    ("about N years", "about1 years"),
    ("costs $ 1 more", "costs $1 more"),
    ("issue # 1 here", "issue #1 here"),
]

WIKI_PAIRS = [
    ("the players ' union", "the players' union"),
    ("a /' 5/ b", "a /'[0-9]/ b"),  # Megatron's literal-slash pattern: only this text changes
    ("a ' 5 b", "a ' 5 b"),
    ("well @-@ known", "well-known"),
    ("1 @,@ 000", "1,000"),
    ("3 @.@ 5", "3.5"),
    ("note : this", "note: this"),
    ("one ; two", "one; two"),
    ("end . next", "end. next"),
    ("stop ! next", "stop! next"),
    ("why ? next", "why? next"),
    ("a , b", "a, b"),
    ("x ( inside ) y", "x (inside) y"),
    ("x [ inside ] y", "x [inside] y"),
    ("x { inside } y", "x {inside} y"),
    ('x " inside " y', 'x "inside" y'),
    ("x ' inside ' y", "x 'inside' y"),
    ("= = = = Deep = = = =", "==== Deep ===="),
    ("= = = Sub = = =", "=== Sub ==="),
    ("= = Section = =", "== Section =="),
    ("40 ° north", "40°north"),
    ("end \nnext", "end\nnext"),
    ("end\n next", "end\nnext"),
    ("about N years", "about 1 years"),
    ("the dog 's", "the dog's"),
]


@pytest.mark.parametrize('raw,expected', PTB_PAIRS)
def test_ptb_detokenizer(raw, expected):
    assert ptb_detokenizer(raw) == expected


@pytest.mark.parametrize('raw,expected', WIKI_PAIRS)
def test_wikitext_detokenizer(raw, expected):
    assert wikitext_detokenizer(raw) == expected


def test_lambada_detokenizer_and_selection():
    assert lambada_detokenizer(" a , b 's ") == " a , b 's "
    assert get_detokenizer('/d/ptb/wiki.txt') is ptb_detokenizer  # ptb wins over wiki
    assert get_detokenizer('/d/wikitext-103/wiki.test.tokens') is wikitext_detokenizer
    assert get_detokenizer('/d/lambada_test.jsonl') is lambada_detokenizer
    with pytest.raises(ValueError, match='--valid-data /d/test.txt'):
        get_detokenizer('/d/test.txt')


def test_original_token_count_splits_on_single_spaces():
    # newlines stay inside pieces; a double space gives an empty piece
    assert count_original_tokens(' a b\n c  d \n') == 5  # a, b\n, c, '', d


@pytest.mark.parametrize(
    'n,seq,stride',
    [(10, 4, 1), (100, 16, 4), (101, 16, 16), (57, 8, 3), (5, 16, 4), (200, 32, 32), (33, 32, 1)],
)
def test_windows_score_every_target_once(n, seq, stride):
    tokens = list(range(1, n + 1))
    ds = LMDataset(tokens, seq, 0, n, n, stride)
    scored = [0] * n
    for i in range(len(ds)):
        item = ds[i]
        assert len(item['text']) == seq + 1 and len(item['pad_mask']) == seq
        for j, m in enumerate(item['pad_mask']):
            if m:
                target = i * stride + j + 1
                assert item['text'][j + 1] == tokens[target]
                scored[target] += 1
    assert scored == [0] + [1] * (n - 1)


class _CharTokenizer:
    def tokenize(self, text):
        return [ord(c) for c in text]


def test_lambada_items_and_errors(tmp_path):
    path = tmp_path / 'lambada.jsonl'
    path.write_text(json.dumps({'text': 'ab cd'}) + '\n')
    ds = LambadaDataset(str(path), 0, _CharTokenizer(), 8, strict=True)
    item = ds[0]
    assert list(item['text']) == [ord(c) for c in 'ab cd'] + [0] * 4
    assert list(item['pad_mask']) == [0, 1, 1, 1, 0, 0, 0, 0]  # labels ' cd' after 'ab'
    ds = LambadaDataset(str(path), 0, _CharTokenizer(), 8, strict=False)
    assert list(ds[0]['pad_mask']) == [0, 0, 0, 1, 0, 0, 0, 0]  # the last token only
    path.write_text('{"text": "ok"}\n{"txt": "x"}\n')
    with pytest.raises(ValueError, match=r'lambada.jsonl: row 2: needs a non-empty "text"'):
        LambadaDataset(str(path), 0, _CharTokenizer(), 8)
    path.write_text('{"text": "far too long a passage"}\n')
    with pytest.raises(ValueError, match='row 1: passage has 22 tokens, more than'):
        LambadaDataset(str(path), 0, _CharTokenizer(), 8)


def test_unknown_task_is_one_line():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, 'tasks', 'main.py'), '--task', 'FOO'],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        'error: --task FOO: Task FOO is not implemented '
        '(known: RACE, MNLI, QQP, LAMBADA, WIKITEXT103)'
    ]
