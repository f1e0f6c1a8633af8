"""Small sentence-level WordPiece corpora for the BERT/T5 dataset and model tests.

`write_sentence_dataset` writes documents of sentences (lists of token ids) as a `.bin/.idx` pair
in the layout `tools/preprocess_data.py --split-sentences` produces (one sequence per sentence,
document boundaries in document_indices). `bundled_sentence_corpus` tokenizes the first chapters
of the bundled Moby Dick corpus with the bundled BERT vocabulary, splitting sentences at
`. ! ?` followed by whitespace (good enough for tests; the product uses Punkt).
"""

import json
import os
import re
from typing import List, Optional

import numpy

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BERT_VOCAB = os.path.join(REPO, "data", "bert", "bert-vocab.txt")
MOBYDICK = os.path.join(REPO, "data", "corpus", "mobydick.jsonl")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def write_sentence_dataset(prefix: str, documents: List[List[List[int]]], vocab_size: int) -> str:
    """Write `documents` (document -> sentence -> ids) to `prefix.bin/.idx`; returns prefix."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for sentences in documents:
        flat = [token for sentence in sentences for token in sentence]
        builder.add_document(numpy.array(flat, dtype=numpy.int64), [len(s) for s in sentences])
    builder.finalize(prefix + ".idx")
    return prefix


# Toy WordPiece vocabulary: ids 0-15 in file order; the tokenizer appends [BOS] = 16, [EOS] = 17
# (then <extra_id_i> sentinels).
TOY_VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "the",
    "whale",
    "ship",
    "sea",
    "cap",
    "##tain",
    "ahab",
    "##s",
    "white",
    "sails",
    "on",
]
# doc 0: "the white whale" / "cap ##tain ahab" / "sails on the sea"
# doc 1: "the ship" / "ahab ##s sails"
TOY_DOCS = [[[5, 13, 6], [9, 10, 11], [14, 15, 5, 8]], [[5, 7], [11, 12, 14]]]


def toy_corpus(tmp_path, vocab_extra_ids: int = 0):
    """The toy corpus as `tmp_path/toy.bin/.idx` and its tokenizer: (prefix, tokenizer)."""
    from megatron.training.tokenizer.tokenizer import _BertWordPieceTokenizer

    vocab = os.path.join(str(tmp_path), "toy-vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(TOY_VOCAB) + "\n")
    prefix = write_sentence_dataset(os.path.join(str(tmp_path), "toy"), TOY_DOCS, len(TOY_VOCAB))
    return prefix, _BertWordPieceTokenizer(vocab, lower_case=True, vocab_extra_ids=vocab_extra_ids)


def bert_tokenizer(vocab_extra_ids: int = 0, vocab_file: str = BERT_VOCAB):
    """The bundled uncased BERT WordPiece tokenizer (`--tokenizer-type BertWordPieceLowerCase`)."""
    from megatron.training.tokenizer.tokenizer import _BertWordPieceTokenizer

    return _BertWordPieceTokenizer(vocab_file, lower_case=True, vocab_extra_ids=vocab_extra_ids)


def bundled_sentence_corpus(
    prefix: str, tokenizer, num_docs: int = 40, max_sentences: Optional[int] = 12
) -> str:
    """Sentence-split, tokenized paragraphs of the bundled Moby Dick text as `prefix.bin/.idx`.

    Each non-empty paragraph (blank-line separated) of the first chapters is one document, capped
    at `max_sentences` sentences, so documents have 1..max_sentences sentences of varied lengths.
    """
    documents = []
    with open(MOBYDICK, encoding="utf-8") as f:
        for line in f:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                paragraph = " ".join(paragraph.split())
                if len(paragraph) < 20:
                    continue
                sentences = [s for s in _SENTENCE_END.split(paragraph) if s]
                ids = [tokenizer.tokenize(s) for s in sentences[:max_sentences]]
                ids = [s for s in ids if s]
                if ids:
                    documents.append(ids)
                if len(documents) == num_docs:
                    return write_sentence_dataset(prefix, documents, tokenizer.vocab_size)
    return write_sentence_dataset(prefix, documents, tokenizer.vocab_size)


def masking_args(**overrides) -> dict:
    """The BERT/T5 masking fields pretrain_bert.py / pretrain_t5.py use, as keyword arguments."""
    fields = dict(
        masking_probability=0.15,
        short_sequence_probability=0.1,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
    )
    fields.update(overrides)
    return fields
