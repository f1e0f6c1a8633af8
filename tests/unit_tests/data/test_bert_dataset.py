"""BERTMaskedWordPieceDataset: a hand-checked toy sample, properties over many samples of real text,
the cache files, blending through the builder, and the config / data errors.

Sample-for-sample equality with Megatron's own implementation is in test_masked_golden.py.
"""

import hashlib
import json
import os

import numpy
import pytest

from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
    _truncate_segments,
)
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import _choice_cdf, _weighted_choice
from megatron.core.datasets.utils import Split
from tests.unit_tests.data.sentence_corpus import (
    bert_tokenizer,
    bundled_sentence_corpus,
    masking_args,
    toy_corpus,
    write_sentence_dataset,
)

PAD, CLS, SEP, MASK = 0, 2, 3, 4


def _bert(prefix, tokenizer, num_samples=None, documents=None, **overrides):
    fields = dict(masking_args(), random_seed=1234, sequence_length=64, classification_head=True)
    fields.update(overrides)
    config = BERTMaskedWordPieceDatasetConfig(tokenizer=tokenizer, **fields)
    indexed = IndexedDataset(prefix)
    if documents is None:
        documents = numpy.arange(indexed.document_indices.shape[0] - 1)
    return BERTMaskedWordPieceDataset(indexed, prefix, documents, num_samples, Split.train, config)


def test_hand_checked_toy_samples(tmp_path):
    """Two samples worked out by hand from their random draws (listed below, in draw order).

    Config: seq 12 (target 9 = 12 - [CLS] - 2 [SEP]), mask prob 0.5, no short sequences (every
    target is 9), seed 2070, one epoch. build_mapping makes one row per document (both fit the
    target) and its shuffle keeps their order here.
    """
    prefix, tok = toy_corpus(tmp_path)
    ds = _bert(
        prefix,
        tok,
        sequence_length=12,
        random_seed=2070,
        masking_probability=0.5,
        short_sequence_probability=0.0,
        path_to_cache=str(tmp_path / "cache"),
    )
    assert ds.sample_index.dtype == numpy.uint32
    assert ds.sample_index.tolist() == [[0, 3, 9], [3, 5, 9]]
    assert len(ds) == 2

    # Sample 0 = doc 0, RandomState(2070):
    #  randint(1, 3) = 2 -> A = "the white whale cap ##tain ahab", B = "sails on the sea"
    #  random() = 0.254 < 0.5 -> swap: A = [14 15 5 8], B = [5 13 6 9 10 11]; is_random = 1
    #  4 + 6 > 9: B is longer, random() = 0.194 < 0.5 -> drop B's first token ("the"); truncated
    #  tokens [CLS] 14 15 5 8 [SEP] 13 6 9 10 11 [SEP]; whole-word candidates [1] [2] [3] [4] [6]
    #  [7] [8, 9] [10]; budget min(0.5 * 9, max(1, round(12 * 0.5))) = 4.5
    #  shuffle -> [6] [10] [7] [1] [4] [8,9] [3] [2]; candidate [6]: choice N = 3 -> words
    #  [6] [7] [8, 9] = 4 positions, fits:
    #    pos 6: random() = 0.940 >= 0.8, random() = 0.577 >= 0.5 -> randint(0, 18) = 9 ("cap")
    #    pos 7: random() = 0.403 < 0.8 -> [MASK]
    #    pos 8: random() = 0.996, random() = 0.115 < 0.5 -> kept; pos 9: 0.994, 0.020 -> kept
    #  every other candidate draws its N but no 1-gram fits the 0.5 left; then the final shuffle.
    s = ds[0]
    assert s["text"].tolist() == [CLS, 14, 15, 5, 8, SEP, 9, MASK, 9, 10, 11, SEP]
    assert s["types"].tolist() == [0] * 6 + [1] * 6
    assert s["labels"].tolist() == [-1] * 6 + [13, 6, 9, 10] + [-1, -1]
    assert s["loss_mask"].tolist() == [0] * 6 + [1, 1, 1, 1] + [0, 0]
    assert s["padding_mask"].tolist() == [1] * 12
    assert (s["is_random"], s["truncated"]) == (1, 1)

    # Sample 1 = doc 1, RandomState(2071):
    #  two sentences -> pivot 1 without a draw; random() = 0.724 -> no swap; 5 <= 9 tokens
    #  tokens [CLS] 5 7 [SEP] 11 12 14 [SEP] (8 real + 4 pad); candidates [1] [2] [4, 5] [6];
    #  budget min(4.5, max(1, round(8 * 0.5))) = 4
    #  shuffle -> [4,5] [2] [6] [1]; [4,5]: N = 2 -> [4, 5] [6] = 3 positions:
    #    pos 4: 0.114 -> [MASK]; pos 5: 0.828, 0.761 -> randint(0, 18) = 7 ("ship"); pos 6: 0.281
    #  [2]: N = 1 -> 3 + 1 <= 4: pos 2: 0.726 -> [MASK]; then 4 >= 4 stops; final shuffle.
    s = ds[1]
    assert s["text"].tolist() == [CLS, 5, MASK, SEP, MASK, 7, MASK, SEP] + [PAD] * 4
    assert s["types"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1] + [PAD] * 4
    assert s["labels"].tolist() == [-1, -1, 7, -1, 11, 12, 14, -1] + [-1] * 4
    assert s["loss_mask"].tolist() == [0, 0, 1, 0, 1, 1, 1, 0] + [0] * 4
    assert s["padding_mask"].tolist() == [1] * 8 + [PAD] * 4
    assert (s["is_random"], s["truncated"]) == (0, 0)
    for key in ("text", "types", "labels", "padding_mask", "loss_mask"):
        assert s[key].dtype == numpy.int64 and s[key].shape == (12,)
    assert type(s["is_random"]) is int and type(s["truncated"]) is int


