"""Our GPT-2 BPE and BERT WordPiece ids equal HuggingFace `tokenizers` on every bundled document."""

import json
import pathlib
import types

import pytest

from megatron.training.tokenizer import build_tokenizer

tokenizers = pytest.importorskip("tokenizers")

DATA = pathlib.Path(__file__).resolve().parents[3] / "data"
CORPORA = ["mobydick.jsonl", "fortunes.jsonl"]


def _documents(name):
    with open(DATA / "corpus" / name, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _args(**kw):
    base = dict(
        vocab_file=None,
        merge_file=None,
        tokenizer_model=None,
        vocab_extra_ids=0,
        vocab_size=None,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        rank=0,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(
        _args(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(DATA / "gpt2" / "gpt2-vocab.json"),
            merge_file=str(DATA / "gpt2" / "gpt2-merges.txt"),
        )
    )


@pytest.fixture(scope="module")
def bert():
    return build_tokenizer(
        _args(
            tokenizer_type="BertWordPieceLowerCase",
            vocab_file=str(DATA / "bert" / "bert-vocab.txt"),
        )
    )


def _first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@pytest.mark.parametrize("corpus", CORPORA)
def test_gpt2_bpe_matches_hf_byte_level_bpe(gpt2, corpus):
    hf = tokenizers.ByteLevelBPETokenizer(
        str(DATA / "gpt2" / "gpt2-vocab.json"),
        str(DATA / "gpt2" / "gpt2-merges.txt"),
        add_prefix_space=False,
        trim_offsets=False,
    )
    docs = _documents(corpus)
    reference = [e.ids for e in hf.encode_batch(docs)]
    mismatches = []
    for i, (doc, ref) in enumerate(zip(docs, reference)):
        ours = gpt2.tokenize(doc)
        if ours != ref:
            mismatches.append((i, _first_difference(ours, ref)))
        # Byte-level BPE is lossless: detokenize gives the document back.
        assert gpt2.detokenize(ours) == doc, f"{corpus} document {i} does not round-trip"
    assert not mismatches, (
        f"{len(mismatches)} of {len(docs)} documents differ (doc, first token): {mismatches[:5]}"
    )
    assert sum(map(len, reference)) > 100_000  # the corpus really was tokenized


@pytest.mark.parametrize("corpus", CORPORA)
def test_bert_wordpiece_matches_hf(bert, corpus):
    hf = tokenizers.BertWordPieceTokenizer(str(DATA / "bert" / "bert-vocab.txt"), lowercase=True)
    docs = _documents(corpus)
    reference = [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)]
    mismatches = [
        i for i, (doc, ref) in enumerate(zip(docs, reference)) if bert.tokenize(doc) != ref
    ]
    assert not mismatches, f"{len(mismatches)} of {len(docs)} documents differ: {mismatches[:5]}"
    assert sum(map(len, reference)) > 100_000


def test_bert_cased_matches_hf_without_lowercasing():
    tok = build_tokenizer(
        _args(tokenizer_type="BertWordPieceCase", vocab_file=str(DATA / "bert" / "bert-vocab.txt"))
    )
    hf = tokenizers.BertWordPieceTokenizer(
        str(DATA / "bert" / "bert-vocab.txt"), lowercase=False, strip_accents=False
    )
    docs = _documents("mobydick.jsonl")[:20]
    for doc, ref in zip(docs, hf.encode_batch(docs, add_special_tokens=False)):
        assert tok.tokenize(doc) == ref.ids
