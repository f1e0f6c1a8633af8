"""Megatron tokenizers and `build_tokenizer(args)`.

`--tokenizer-type` picks one of: BertWordPieceLowerCase, BertWordPieceCase, GPT2BPETokenizer,
SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer,
SFTTokenizer (a HuggingFaceTokenizer with a chat prompt format, `sft_tokenizer.py`),
NullTokenizer. `build_tokenizer` also sets `args.padded_vocab_size` (vocabulary rounded up to a
multiple of make_vocab_size_divisible_by x tensor_model_parallel_size) and prints it as Megatron
does.
"""

import math
import os
from itertools import accumulate
from typing import List, Optional

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer

from .bert_tokenization import FullTokenizer as FullBertTokenizer
from .fast_encoders import build_fast_wordpiece_encode
from .gpt2_tokenization import GPT2Tokenizer
from .hf_tokenizer import _HuggingFaceTokenizer  # noqa: F401  (re-exported: its old home)

TOKENIZER_TYPES = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "SFTTokenizer",
    "NullTokenizer",
)


def _require_file(flag: str, path: Optional[str], tokenizer_type: str) -> None:
    if path is None:
        raise ValueError(f"{flag} is required for --tokenizer-type {tokenizer_type}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no such file: {path}")


def build_tokenizer(args, **kwargs) -> MegatronTokenizer:
    """Build the tokenizer named by `args.tokenizer_type` and set `args.padded_vocab_size`.

    Reads args.tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_extra_ids, vocab_size,
    make_vocab_size_divisible_by, tensor_model_parallel_size, rank.

    Raises:
        ValueError: unknown tokenizer type or a required flag missing.
        FileNotFoundError: a vocab/merge/model file that does not exist.
    """
    rank = getattr(args, "rank", 0)
    tokenizer_type = args.tokenizer_type
    if rank == 0:
        print("> building {} tokenizer ...".format(tokenizer_type), flush=True)
    vocab_extra_ids = getattr(args, "vocab_extra_ids", 0) or 0

    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        _require_file("--vocab-file", args.vocab_file, tokenizer_type)
        tokenizer = _BertWordPieceTokenizer(
            vocab_file=args.vocab_file,
            lower_case=tokenizer_type == "BertWordPieceLowerCase",
            vocab_extra_ids=vocab_extra_ids,
        )
    elif tokenizer_type == "GPT2BPETokenizer":
        _require_file("--vocab-file", args.vocab_file, tokenizer_type)
        _require_file("--merge-file", args.merge_file, tokenizer_type)
        tokenizer = _GPT2BPETokenizer(args.vocab_file, args.merge_file)
    elif tokenizer_type == "SentencePieceTokenizer":
        _require_file("--tokenizer-model", args.tokenizer_model, tokenizer_type)
        tokenizer = _SentencePieceTokenizer(args.tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    elif tokenizer_type == "GPTSentencePieceTokenizer":
        _require_file("--tokenizer-model", args.tokenizer_model, tokenizer_type)
        tokenizer = _GPTSentencePieceTokenizer(args.tokenizer_model)
    elif tokenizer_type == "Llama2Tokenizer":
        _require_file("--tokenizer-model", args.tokenizer_model, tokenizer_type)
        tokenizer = _Llama2Tokenizer(args.tokenizer_model)
    elif tokenizer_type == "HuggingFaceTokenizer":
        if args.tokenizer_model is None:
            raise ValueError(
                "--tokenizer-model is required for --tokenizer-type HuggingFaceTokenizer"
            )
        tokenizer = _HuggingFaceTokenizer(args.tokenizer_model, **kwargs)
    elif tokenizer_type == "SFTTokenizer":
        if args.tokenizer_model is None:
            raise ValueError("--tokenizer-model is required for --tokenizer-type SFTTokenizer")
        from .sft_tokenizer import SFTTokenizer

        tokenizer = SFTTokenizer(
            args.tokenizer_model,
            getattr(args, "sft_tokenizer_prompt_format", None) or "nemotron-h-aligned",
        )
    elif tokenizer_type == "NullTokenizer":
        if getattr(args, "vocab_size", None) is None:
            raise ValueError("--vocab-size is required for --tokenizer-type NullTokenizer")
        tokenizer = _NullTokenizer(args.vocab_size)
    else:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} is not implemented; "
            f"choices: {', '.join(TOKENIZER_TYPES)}"
        )

    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = _vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def _vocab_size_with_padding(orig_vocab_size: int, args, logging_enabled: bool = True) -> int:
    """Round the vocabulary up to a multiple of make_vocab_size_divisible_by x TP size.

    Prints ` > padded vocab (size: X) with Y dummy tokens (new size: Z)` on rank 0.
    """
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    if multiple <= 0:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({args.make_vocab_size_divisible_by}) x "
            f"--tensor-model-parallel-size ({args.tensor_model_parallel_size}) must be positive"
        )
    after = int(math.ceil(orig_vocab_size / multiple) * multiple)
    if getattr(args, "rank", 0) == 0 and logging_enabled:
        print(
            " > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
                orig_vocab_size, after - orig_vocab_size, after
            ),
            flush=True,
        )
    return after