def test_truncation_draws_and_tie_rule():
    """One draw per dropped token; the longer segment loses one (B on a tie), first if < 0.5."""
    # RandomState(1) draws 0.417, 0.720, ...
    a, b = [1, 2, 3], [4, 5, 6]
    assert _truncate_segments(a, b, 4, numpy.random.RandomState(1))
    # tie -> B, 0.417 < 0.5 drops B's first; then A is longer, 0.720 drops A's last.
    assert (a, b) == ([1, 2], [5, 6])
    a, b = [1, 2, 3, 7], [4, 5]
    rs = numpy.random.RandomState(1)
    assert not _truncate_segments(a, b, 6, rs) and (a, b) == ([1, 2, 3, 7], [4, 5])
    assert rs.random() == numpy.random.RandomState(1).random()  # nothing drawn when it fits


@pytest.mark.parametrize("max_ngram, longer", [(3, False), (10, False), (4, True)])
def test_weighted_n_draw_is_randomstate_choice(max_ngram, longer):
    """The N draw equals Megatron's `rs.choice(n_values, p=p)`, value and stream position."""
    values = numpy.arange(max_ngram, dtype=numpy.int64) + 1
    weights = 1.0 / values
    weights = weights / weights.sum(keepdims=True)
    if longer:
        weights = weights[::-1]
    p = weights / weights.sum(keepdims=True)
    cdf = _choice_cdf(p)
    for seed in range(300):
        ours, megatron = numpy.random.RandomState(seed), numpy.random.RandomState(seed)
        for _ in range(8):
            assert _weighted_choice(ours, values, cdf) == megatron.choice(values, p=p)
        assert ours.random() == megatron.random()


@pytest.fixture(scope="module")
def moby(tmp_path_factory):
    tok = bert_tokenizer()
    prefix = bundled_sentence_corpus(
        str(tmp_path_factory.mktemp("moby") / "moby"), tok, num_docs=80
    )
    return prefix, tok


def _document_tokens(indexed, beg, end):
    return [t for i in range(beg, end) for t in indexed[i].tolist()]


def _is_substring(part, whole):
    n = len(part)
    return n == 0 or any(whole[i : i + n] == part for i in range(len(whole) - n + 1))


