"""The compiled GPT-2 BPE (tiktoken) and WordPiece (HF tokenizers) encoders give the same ids as
the pure-Python tokenizers on the bundled corpora, preprocessing writes byte-identical .bin/.idx
either way, and the Python tokenizers take over when a library is missing or disabled."""

import builtins
import importlib.util
import json
import pathlib
import sys
import types

import pytest

from megatron.training.tokenizer import fast_encoders
from megatron.training.tokenizer.tokenizer import _BertWordPieceTokenizer, _GPT2BPETokenizer

REPO = pathlib.Path(__file__).resolve().parents[3]
DATA = REPO / "data"
GPT2_FILES = (str(DATA / "gpt2" / "gpt2-vocab.json"), str(DATA / "gpt2" / "gpt2-merges.txt"))
BERT_VOCAB = str(DATA / "bert" / "bert-vocab.txt")

EDGE_CASES = [
    "<|endoftext|> stays text  \n\n  x",
    "Café naïve ÉCOLE 中文字 ﬁ ß İstanbul \u00a0nbsp \u200bzwsp tab\tz",
    "a" * 150 + " " + "b" * 99,
    "日本語のテキスト",
    "emoji 😀👍🏽",
    "  leading",
    "trailing  ",
    "\x00\ufffd ctrl\x07 end",
    "don't we'll I'M 123,456.78 $5 -- (x)[y]{z}",
    "",
]


def _corpus_sample():
    """Every 5th fortune, the first 6 Moby Dick chapters (long documents), and edge cases."""
    with open(DATA / "corpus" / "fortunes.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for i, line in enumerate(f) if i % 5 == 0]
    with open(DATA / "corpus" / "mobydick.jsonl", encoding="utf-8") as f:
        texts += [json.loads(line)["text"] for _, line in zip(range(6), f)]
    return texts + EDGE_CASES


def _pure(tokenizer):
    return types.SimpleNamespace(
        tokenize=lambda text: (
            tokenizer.tokenizer.encode(text)
            if isinstance(tokenizer, _GPT2BPETokenizer)
            else tokenizer.tokenizer.convert_tokens_to_ids(tokenizer.tokenizer.tokenize(text))
        )
    )


@pytest.mark.parametrize("kind", ["gpt2", "bert_lower", "bert_case"])
def test_fast_ids_identical_on_bundled_corpora(kind):
    if kind == "gpt2":
        tokenizer = _GPT2BPETokenizer(*GPT2_FILES)
    else:
        tokenizer = _BertWordPieceTokenizer(BERT_VOCAB, lower_case=kind == "bert_lower")
    assert tokenizer._fast_encode is not None, "tiktoken / tokenizers are installed in the test env"
    pure = _pure(tokenizer)
    for text in _corpus_sample():
        assert tokenizer.tokenize(text) == pure.tokenize(text), repr(text[:80])


def test_gpt2_fast_encoder_refuses_files_whose_merge_order_differs():
    tokenizer = _GPT2BPETokenizer(*GPT2_FILES)
    merges = list(tokenizer.tokenizer.bpe_ranks)
    swapped = [merges[1], merges[0]] + merges[2:]  # token ids no longer follow merge order
    assert fast_encoders.gpt2_fast_encoder(tokenizer.tokenizer.encoder, merges) is not None
    assert fast_encoders.gpt2_fast_encoder(tokenizer.tokenizer.encoder, swapped) is None


def test_fallback_when_libraries_missing(monkeypatch):
    real_import = builtins.__import__

    def no_fast_libs(name, *args, **kwargs):
        if name.split(".")[0] in ("tiktoken", "tokenizers"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fast_libs)
    gpt2 = _GPT2BPETokenizer(*GPT2_FILES)
    bert = _BertWordPieceTokenizer(BERT_VOCAB, lower_case=True)
    assert gpt2._fast_encode is None and bert._fast_encode is None
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert bert.tokenize("Hello world") == [bert.vocab["hello"], bert.vocab["world"]]


def test_environment_disables_fast_encoders(monkeypatch):
    monkeypatch.setenv(fast_encoders.PURE_PYTHON_ENV, "1")
    assert _GPT2BPETokenizer(*GPT2_FILES)._fast_encode is None
    assert _BertWordPieceTokenizer(BERT_VOCAB)._fast_encode is None


def _load_preprocess():
    spec = importlib.util.spec_from_file_location(
        "_fast_tokenizers_preprocess_data", REPO / "tools" / "preprocess_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # worker pools pickle the tool's classes by module name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "tokenizer_args",
    [
        [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            GPT2_FILES[0],
            "--merge-file",
            GPT2_FILES[1],
        ],
        ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", BERT_VOCAB],
    ],
    ids=["gpt2", "bert"],
)
def test_preprocess_output_byte_identical_fast_and_pure(tmp_path, monkeypatch, tokenizer_args):
    preprocess = _load_preprocess()
    corpus = tmp_path / "sample.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for text in _corpus_sample()[::3]:
            f.write(json.dumps({"text": text}) + "\n")
    outputs = {}
    for mode in ("fast", "pure"):
        if mode == "pure":
            monkeypatch.setenv(fast_encoders.PURE_PYTHON_ENV, "1")
        prefix = str(tmp_path / mode)
        preprocess.run(
            preprocess.get_args(
                [
                    "--input",
                    str(corpus),
                    "--output-prefix",
                    prefix,
                    "--append-eod",
                    "--workers",
                    "2",
                    "--log-interval",
                    "100000",
                ]
                + tokenizer_args
            )
        )
        outputs[mode] = [
            pathlib.Path(prefix + "_text_document" + ext).read_bytes() for ext in (".bin", ".idx")
        ]
    assert len(outputs["fast"][0]) > 1000
    assert outputs["fast"] == outputs["pure"]