class _BertWordPieceTokenizer(MegatronTokenizer):
    """BERT WordPiece: cls/sep/pad/mask ids, added [BOS]/[EOS], T5 `<extra_id_i>` sentinels."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        self.tokenizer = FullBertTokenizer(vocab_file, do_lower_case=lower_case)
        # Built before [BOS]/[EOS]/sentinels are appended; WordPiece never produces them.
        self._fast_encode, self.encode_backend = build_fast_wordpiece_encode(
            self.tokenizer.vocab, lower_case
        )
        for needed in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"):
            if needed not in self.tokenizer.vocab:
                raise ValueError(
                    f"--vocab-file {vocab_file}: no {needed} token; not a BERT vocabulary"
                )
        word_ids = self.tokenizer.vocab
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = (
            word_ids[name] for name in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")
        )
        self._additional_special_tokens = []

        # Ids after the WordPiece entries, in this order: [BOS], [EOS], then the T5 sentinels.
        self._bos_token, self._eos_token = "[BOS]", "[EOS]"
        for appended in (self._bos_token, self._eos_token):
            self.add_token(appended)
        self._bos_token_id = self.vocab.get(self._bos_token)
        self._eos_token_id = self.vocab.get(self._eos_token)
        self.add_additional_special_tokens([f"<extra_id_{n}>" for n in range(vocab_extra_ids)])

    def add_token(self, token: str) -> None:
        """Give `token` the next free id unless the vocabulary already has it."""
        if token in self.vocab:
            return
        new_id = self.vocab_size  # len(vocab) before the insertion
        self.vocab[token] = new_id
        self.inv_vocab[new_id] = token

    def add_additional_special_tokens(self, tokens_list: List[str]) -> None:
        """Record `tokens_list` as the sentinels and give each missing one an id."""
        self.additional_special_tokens = tokens_list
        for token in tokens_list:
            self.add_token(token)

    @property
    def vocab_size(self):
        return self.tokenizer.vocab_size()

    @property
    def vocab(self):
        return self.tokenizer.vocab

    @property
    def inv_vocab(self):
        return self.tokenizer.inv_vocab

    def tokenize(self, text: str) -> List[int]:
        if self._fast_encode is not None:
            return self._fast_encode(text)
        return self.tokenize_python(text)

    def tokenize_python(self, text: str) -> List[int]:
        """The pure-Python basic + WordPiece tokenizer (the reference the fast encoder matches)."""
        return self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text))

    def decode(self, ids: List[int]) -> str:
        """Ids -> text (WordPiece pieces joined back into words)."""
        return self.tokenizer.convert_tokens_to_string(self.tokenizer.convert_ids_to_tokens(ids))

    def detokenize(self, token_ids: List[int]) -> str:
        return self.decode(token_ids)

    def decode_token_ids(self, token_ids: List[int]) -> str:
        """Ids -> text without [PAD]/[CLS], stopping at nothing, `##` glued."""
        pieces = []
        for token in self.tokenizer.convert_ids_to_tokens(token_ids):
            if token in ("[PAD]", "[CLS]"):
                continue
            # A `##` piece continues the previous word; any other token starts a new one.
            pieces.append(token[2:] if token.startswith("##") else " " + token)
        return "".join(pieces)

    @property
    def cls(self):
        return self.cls_id

    @property
    def sep(self):
        return self.sep_id

    @property
    def pad(self):
        return self.pad_id

    @property
    def mask(self):
        return self.mask_id

    @property
    def eod(self):
        """BERT has no end-of-document token; [SEP] plays that role (used by --append-eod)."""
        return self.sep_id

    @property
    def bos(self):
        return self._bos_token_id

    @property
    def eos(self):
        return self._eos_token_id

    @property
    def bos_token(self):
        return self._bos_token

    @property
    def eos_token(self):
        return self._eos_token

    @property
    def additional_special_tokens(self) -> List[str]:
        """The sentinel tokens `<extra_id_0>`... (`--vocab-extra-ids`), in ascending id order."""
        return self._additional_special_tokens

    @additional_special_tokens.setter
    def additional_special_tokens(self, value: List[str]) -> None:
        self._additional_special_tokens = value

    @property
    def additional_special_tokens_ids(self):
        return [self.vocab.get(token) for token in self._additional_special_tokens]


class _GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2 byte-level BPE; eod = `<|endoftext|>` (50256 for GPT-2)."""

    def __init__(self, vocab_file: str, merge_file: str):
        super().__init__(vocab_file, merge_file)
        self.tokenizer = GPT2Tokenizer(
            vocab_file, merge_file, errors="replace", special_tokens=[], max_len=None
        )
        if "<|endoftext|>" not in self.tokenizer.encoder:
            raise ValueError(
                f"--vocab-file {vocab_file}: no <|endoftext|> token; not a GPT-2 vocabulary"
            )
        self.eod_id = self.tokenizer.encoder["<|endoftext|>"]

    @property
    def vocab_size(self):
        return len(self.tokenizer.encoder)

    @property
    def vocab(self):
        return self.tokenizer.encoder

    @property
    def inv_vocab(self):
        return self.tokenizer.decoder

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, token_ids: List[int]) -> str:
        return self.tokenizer.decode(token_ids)

    @property
    def eod(self):
        return self.eod_id