@pytest.mark.parametrize("binary_head", [True, False])
def test_properties_over_many_samples(moby, tmp_path, binary_head):
    prefix, tok = moby
    seq = 64
    ds = _bert(
        prefix,
        tok,
        num_samples=300,
        sequence_length=seq,
        classification_head=binary_head,
        path_to_cache=str(tmp_path),
    )
    assert len(ds) >= 300
    indexed = IndexedDataset(prefix)
    counts = dict(mask=0, random=0, kept=0, swapped=0)
    for idx in range(len(ds)):
        s = ds[idx]
        beg, end, target = (int(v) for v in ds.sample_index[idx])
        text, types_, labels = s["text"], s["types"], s["labels"]
        loss_mask, padding_mask = s["loss_mask"], s["padding_mask"]
        n = int(padding_mask.sum())
        masked = loss_mask == 1

        assert all(
            v.shape == (seq,) and v.dtype == numpy.int64
            for v in (text, types_, labels, loss_mask, padding_mask)
        )
        # Padding: real tokens first, then pad id in text, types and padding_mask.
        assert padding_mask.tolist() == [1] * n + [tok.pad] * (seq - n)
        assert (text[n:] == tok.pad).all() and (types_[n:] == tok.pad).all()
        assert n <= target + 3 and not masked[n:].any()
        # loss_mask marks exactly the positions with a label; -1 elsewhere.
        assert ((labels != -1) == masked).all()
        # Specials in place and never masked.
        seps = numpy.flatnonzero(text[:n] == tok.sep).tolist()
        assert text[0] == tok.cls and seps[-1] == n - 1 and not masked[[0] + seps].any()
        sep_a = seps[0] if binary_head else n - 1
        assert len(seps) == (2 if binary_head else 1)
        assert types_[: sep_a + 1].tolist() == [0] * (sep_a + 1)
        assert types_[sep_a + 1 : n].tolist() == [1] * (n - sep_a - 1)
        # Budget: min(p * target, max(1, round(p * len))).
        assert masked.sum() <= min(0.15 * target, max(1, round(0.15 * n)))

        # Undo the masking: A and B are contiguous runs of the document, in order unless swapped.
        original = numpy.where(masked, labels, text)
        doc_tokens = _document_tokens(indexed, beg, end)
        seg_a = original[1:sep_a].tolist()
        seg_b = original[sep_a + 1 : n - 1].tolist()
        assert _is_substring(seg_a, doc_tokens) and _is_substring(seg_b, doc_tokens)
        assert s["truncated"] == int(len(seg_a) + len(seg_b) < len(doc_tokens))
        if binary_head:
            first, second = (seg_b, seg_a) if s["is_random"] else (seg_a, seg_b)
            assert len(first) > 0 and len(second) > 0
            if not s["truncated"]:
                assert first + second == doc_tokens
            counts["swapped"] += s["is_random"]
        else:
            assert s["is_random"] == 0 and seg_b == []
            if not s["truncated"]:
                assert seg_a == doc_tokens

        # Whole words: a masked "##" piece has its masked predecessor (unless that is a special).
        for i in numpy.flatnonzero(masked):
            piece = tok.inv_vocab[int(original[i])]
            if piece.startswith("##") and original[i - 1] not in (tok.cls, tok.sep):
                assert masked[i - 1]
            if i + 1 < n and tok.inv_vocab[int(original[i + 1])].startswith("##"):
                assert masked[i + 1]
        counts["mask"] += int((text[masked] == tok.mask).sum())
        counts["kept"] += int((text[masked] == labels[masked]).sum())
        counts["random"] += int(
            ((text[masked] != tok.mask) & (text[masked] != labels[masked])).sum()
        )

    total = counts["mask"] + counts["kept"] + counts["random"]
    assert total > 1000
    # 80 / 10 / 10 (a random id may equal the original, counted as kept: +1/V, negligible).
    assert abs(counts["mask"] / total - 0.8) < 0.04
    assert abs(counts["kept"] / total - 0.1) < 0.03
    assert abs(counts["random"] / total - 0.1) < 0.03
    if binary_head:
        assert abs(counts["swapped"] / len(ds) - 0.5) < 0.08


def test_cache_files_description_and_reuse(moby, tmp_path):
    prefix, tok = moby
    ds = _bert(prefix, tok, num_samples=50, path_to_cache=str(tmp_path / "c"))
    name = "BERTMaskedWordPieceDataset"
    assert sorted(os.listdir(tmp_path / "c")) == [
        f"{ds.unique_description_hash}-{name}-description.txt",
        f"{ds.unique_description_hash}-{name}-sample_index.npy",
    ]
    description = (
        tmp_path / "c" / f"{ds.unique_description_hash}-{name}-description.txt"
    ).read_text()
    assert description == ds.unique_description
    assert hashlib.md5(description.encode()).hexdigest() == ds.unique_description_hash
    assert list(json.loads(description)) == [
        "class",
        "dataset_path",
        "num_samples",
        "index_split",
        "random_seed",
        "sequence_length",
        "split",
        "split_matrix",
        "tokenizer",
        "masking_probability",
        "short_sequence_probability",
        "masking_max_ngram",
        "masking_do_full_word",
        "masking_do_permutation",
        "masking_use_longer_ngrams",
        "masking_use_geometric_distribution",
        "classification_head",
    ]
    assert json.loads(description)["tokenizer"] == {
        "class": "_BertWordPieceTokenizer",
        "tokenizer_path": [tok.unique_identifiers["tokenizer_path"][0]],
        "lower_case": "True",
        "vocab_extra_ids": "0",
    }
    saved = numpy.load(
        tmp_path / "c" / f"{ds.unique_description_hash}-{name}-sample_index.npy", allow_pickle=False
    )
    assert saved.dtype == numpy.uint32 and saved.shape == (len(ds), 3)
    assert ds.built_anew_on_cache_miss

    again = _bert(prefix, tok, num_samples=50, path_to_cache=str(tmp_path / "c"))
    assert not again.built_anew_on_cache_miss
    assert all(numpy.array_equal(again[i]["text"], ds[i]["text"]) for i in range(0, len(ds), 7))


