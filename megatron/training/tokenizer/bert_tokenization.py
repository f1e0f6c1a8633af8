"""BERT WordPiece tokenization (basic splitting + greedy longest-match WordPiece).

Written from the published BERT algorithm: clean the text (drop NUL/U+FFFD/control characters,
normalise whitespace), put spaces around CJK ideographs, optionally lower-case and strip accents
(NFD, drop combining marks), split on punctuation, then split each word into the longest vocabulary
pieces from the left, continuation pieces prefixed with `##`; a word that cannot be split, or is
longer than 100 characters, becomes `[UNK]`.
"""

import collections
import unicodedata
from functools import lru_cache
from typing import Dict, List


def load_vocab(vocab_file: str) -> "collections.OrderedDict[str, int]":
    """One token per line -> ordered dict token -> line number.

    Raises:
        ValueError: naming the file, when it is not UTF-8 text or is a JSON (GPT-2) vocabulary.
    """
    vocab = collections.OrderedDict()
    try:
        with open(vocab_file, "r", encoding="utf-8") as reader:
            for index, line in enumerate(reader):
                token = line.rstrip("\n")
                if token.endswith("\r"):
                    token = token[:-1]
                if index == 0 and token.startswith("{"):
                    raise ValueError(
                        f"--vocab-file {vocab_file} is a JSON file, not a WordPiece vocabulary "
                        f"(one token per line)"
                    )
                vocab[token] = index
    except UnicodeDecodeError as exc:
        raise ValueError(f"--vocab-file {vocab_file} is not a UTF-8 text file ({exc})") from None
    return vocab


def whitespace_tokenize(text: str) -> List[str]:
    """Strip and split on whitespace."""
    text = text.strip()
    if not text:
        return []
    return text.split()


def _is_whitespace(char: str) -> bool:
    if char in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    if char in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(char) in ("Cc", "Cf")


def _is_punctuation(char: str) -> bool:
    cp = ord(char)
    if (33 <= cp <= 47) or (58 <= cp <= 64) or (91 <= cp <= 96) or (123 <= cp <= 126):
        return True
    return unicodedata.category(char).startswith("P")


def _is_chinese_char(cp: int) -> bool:
    return (
        (0x4E00 <= cp <= 0x9FFF)
        or (0x3400 <= cp <= 0x4DBF)
        or (0x20000 <= cp <= 0x2A6DF)
        or (0x2A700 <= cp <= 0x2B73F)
        or (0x2B740 <= cp <= 0x2B81F)
        or (0x2B820 <= cp <= 0x2CEAF)
        or (0xF900 <= cp <= 0xFAFF)
        or (0x2F800 <= cp <= 0x2FA1F)
    )


class BasicTokenizer(object):
    """Whitespace/punctuation splitting with optional lower-casing and accent stripping."""

    def __init__(self, do_lower_case: bool = True):
        self.do_lower_case = do_lower_case

    def tokenize(self, text: str) -> List[str]:
        """Text -> words and punctuation marks."""
        text = self._clean_text(text)
        text = self._tokenize_chinese_chars(text)
        split_tokens = []
        for token in whitespace_tokenize(text):
            if self.do_lower_case:
                token = token.lower()
                token = self._run_strip_accents(token)
            split_tokens.extend(self._run_split_on_punc(token))
        return whitespace_tokenize(" ".join(split_tokens))

    @staticmethod
    def _run_strip_accents(text: str) -> str:
        text = unicodedata.normalize("NFD", text)
        return "".join(c for c in text if unicodedata.category(c) != "Mn")

    @staticmethod
    def _run_split_on_punc(text: str) -> List[str]:
        output = []
        start_new_word = True
        for char in text:
            if _is_punctuation(char):
                output.append([char])
                start_new_word = True
            else:
                if start_new_word:
                    output.append([])
                start_new_word = False
                output[-1].append(char)
        return ["".join(x) for x in output]

    @staticmethod
    def _tokenize_chinese_chars(text: str) -> str:
        output = []
        for char in text:
            if _is_chinese_char(ord(char)):
                output.extend((" ", char, " "))
            else:
                output.append(char)
        return "".join(output)

    @staticmethod
    def _clean_text(text: str) -> str:
        output = []
        for char in text:
            cp = ord(char)
            if cp == 0 or cp == 0xFFFD or _is_control(char):
                continue
            output.append(" " if _is_whitespace(char) else char)
        return "".join(output)


class WordpieceTokenizer(object):
    """Greedy longest-match-first WordPiece."""

    def __init__(
        self, vocab: Dict[str, int], unk_token: str = "[UNK]", max_input_chars_per_word: int = 100
    ):
        self.vocab = vocab
        self.unk_token = unk_token
        self.max_input_chars_per_word = max_input_chars_per_word
        self._word = lru_cache(maxsize=1 << 16)(self._tokenize_word)

    def _tokenize_word(self, token: str) -> tuple:
        chars = list(token)
        if len(chars) > self.max_input_chars_per_word:
            return (self.unk_token,)
        sub_tokens = []
        start = 0
        while start < len(chars):
            end = len(chars)
            cur_substr = None
            while start < end:
                substr = "".join(chars[start:end])
                if start > 0:
                    substr = "##" + substr
                if substr in self.vocab:
                    cur_substr = substr
                    break
                end -= 1
            if cur_substr is None:
                return (self.unk_token,)
            sub_tokens.append(cur_substr)
            start = end
        return tuple(sub_tokens)

    def tokenize(self, text: str) -> List[str]:
        """Whitespace-separated words -> WordPiece tokens."""
        output_tokens = []
        for token in whitespace_tokenize(text):
            output_tokens.extend(self._word(token))
        return output_tokens


class FullTokenizer(object):
    """Basic + WordPiece tokenization over a vocabulary file."""

    def __init__(self, vocab_file: str, do_lower_case: bool = True):
        self.vocab = load_vocab(vocab_file)
        self.inv_vocab = {v: k for k, v in self.vocab.items()}
        self.do_lower_case = do_lower_case
        self.basic_tokenizer = BasicTokenizer(do_lower_case=do_lower_case)
        self.wordpiece_tokenizer = WordpieceTokenizer(vocab=self.vocab)

    def tokenize(self, text: str) -> List[str]:
        """Text -> WordPiece tokens."""
        split_tokens = []
        for token in self.basic_tokenizer.tokenize(text):
            split_tokens.extend(self.wordpiece_tokenizer._word(token))
        return split_tokens

    def convert_tokens_to_ids(self, tokens: List[str]) -> List[int]:
        """Tokens -> ids."""
        return [self.vocab[t] for t in tokens]

    def convert_ids_to_tokens(self, ids: List[int]) -> List[str]:
        """Ids -> tokens."""
        return [self.inv_vocab[i] for i in ids]

    @staticmethod
    def convert_tokens_to_string(
        tokens: List[str], clean_up_tokenization_spaces: bool = True
    ) -> str:
        """Join WordPiece tokens into text (`##` pieces glued to the previous one)."""
        out_string = " ".join(tokens).replace(" ##", "").strip()
        if clean_up_tokenization_spaces:
            for a, b in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" do not", " don't"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                out_string = out_string.replace(a, b)
        return out_string

    def vocab_size(self) -> int:
        """Entries in the vocabulary."""
        return len(self.vocab)