class _SentencePieceTokenizer(MegatronTokenizer):
    """SentencePiece with Megatron's added specials.

    <CLS> <SEP> <EOD> <MASK>, pad/bos/eos and the sentinels.

    Special tokens written literally in the text are emitted as their ids.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        import sentencepiece

        self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._initalize(vocab_extra_ids)

    def _populate_vocab(self) -> None:
        pieces = [self.tokenizer.id_to_piece(i) for i in range(len(self.tokenizer))]
        self._inv_vocab = dict(enumerate(pieces))
        self._vocab = {piece: i for i, piece in enumerate(pieces)}

    def _piece_or(self, token_id: int, default: str) -> str:
        if token_id is None or token_id < 0 or token_id >= len(self.tokenizer):
            return default
        return self.tokenizer.id_to_piece(token_id)

    def _register_special(self, token: str) -> int:
        """Mark `token` special (appending it to the vocabulary if new); returns its id."""
        token_id = self._vocab.setdefault(token, len(self._vocab))
        self._inv_vocab[token_id] = token
        self._special_tokens[token] = token_id
        self._inv_special_tokens[token_id] = token
        return token_id

    def _initalize(self, vocab_extra_ids: int) -> None:
        self._populate_vocab()
        self._special_tokens = {}
        self._inv_special_tokens = {}
        # Megatron's fixed order of additions decides the new ids: the four BERT-style markers,
        # then pad / bos / eos (the model's own pieces where it defines them), then sentinels.
        self._cls_id = self._register_special("<CLS>")
        self._sep_id = self._register_special("<SEP>")
        self._eod_id = self._register_special("<EOD>")
        self._mask_id = self._register_special("<MASK>")
        self._pad_id = self._register_special(self._piece_or(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = self._register_special(self._piece_or(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = self._register_special(self._piece_or(self.tokenizer.eos_id(), "<EOS>"))
        self._t5_tokens = [f"<extra_id_{n}>" for n in range(vocab_extra_ids)]
        for sentinel in self._t5_tokens:
            self._register_special(sentinel)

    @property
    def vocab_size(self):
        return len(self._vocab)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def decoder(self):
        return self._inv_vocab

    @property
    def encoder(self):
        return self._vocab

    def tokenize(self, text: str) -> List[int]:
        ids = []
        idx = 0
        while True:
            indices = {}
            for token in self._special_tokens:
                pos = text.find(token, idx)
                if pos >= 0:
                    indices[token] = pos
            if not indices:
                break
            next_token = min(indices, key=indices.get)
            next_idx = indices[next_token]
            ids.extend(self.tokenizer.encode_as_ids(text[idx:next_idx]))
            ids.append(self._special_tokens[next_token])
            idx = next_idx + len(next_token)
        ids.extend(self.tokenizer.encode_as_ids(text[idx:]))
        return ids

    def detokenize(self, ids: List[int]) -> str:
        # Runs of ordinary ids decode through SentencePiece; each special id is written as its
        # text, with a space after it and after the run before it.
        parts, run_start = [], 0
        for pos, token_id in enumerate(ids):
            special = self._inv_special_tokens.get(token_id)
            if special is not None:
                parts += [self.tokenizer.decode_ids(ids[run_start:pos]), special]
                run_start = pos + 1
        tail = self.tokenizer.decode_ids(ids[run_start:])
        return "".join(part + " " for part in parts) + tail

    @property
    def cls(self):
        return self._cls_id

    @property
    def sep(self):
        return self._sep_id

    @property
    def pad(self):
        return self._pad_id

    @property
    def bos(self):
        return self._bos_id

    @property
    def eod(self):
        return self._eod_id

    @property
    def eos(self):
        return self._eos_id

    @property
    def mask(self):
        return self._mask_id

    @property
    def additional_special_tokens_ids(self):
        return [self.vocab[k] for k in self._t5_tokens]


class _NoBertSpecialTokens:
    """cls, sep and mask are -1 for tokenizers without BERT's special tokens (as in Megatron).

    Listed first among the bases so that it overrides a SentencePiece parent's real ids.
    """

    @property
    def cls(self):
        return -1

    @property
    def sep(self):
        return -1

    @property
    def mask(self):
        return -1


class _GPTSentencePieceTokenizer(_NoBertSpecialTokens, _SentencePieceTokenizer):
    """Plain SentencePiece ids (no added specials); eod = the model's eos id."""

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)

    def _initalize(self, vocab_extra_ids: int) -> None:
        self._populate_vocab()
        self._pad_id = self.tokenizer.pad_id()
        self._bos_id = self.tokenizer.bos_id()
        self._eos_id = self.tokenizer.eos_id()

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode_ids(ids)

    @property
    def eod(self):
        return self._eos_id

    @property
    def additional_special_tokens_ids(self):
        return None


