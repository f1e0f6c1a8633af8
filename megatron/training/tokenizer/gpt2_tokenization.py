"""GPT-2 byte-level BPE (vocab JSON + merges file), written from the published algorithm.

Text is split with GPT-2's regex (the `regex` package, for `\\p{L}`/`\\p{N}`), every piece's UTF-8
bytes are mapped to printable characters, and BPE merges are applied by rank. Results of `bpe()`
are kept in an LRU cache, which makes natural text several times faster.
"""

import json
import os
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import regex as re

from .fast_encoders import build_fast_gpt2_encode

GPT2_PRETOKENIZE_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

# Megatron's names for where GPT-2's files were published (library users and Megatron's data
# tests fetch them themselves; this package never downloads at run time).
PRETRAINED_VOCAB_ARCHIVE_MAP = {
    'gpt2': 'https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-vocab.json',
}
PRETRAINED_MERGES_ARCHIVE_MAP = {
    'gpt2': 'https://s3.amazonaws.com/models.huggingface.co/bert/gpt2-merges.txt',
}
PRETRAINED_VOCAB_POSITIONAL_EMBEDDINGS_SIZE_MAP = {'gpt2': 1024}
VOCAB_NAME = 'vocab.json'
MERGES_NAME = 'merges.txt'
SPECIAL_TOKENS_NAME = 'special_tokens.txt'


@lru_cache()
def bytes_to_unicode() -> Dict[int, str]:
    """The reversible map byte -> printable unicode character GPT-2 uses.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to code points 256.. in order.
    """
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def get_pairs(word: Tuple[str, ...]) -> set:
    """Set of adjacent symbol pairs in a word."""
    return set(zip(word[:-1], word[1:]))


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag} {path} is not a UTF-8 text file ({exc})") from None


def load_vocab_json(vocab_file: str) -> dict:
    """The GPT-2 vocabulary (`--vocab-file`): a JSON object token -> id, parsed as data.

    Raises:
        ValueError: naming the file, when it is not such a JSON object.
    """
    text = _read_text(vocab_file, "--vocab-file")
    try:
        encoder = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = (
            " (it looks like a BPE merges file: swapped --vocab-file and --merge-file?)"
            if (text.startswith("#version"))
            else ""
        )
        raise ValueError(
            f"--vocab-file {vocab_file} is not a JSON vocabulary: {exc}{hint}"
        ) from None
    if (
        not isinstance(encoder, dict)
        or not encoder
        or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in encoder.items()
        )
    ):
        raise ValueError(
            f"--vocab-file {vocab_file} is not a GPT-2 vocabulary:"
            " expected a non-empty JSON object "
            f"mapping tokens to integer ids"
        )
    return encoder


def load_merges(merges_file: str) -> List[Tuple[str, str]]:
    """The BPE merges (`--merge-file`): an optional `#version` line, then `a b` per line.

    Raises:
        ValueError: naming the file and the first bad line (e.g. a JSON vocabulary passed here).
    """
    text = _read_text(merges_file, "--merge-file")
    if text.lstrip().startswith("{"):
        raise ValueError(
            f"--merge-file {merges_file} is a JSON file, not a BPE merges file (swapped "
            f"--vocab-file and --merge-file?)"
        )
    lines = text.split("\n")
    start = 1 if lines and lines[0].startswith("#version") else 0
    merges = []
    for number, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            continue
        pair = tuple(line.split())
        if len(pair) != 2:
            raise ValueError(
                f"--merge-file {merges_file} line {number}: expected a BPE merge (two symbols "
                f"separated by a space), found {line[:60]!r}"
            )
        merges.append(pair)
    if not merges:
        raise ValueError(f"--merge-file {merges_file} holds no BPE merges")
    return merges


