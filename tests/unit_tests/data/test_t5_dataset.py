"""T5MaskedWordPieceDataset: a hand-checked toy sample, properties over many samples of real text,
and the config / sentinel / decoder-length errors.

Sample-for-sample equality with Megatron's own implementation is in test_masked_golden.py.
"""

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.t5_dataset import (
    T5MaskedWordPieceDataset,
    T5MaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.utils import Split
from tests.unit_tests.data.sentence_corpus import (
    bert_tokenizer,
    bundled_sentence_corpus,
    masking_args,
    toy_corpus,
)

T5_MASKING = masking_args(masking_max_ngram=10, masking_use_geometric_distribution=True)


def _t5(prefix, tokenizer, num_samples=None, **overrides):
    fields = dict(T5_MASKING, random_seed=1234, sequence_length=64, sequence_length_decoder=32)
    fields.update(overrides)
    config = T5MaskedWordPieceDatasetConfig(tokenizer=tokenizer, **fields)
    indexed = IndexedDataset(prefix)
    documents = numpy.arange(indexed.document_indices.shape[0] - 1)
    return T5MaskedWordPieceDataset(indexed, prefix, documents, num_samples, Split.train, config)


def _masks_from_lengths(n_enc, n_dec, s_enc, s_dec):
    enc = numpy.arange(s_enc) < n_enc
    dec = numpy.arange(s_dec) < n_dec
    causal = numpy.tril(numpy.ones((s_dec, s_dec), dtype=bool))
    return (
        numpy.outer(enc, enc).astype(numpy.int64),
        (numpy.outer(dec, dec) & causal).astype(numpy.int64),
        numpy.outer(dec, enc).astype(numpy.int64),
    )


def test_hand_checked_toy_samples(tmp_path):
    """Two samples worked out by hand from their draws (T5 draws nothing but the masking).

    Toy vocabulary of sentence_corpus.toy_corpus with 3 sentinels: [BOS] 16, [EOS] 17,
    <extra_id_0..2> = 18, 19, 20. Config: encoder 11 (target 9 = 11 - 2), decoder 10, mask prob
    0.45, no short sequences, seed 25, geometric spans up to 10 whole words.
    """
    prefix, tok = toy_corpus(tmp_path, vocab_extra_ids=3)
    assert tok.additional_special_tokens_ids == [18, 19, 20] and (tok.bos, tok.eos) == (16, 17)
    ds = _t5(
        prefix,
        tok,
        sequence_length=11,
        sequence_length_decoder=10,
        random_seed=25,
        masking_probability=0.45,
        short_sequence_probability=0.0,
        path_to_cache=str(tmp_path / "cache"),
    )
    assert ds.sample_index.tolist() == [[3, 5, 9], [0, 3, 9]]

    # Sample 1 = doc 0 (10 tokens) keeps the first 9: "the white whale cap ##tain ahab sails on the"
    # (truncated). Candidates [0] [1] [2] [3, 4] [5] [6] [7] [8]; budget min(0.45 * 9,
    # max(1, round(9 * 0.45))) = 4. RandomState(26): shuffle -> [3,4] [8] [5] [2] [1] [0] [7] [6];
    # [3,4]: geometric = 1 -> "cap ##tain" (2); [8]: geometric = 2 -> the 2-gram from the last word
    # is just [8] (1, total 3); [5]: geometric = 7 -> 4 positions, backed off to N = 1 -> [5]
    # (total 4); then the budget is spent. Spans by position: [3, 4] [5] [8] -> sentinels 18 19 20.
    s = ds[1]
    assert s["text_enc"].tolist() == [5, 13, 6, 18, 19, 14, 15, 20, 0, 0, 0]
    assert s["text_dec"].tolist() == [16, 18, 9, 10, 19, 11, 20, 5, 0, 0]
    assert s["labels"].tolist() == [18, 9, 10, 19, 11, 20, 5, 17, -1, -1]
    assert s["loss_mask"].tolist() == [1] * 8 + [0, 0]
    assert s["truncated"] == 1
    for key, expected in zip(
        ("enc_mask", "dec_mask", "enc_dec_mask"), _masks_from_lengths(8, 8, 11, 10)
    ):
        assert s[key].dtype == numpy.int64 and numpy.array_equal(s[key], expected), key

    # Sample 0 = doc 1 "the ship ahab ##s sails" (5 tokens, not truncated): candidates [0] [1]
    # [2, 3] [4]; budget min(4.05, max(1, round(5 * 0.45))) = 2. RandomState(25): shuffle ->
    # [1] [4] [2,3] [0]; [1]: geometric = 3 -> 4 positions, N = 2 -> 3, N = 1 -> [1] fits;
    # [4]: geometric = 1 -> [4] fits (total 2); budget spent.
    s = ds[0]
    assert s["text_enc"].tolist() == [5, 18, 11, 12, 19] + [0] * 6
    assert s["text_dec"].tolist() == [16, 18, 7, 19, 14] + [0] * 5
    assert s["labels"].tolist() == [18, 7, 19, 14, 17] + [-1] * 5
    assert s["loss_mask"].tolist() == [1] * 5 + [0] * 5
    assert s["truncated"] == 0
    for key, expected in zip(
        ("enc_mask", "dec_mask", "enc_dec_mask"), _masks_from_lengths(5, 5, 11, 10)
    ):
        assert numpy.array_equal(s[key], expected), key


@pytest.fixture(scope="module")
def moby(tmp_path_factory):
    tok = bert_tokenizer(vocab_extra_ids=100)
    prefix = bundled_sentence_corpus(
        str(tmp_path_factory.mktemp("moby") / "moby"), tok, num_docs=80
    )
    return prefix, tok


def test_properties_over_many_samples(moby, tmp_path):
    prefix, tok = moby
    s_enc, s_dec = 64, 40
    ds = _t5(
        prefix,
        tok,
        num_samples=300,
        sequence_length=s_enc,
        sequence_length_decoder=s_dec,
        path_to_cache=str(tmp_path),
    )
    assert len(ds) >= 300
    indexed = IndexedDataset(prefix)
    sentinels = tok.additional_special_tokens_ids
    span_lengths = []
    for idx in range(len(ds)):
        s = ds[idx]
        beg, end, target = (int(v) for v in ds.sample_index[idx])
        enc, dec, labels, loss_mask = s["text_enc"], s["text_dec"], s["labels"], s["loss_mask"]
        assert enc.shape == (s_enc,) and dec.shape == (s_dec,) and labels.shape == (s_dec,)
        n_enc, n_dec = int((enc != tok.pad).sum()), int(loss_mask.sum())
        # Padding, lengths, loss mask.
        assert (enc[n_enc:] == tok.pad).all() and (dec[n_dec:] == tok.pad).all()
        assert (labels[n_dec:] == -1).all() and loss_mask.tolist() == [1] * n_dec + [0] * (
            s_dec - n_dec
        )
        # [BOS] starts the decoder, [EOS] ends the labels, labels = decoder input shifted left.
        assert dec[0] == tok.bos and labels[n_dec - 1] == tok.eos
        assert labels[: n_dec - 1].tolist() == dec[1:n_dec].tolist()
        assert tok.bos not in enc and tok.eos not in enc and tok.eos not in dec
        # Sentinels <extra_id_0>, <extra_id_1>, ... in order, once each in encoder, decoder, labels.
        enc_s = [t for t in enc[:n_enc].tolist() if t in sentinels]
        assert enc_s == sentinels[: len(enc_s)]
        assert [t for t in dec[:n_dec].tolist() if t in sentinels] == enc_s
        assert [t for t in labels[:n_dec].tolist() if t in sentinels] == enc_s
        # Putting the spans back gives the first `target` tokens of the sample's sentences.
        spans, current = {}, None
        for t in dec[1:n_dec].tolist():
            if t in sentinels:
                current = t
                spans[current] = []
            else:
                spans[current].append(t)
        restored = [u for t in enc[:n_enc].tolist() for u in (spans[t] if t in sentinels else [t])]
        doc_tokens = [t for i in range(beg, end) for t in indexed[i].tolist()]
        assert restored == doc_tokens[:target]
        assert s["truncated"] == int(len(doc_tokens) > target)
        assert sum(len(v) for v in spans.values()) <= min(
            0.15 * target, max(1, round(0.15 * target))
        )
        span_lengths += [len(v) for v in spans.values()]
        # Masks agree with padding (1 = attend), the decoder's also causal.
        for key, expected in zip(
            ("enc_mask", "dec_mask", "enc_dec_mask"),
            _masks_from_lengths(n_enc, n_dec, s_enc, s_dec),
        ):
            assert numpy.array_equal(s[key], expected), key
    # Geometric(0.2) spans of whole words, clipped at 10 words, then fitted to the budget.
    assert max(span_lengths) > 1 and min(span_lengths) >= 1


def test_errors(moby, tmp_path):
    prefix, tok = moby
    fields = dict(T5_MASKING, random_seed=1, sequence_length=64)
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        T5MaskedWordPieceDatasetConfig(
            tokenizer=bert_tokenizer(), sequence_length_decoder=32, **fields
        )
    with pytest.raises(ValueError, match="--decoder-seq-length"):
        T5MaskedWordPieceDatasetConfig(tokenizer=tok, **fields)
    with pytest.raises(ValueError, match="--encoder-seq-length"):
        T5MaskedWordPieceDatasetConfig(
            tokenizer=tok, **dict(fields, sequence_length=3), sequence_length_decoder=8
        )
    # A decoder too short for [BOS] + sentinels + masked tokens is named with its numbers.
    short = _t5(
        prefix,
        tok,
        num_samples=20,
        sequence_length=128,
        sequence_length_decoder=4,
        path_to_cache=str(tmp_path),
    )
    with pytest.raises(ValueError, match="--decoder-seq-length is 4"):
        for i in range(len(short)):
            short[i]
    # Fewer sentinels than spans: IndexError (as Megatron) naming the flag.
    few = bert_tokenizer(vocab_extra_ids=1)
    ds = _t5(
        prefix,
        few,
        num_samples=20,
        sequence_length=128,
        sequence_length_decoder=64,
        path_to_cache=str(tmp_path),
    )
    with pytest.raises(IndexError, match="--vocab-extra-ids"):
        for i in range(len(ds)):
            ds[i]
