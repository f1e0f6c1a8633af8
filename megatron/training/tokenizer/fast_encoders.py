"""Compiled encoders that give the same ids as the pure-Python GPT-2 BPE and BERT WordPiece.

`tools/preprocess_data.py` spends nearly all its time in `tokenize`. Two well-kept libraries run
the same algorithms in Rust:

- GPT-2 byte-level BPE: `tiktoken` (`encode_ordinary`, so `<|endoftext|>` in the text is encoded
  as plain text, as the Python tokenizer does). tiktoken merges by the rank of the merged token,
  GPT-2 by the rank of the merge; both agree when every merge `a b` yields token id
  `256 + merge index` and the 256 single bytes hold ids 0-255, which holds for the GPT-2 files.
  The vocabulary and merges are checked for exactly that; any other pair of files keeps the
  Python tokenizer.
- BERT WordPiece: Hugging Face `tokenizers` (`BertNormalizer` + `BertPreTokenizer` + `WordPiece`,
  no special tokens added), with the same lower-casing/accent stripping, Chinese-character
  splitting, `[UNK]` and 100-character word limit as the Python tokenizer.

Either library missing (or `MEGATRON_PURE_PYTHON_TOKENIZERS=1` in the environment, which the
preprocessing benchmark uses for its reference) leaves the pure-Python tokenizers in charge.
"""

import os
from typing import Callable, Dict, List, Optional

from .gpt2_tokenization import GPT2_PRETOKENIZE_PATTERN, bytes_to_unicode

#: Environment variable that turns the compiled encoders off (any value but "", "0").
PURE_PYTHON_ENV = "MEGATRON_PURE_PYTHON_TOKENIZERS"


def fast_encoders_disabled() -> bool:
    """True when the environment asks for the pure-Python tokenizers."""
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def gpt2_fast_encoder(
    encoder: Dict[str, int], merges: List[tuple]
) -> Optional[Callable[[str], List[int]]]:
    """A tiktoken `encode_ordinary` giving GPT-2 BPE ids for `encoder`/`merges`, or None.

    None when tiktoken is not installed, disabled by the environment, or the files do not have
    the layout under which tiktoken's merge order equals the BPE merge order (see module doc).
    """
    if fast_encoders_disabled():
        return None
    try:
        import tiktoken
    except ImportError:
        return None
    byte_encoder = bytes_to_unicode()
    byte_decoder = {v: k for k, v in byte_encoder.items()}
    ranks = {}
    # Single bytes first, in GPT-2's printable order, as tiktoken builds GPT-2's own ranks.
    for b, ch in sorted(byte_encoder.items(), key=lambda kv: ord(kv[1])):
        ranks[bytes([b])] = len(ranks)
    for first, second in merges:
        try:
            merged = bytes(byte_decoder[c] for c in first + second)
        except KeyError:
            return None
        if merged in ranks:
            return None  # the same token from two merges: rank order would not be merge order
        ranks[merged] = len(ranks)
    for token, rank in ranks.items():
        if encoder.get("".join(byte_encoder[b] for b in token)) != rank:
            return None
    if len(encoder) != len(ranks) + sum(
        1 for t in encoder if t.startswith("<|") and t.endswith("|>")
    ):
        return None
    enc = tiktoken.Encoding(
        name="megatron-gpt2-bpe",
        pat_str=GPT2_PRETOKENIZE_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={},
    )
    return enc.encode_ordinary


def wordpiece_fast_encoder(
    vocab: Dict[str, int],
    lower_case: bool,
    unk_token: str = "[UNK]",
    max_input_chars_per_word: int = 100,
) -> Optional[Callable[[str], List[int]]]:
    """A Hugging Face `tokenizers` WordPiece giving BERT ids for `vocab`, or None.

    None when `tokenizers` is not installed, disabled by the environment, or the vocabulary has no
    `unk_token`.
    """
    if fast_encoders_disabled() or unk_token not in vocab:
        return None
    try:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    except ImportError:
        return None
    model = models.WordPiece(
        vocab=dict(vocab), unk_token=unk_token, max_input_chars_per_word=max_input_chars_per_word
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()

    def encode(text: str) -> List[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return encode