def test_default_cache_location(moby, tmp_path):
    prefix, tok = moby
    local = write_sentence_dataset(
        str(tmp_path / "copy"), [[[2000, 2001], [2002, 2003], [2004]]] * 4, tok.vocab_size
    )
    ds = _bert(local, tok, num_samples=5, short_sequence_probability=0.0)
    cache = tmp_path / "copy" / "cache" / "BERTMaskedWordPieceDataset_indices"
    assert sorted(p.name.split("-", 1)[1] for p in cache.iterdir()) == [
        "BERTMaskedWordPieceDataset-description.txt",
        "BERTMaskedWordPieceDataset-sample_index.npy",
    ]
    assert len(ds) == 8  # whole epochs: 4 one-sample documents, 2 epochs to reach 5


def test_blend_and_split_through_the_builder(moby, tmp_path):
    prefix, tok = moby
    sentences = [s.tolist() for s in IndexedDataset(prefix)]
    other = write_sentence_dataset(
        str(tmp_path / "other"), [sentences[i : i + 3] for i in range(0, 90, 3)], tok.vocab_size
    )
    config = BERTMaskedWordPieceDatasetConfig(
        tokenizer=tok,
        random_seed=7,
        sequence_length=48,
        classification_head=True,
        blend=([prefix, other], [0.3, 0.7]),
        split="80,10,10",
        path_to_cache=str(tmp_path / "c"),
        **masking_args(),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        BERTMaskedWordPieceDataset, [100, 10, 10], lambda: True, config
    ).build()
    for blended in (train, valid, test):
        assert isinstance(blended, BlendedDataset) and len(blended) >= 10
        for i in range(0, len(blended), 5):
            d, j = int(blended.dataset_index[i]), int(blended.dataset_sample_index[i])
            sample = blended[i]
            assert sample["dataset_id"] == d
            assert numpy.array_equal(sample["text"], blended.datasets[d][j]["text"])
    # The train split covers the first 80 % of each prefix's documents.
    first = train.datasets[0]
    num_docs = first.dataset.document_indices.shape[0] - 1
    assert first.indices.tolist() == list(range(round(0.8 * num_docs)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(masking_probability=1.0), "--mask-prob"),
        (dict(masking_probability=0.0), "--mask-prob"),
        (dict(short_sequence_probability=1.5), "--short-seq-prob"),
        (dict(sequence_length=4), "--seq-length"),
        (dict(classification_head=None), "classification_head"),
        (dict(masking_max_ngram=None), "masking_max_ngram"),
    ],
)
def test_config_errors(moby, overrides, message):
    _, tok = moby
    fields = dict(masking_args(), random_seed=1, sequence_length=32, classification_head=True)
    fields.update(overrides)
    with pytest.raises(ValueError, match=message):
        BERTMaskedWordPieceDatasetConfig(tokenizer=tok, **fields)


def test_config_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        BERTMaskedWordPieceDatasetConfig(
            random_seed=1, sequence_length=32, classification_head=True, **masking_args()
        )


def test_document_level_data_with_the_binary_head_is_refused(tmp_path):
    """One sequence per document gives no two-segment sample: a clear error, not an endless loop."""
    tok = bert_tokenizer()
    prefix = write_sentence_dataset(
        str(tmp_path / "docs"), [[[2000 + i, 2001, 2002]] for i in range(20)], tok.vocab_size
    )
    with pytest.raises(ValueError, match="--split-sentences.*--bert-no-binary-head"):
        _bert(prefix, tok, num_samples=10, path_to_cache=str(tmp_path / "c"))
    ds = _bert(
        prefix,
        tok,
        num_samples=10,
        classification_head=False,
        short_sequence_probability=0.0,
        path_to_cache=str(tmp_path / "c"),
    )
    assert len(ds) == 20  # one whole epoch, one sample per document
    for i in range(len(ds)):
        s = ds[i]
        text = numpy.where(s["loss_mask"] == 1, s["labels"], s["text"])
        assert text[0] == tok.cls and text[4] == tok.sep and text[1] - 2000 in range(20)
        assert (s["types"] == 0).all()


def test_long_sentence_documents_are_skipped(tmp_path):
    tok = bert_tokenizer()
    long_doc = [[2000] * 600, [2001, 2002]]
    prefix = write_sentence_dataset(
        str(tmp_path / "long"), [long_doc, [[2003, 2004], [2005]]], tok.vocab_size
    )
    ds = _bert(prefix, tok, num_samples=3, path_to_cache=str(tmp_path / "c"))
    assert {tuple(r[:2]) for r in ds.sample_index.tolist()} == {(2, 4)}
    only_long = write_sentence_dataset(str(tmp_path / "only"), [long_doc], tok.vocab_size)
    with pytest.raises(ValueError, match="over 512 tokens"):
        _bert(only_long, tok, num_samples=3, path_to_cache=str(tmp_path / "c"))
