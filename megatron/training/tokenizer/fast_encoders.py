"""Compiled encoders that give the pure-Python tokenizers' ids (GPT-2 BPE, BERT WordPiece).

`GPT2Tokenizer.encode` (Megatron's algorithm, pure Python) is the reference and the fallback.
Where a compiled library is installed it encodes the same text to the same ids several times
faster:

- tiktoken, when the vocabulary is in merge order (the 256 byte tokens, then the token of merge
  i at id 256 + i, as GPT-2's is): its rank-ordered merging then picks the same pair as the
  merge-ranked loop.
- Hugging Face `tokenizers` otherwise: its BPE model applies the merges list itself.

Neither adds special tokens: `<|endoftext|>` inside text is encoded as plain text, as Megatron's
tokenizer does.

BERT WordPiece (`FullTokenizer`: basic tokenization, then greedy longest-match-first WordPiece)
is served by Hugging Face `tokenizers` with the BERT normalizer (control characters dropped,
whitespace normalised, CJK characters split, lower-casing and accent stripping for the uncased
vocabularies) and pre-tokenizer (whitespace and punctuation splits).

Set MEGATRON_TOKENIZER_BACKEND=python to force the pure-Python encoders (`tiktoken` /
`tokenizers` force one library; `auto`, the default, takes the first that loads).
"""

import os
from typing import Callable, Dict, List, Optional, Tuple

BACKENDS = ("auto", "tiktoken", "tokenizers", "python")


def requested_backend() -> str:
    """MEGATRON_TOKENIZER_BACKEND, checked against BACKENDS."""
    backend = os.environ.get("MEGATRON_TOKENIZER_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"MEGATRON_TOKENIZER_BACKEND={backend!r}: expected one of {BACKENDS}")
    return backend


def build_fast_gpt2_encode(
    encoder: Dict[str, int],
    merges: List[Tuple[str, str]],
    byte_decoder: Dict[str, int],
    pattern: str,
) -> Tuple[Optional[Callable[[str], List[int]]], str]:
    """An encode function of a compiled library, or None, and the backend's name.

    Args:
        encoder: token (GPT-2 byte-to-unicode string) -> id.
        merges: the BPE merges, best first.
        byte_decoder: unicode character -> byte (inverse of `bytes_to_unicode`).
        pattern: the pre-tokenization regex.
    """
    backend = requested_backend()
    if backend in ("auto", "tiktoken") and _in_merge_order(encoder, merges, byte_decoder):
        encode = _tiktoken_encode(encoder, len(merges), byte_decoder, pattern)
        if encode is not None:
            return encode, "tiktoken"
    if backend in ("auto", "tokenizers"):
        encode = _hf_tokenizers_encode(encoder, merges)
        if encode is not None:
            return encode, "tokenizers"
    return None, "python"


def _in_merge_order(encoder, merges, byte_decoder) -> bool:
    """Single bytes hold ids 0-255 and the token of merge i holds id 256 + i."""
    if any(encoder.get(char, 256) >= 256 for char in byte_decoder):
        return False
    return all(encoder.get(a + b) == 256 + i for i, (a, b) in enumerate(merges))


def _tiktoken_encode(encoder, num_merges, byte_decoder, pattern):
    try:
        import tiktoken
    except ImportError:
        return None
    ranks = {}
    for token, idx in encoder.items():
        if idx >= 256 + num_merges:
            continue  # e.g. <|endoftext|>: not a merge result, so BPE never produces it
        ranks[bytes(byte_decoder[char] for char in token)] = idx
    try:
        encoding = tiktoken.Encoding(
            "megatron_gpt2_bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except ValueError:
        return None
    return encoding.encode_ordinary


def _hf_tokenizers_encode(encoder, merges):
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return None
    try:
        tokenizer = Tokenizer(models.BPE(vocab=dict(encoder), merges=list(merges)))
    except Exception:  # a vocabulary the library refuses: keep the pure-Python encoder
        return None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

    def encode(text: str) -> List[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return encode


def build_fast_wordpiece_encode(
    vocab: Dict[str, int], lower_case: bool, max_input_chars_per_word: int = 100
) -> Tuple[Optional[Callable[[str], List[int]]], str]:
    """A Hugging Face `tokenizers` encode function giving FullTokenizer's ids, or None.

    Args:
        vocab: token -> id, before any tokens are appended (they never come out of WordPiece:
            the basic tokenizer splits their brackets off).
        lower_case: the uncased BERT pipeline (lower-case and strip accents).
        max_input_chars_per_word: longer words become [UNK], as in FullTokenizer.
    """
    if requested_backend() not in ("auto", "tokenizers"):
        return None, "python"
    try:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    except ImportError:
        return None, "python"
    if "[UNK]" not in vocab:
        return None, "python"
    tokenizer = Tokenizer(
        models.WordPiece(
            vocab=dict(vocab), unk_token="[UNK]", max_input_chars_per_word=max_input_chars_per_word
        )
    )
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()

    def encode(text: str) -> List[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return encode, "tokenizers"
