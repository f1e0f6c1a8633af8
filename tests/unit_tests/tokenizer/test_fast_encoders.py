"""The compiled GPT-2 BPE encoders (tiktoken, Hugging Face tokenizers) and the WordPiece
encoder (tokenizers) give the pure-Python encoders' ids: on a slice of each bundled corpus and on
edge cases (contractions, whitespace runs, `<|endoftext|>` in text, non-Latin scripts, digits,
emoji, control characters, over-long words); tools/preprocess_data.py writes byte-identical
.bin/.idx files with the fast and the pure-Python backend."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[3]
DATA = REPO / "data"
VOCAB, MERGES = str(DATA / "gpt2" / "gpt2-vocab.json"), str(DATA / "gpt2" / "gpt2-merges.txt")

EDGE_CASES = [
    "",
    "Hello <|endoftext|> world's   they'll  I'M we've\n\n\n  x",
    "   leading and trailing   \t\n",
    "Grüße, naïve café — Ελληνικά, русский, 日本語のテキスト, عربى, हिन्दी",
    "1234567890 3.14159 1e-9 0xDEADBEEF ½ ² ⅷ",
    "emoji 😀🚀👍🏽 and ZWJ 👩‍👩‍👧 sequences",
    "code: def f(x):\n    return x**2  # comment\r\n",
    "''''s 's 't 're 've 'm 'll 'd",
]


def _corpus_slice(name, n):
    with open(DATA / "corpus" / name, encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_fast_backend_matches_pure_python(monkeypatch, backend):
    pytest.importorskip(backend)
    monkeypatch.setenv("MEGATRON_TOKENIZER_BACKEND", backend)
    tok = GPT2Tokenizer(VOCAB, MERGES)
    assert tok.encode_backend == backend
    texts = EDGE_CASES + _corpus_slice("mobydick.jsonl", 150) + _corpus_slice("fortunes.jsonl", 600)
    for text in texts:
        assert tok.encode(text) == tok.encode_python(text), text[:80]


def test_python_backend_is_the_fallback(monkeypatch):
    monkeypatch.setenv("MEGATRON_TOKENIZER_BACKEND", "python")
    tok = GPT2Tokenizer(VOCAB, MERGES)
    assert tok.encode_backend == "python" and tok._fast_encode is None
    monkeypatch.setenv("MEGATRON_TOKENIZER_BACKEND", "rust")
    with pytest.raises(ValueError, match="MEGATRON_TOKENIZER_BACKEND='rust'"):
        GPT2Tokenizer(VOCAB, MERGES)


def test_preprocess_output_identical_across_backends(tmp_path):
    corpus = tmp_path / "slice.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for text in _corpus_slice("mobydick.jsonl", 60) + EDGE_CASES:
            f.write(json.dumps({"text": text}) + "\n")
    outputs = {}
    for backend in ("auto", "python"):
        out = tmp_path / backend
        out.mkdir()
        env = dict(os.environ, MEGATRON_TOKENIZER_BACKEND=backend)
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "tools" / "preprocess_data.py"),
                "--input",
                str(corpus),
                "--output-prefix",
                str(out / "c"),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                VOCAB,
                "--merge-file",
                MERGES,
                "--append-eod",
                "--workers",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(REPO),
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        outputs[backend] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert sorted(outputs["auto"]) == ["c_text_document.bin", "c_text_document.idx"]
    assert outputs["auto"] == outputs["python"]


@pytest.mark.parametrize("tokenizer_type", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_fast_wordpiece_matches_pure_python(monkeypatch, tokenizer_type):
    pytest.importorskip("tokenizers")
    import types

    from megatron.training.tokenizer import build_tokenizer

    def build():
        return build_tokenizer(
            types.SimpleNamespace(
                tokenizer_type=tokenizer_type,
                vocab_file=str(DATA / "bert" / "bert-vocab.txt"),
                merge_file=None,
                tokenizer_model=None,
                vocab_extra_ids=2,
                make_vocab_size_divisible_by=128,
                tensor_model_parallel_size=1,
                rank=1,
            )
        )

    tok = build()
    assert tok.encode_backend == "tokenizers"
    texts = (
        EDGE_CASES
        + [
            "Ünïcödé ÀÉÎÕÜ ß ﬁ \u00ad soft\u200bhyphen \x00ctl\x7f [BOS] <extra_id_0> [MASK]",
            "x" * 150 + " long words become [UNK]",
        ]
        + _corpus_slice("mobydick.jsonl", 150)
        + _corpus_slice("fortunes.jsonl", 600)
    )
    for text in texts:
        assert tok.tokenize(text) == tok.tokenize_python(text), text[:80]
    monkeypatch.setenv("MEGATRON_TOKENIZER_BACKEND", "python")
    assert build().encode_backend == "python"


def test_tokenizer_pickles_for_spawned_dataloader_workers():
    """A DataLoader worker started by spawn / forkserver receives the tokenizer pickled: the
    memoised bpe and the compiled encoder are rebuilt, with the same ids and backend."""
    import pickle

    from megatron.training.tokenizer.tokenizer import _GPT2BPETokenizer

    wrapper = _GPT2BPETokenizer(VOCAB, MERGES)
    tok = wrapper.tokenizer
    tok.encode(EDGE_CASES[1])  # fills the bpe cache, which must not travel
    copy = pickle.loads(pickle.dumps(wrapper))
    assert copy.tokenizer.encode_backend == tok.encode_backend
    for text in EDGE_CASES + _corpus_slice("mobydick.jsonl", 20):
        assert copy.tokenize(text) == wrapper.tokenize(text), text[:80]
        assert copy.tokenizer.encode_python(text) == tok.encode_python(text), text[:80]
    assert copy.detokenize(wrapper.tokenize(EDGE_CASES[3])) == EDGE_CASES[3]