class GPT2Tokenizer(object):
    """GPT-2 byte-level BPE tokenizer.

    Args:
        vocab_file: JSON token -> id.
        merges_file: `#version` line then one merge `a b` per line, best first.
        errors: how `decode` handles invalid UTF-8 ('replace' as in GPT-2).
        special_tokens: extra tokens appended after the vocabulary.
        max_len: unused limit kept for API compatibility.
        cache_size: entries of the LRU cache on `bpe()`.
    """

    def __init__(
        self,
        vocab_file: str,
        merges_file: str,
        errors: str = "replace",
        special_tokens: Optional[List[str]] = None,
        max_len: Optional[int] = None,
        cache_size: int = 1 << 16,
    ):
        self.max_len = max_len if max_len is not None else int(1e12)
        self.encoder = load_vocab_json(vocab_file)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.errors = errors
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        bpe_merges = load_merges(merges_file)
        self.bpe_ranks = dict(zip(bpe_merges, range(len(bpe_merges))))
        self.pat = re.compile(GPT2_PRETOKENIZE_PATTERN)
        self.special_tokens = {}
        self.special_tokens_decoder = {}
        self.set_special_tokens(special_tokens)
        self._cache_size = cache_size
        self._build_encoders(bpe_merges)

    def _build_encoders(self, bpe_merges) -> None:
        """The memoised `bpe` and, if a compiled library is installed (tiktoken / tokenizers), its
        encoder giving the same ids."""
        self.bpe = lru_cache(maxsize=self._cache_size)(self._bpe)
        self._fast_encode, self.encode_backend = build_fast_gpt2_encode(
            self.encoder, bpe_merges, self.byte_decoder, GPT2_PRETOKENIZE_PATTERN
        )

    def __getstate__(self) -> dict:
        # The lru_cache wrapper and a compiled encoder do not pickle (a DataLoader worker started
        # by spawn or forkserver receives the tokenizer pickled): they are rebuilt on unpickling.
        state = dict(self.__dict__)
        for name in ('bpe', '_fast_encode', 'encode_backend'):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._build_encoders(sorted(self.bpe_ranks, key=self.bpe_ranks.get))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, cache_dir=None, *inputs, **kwargs):
        """A tokenizer from a local directory holding vocab.json and merges.txt (and optionally
        special_tokens.txt, one token per line).

        A name of PRETRAINED_VOCAB_ARCHIVE_MAP is refused: its files would be downloaded, and
        nothing is fetched at run time here (download them and pass their directory).
        """
        path = pretrained_model_name_or_path
        if not os.path.isdir(path):
            if path in PRETRAINED_VOCAB_ARCHIVE_MAP:
                raise ValueError(
                    f'{path!r} names files to download ({PRETRAINED_VOCAB_ARCHIVE_MAP[path]}, '
                    f'{PRETRAINED_MERGES_ARCHIVE_MAP[path]}); nothing is downloaded here: fetch '
                    f'them and pass their directory'
                )
            raise ValueError(f'{path!r} is not a directory holding {VOCAB_NAME} and {MERGES_NAME}')
        special_file = os.path.join(path, SPECIAL_TOKENS_NAME)
        if 'special_tokens' not in kwargs and os.path.exists(special_file):
            with open(special_file, encoding='utf-8') as f:
                kwargs['special_tokens'] = f.read().split('\n')[:-1]
        if path in PRETRAINED_VOCAB_POSITIONAL_EMBEDDINGS_SIZE_MAP:
            max_len = PRETRAINED_VOCAB_POSITIONAL_EMBEDDINGS_SIZE_MAP[path]
            kwargs['max_len'] = min(kwargs.get('max_len', int(1e12)), max_len)
        return cls(
            os.path.join(path, VOCAB_NAME), os.path.join(path, MERGES_NAME), *inputs, **kwargs
        )

    def __len__(self) -> int:
        return len(self.encoder) + len(self.special_tokens)

    def set_special_tokens(self, special_tokens: Optional[List[str]]) -> None:
        """Add special tokens numbered after the vocabulary."""
        if not special_tokens:
            self.special_tokens = {}
            self.special_tokens_decoder = {}
            return
        self.special_tokens = dict(
            (tok, len(self.encoder) + i) for i, tok in enumerate(special_tokens)
        )
        self.special_tokens_decoder = {v: k for k, v in self.special_tokens.items()}

    def _bpe(self, token: str) -> str:
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new_word.extend(word[i:])
                    break
                new_word.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        return " ".join(word)

    def tokenize(self, text: str) -> List[str]:
        """Text -> BPE token strings."""
        bpe_tokens = []
        for token in re.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            bpe_tokens.extend(self.bpe(token).split(" "))
        return bpe_tokens

    def convert_tokens_to_ids(self, tokens: List[str]) -> List[int]:
        """Token strings -> ids (special tokens first)."""
        ids = []
        for token in tokens:
            if token in self.special_tokens:
                ids.append(self.special_tokens[token])
            else:
                ids.append(self.encoder[token])
        return ids

    def convert_ids_to_tokens(self, ids: List[int], skip_special_tokens: bool = False) -> List[str]:
        """Ids -> token strings."""
        tokens = []
        for i in ids:
            if i in self.special_tokens_decoder:
                if not skip_special_tokens:
                    tokens.append(self.special_tokens_decoder[i])
            else:
                tokens.append(self.decoder[i])
        return tokens

    def encode(self, text: str) -> List[int]:
        """Text -> ids."""
        if self._fast_encode is not None:
            return self._fast_encode(text)
        return self.encode_python(text)

    def encode_python(self, text: str) -> List[int]:
        """Text -> ids with the pure-Python BPE loop (the reference the fast encoders match)."""
        encoder = self.encoder
        ids = []
        for token in re.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(encoder[t] for t in self.bpe(token).split(" "))
        return ids

    def decode(self, tokens: List[int]) -> str:
        """Ids -> text (invalid UTF-8 handled by `errors`)."""
        text = "".join(self.decoder[int(token)] for token in tokens)
        return bytearray([self.byte_decoder[c] for c in text]).decode("utf-8", errors=self.errors)