class _Llama2Tokenizer(_NoBertSpecialTokens, _SentencePieceTokenizer):
    """Llama-2 SentencePiece: tokenize(text, bos=True, eos=False)."""

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)

    def _initalize(self, vocab_extra_ids: int) -> None:
        self._populate_vocab()
        self.n_words = self.tokenizer.vocab_size()
        self.bos_id = self.tokenizer.bos_id()
        self.eos_id = self.tokenizer.eos_id()
        self.pad_id = self.tokenizer.pad_id()

    def tokenize(self, s: str, bos: bool = True, eos: bool = False) -> List[int]:
        head = [self.bos_id] if bos else []
        tail = [self.eos_id] if eos else []
        return head + self.tokenizer.encode(s) + tail

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode_ids(ids)

    @property
    def eod(self):
        return self.eos_id

    @property
    def additional_special_tokens_ids(self):
        return None


class _NullTokenizer(_NoBertSpecialTokens, MegatronTokenizer):
    """Text is space-separated integer ids; eod = vocab_size (the vocabulary is vocab_size + 1)."""

    def __init__(self, vocab_size: int):
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)
        self._eod_id = self._vocab_size_without_eod

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(int(x)) for x in ids)

    def offsets(self, ids: list, text: str) -> list:
        """Character offset of each id in its space-joined text."""
        widths = [len(str(token_id)) + 1 for token_id in ids]  # the number and its space
        return [0, *accumulate(widths)][: len(ids)]

    @property
    def vocab_size(self):
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocab")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no inv_vocab")

    @property
    def eod(self):
        return self._eod_id

    @property
    def additional_special_tokens_ids(self):
        return None
