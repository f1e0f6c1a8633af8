"""`HuggingFaceTokenizer`: a `transformers.AutoTokenizer` read from a local directory.

Its own module so that tokenizers built on it (`sft_tokenizer.SFTTokenizer`) import it without
importing `tokenizer.build_tokenizer`, which in turn selects them (no import cycle).
"""

import os

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer


class _HuggingFaceTokenizer(MegatronTokenizer):
    """A `transformers.AutoTokenizer` from a local directory (never downloads)."""

    def __init__(self, pretrained_model_name_or_path: str, **kwargs):
        super().__init__(pretrained_model_name_or_path, **kwargs)
        try:
            import transformers
        except ImportError as exc:
            raise ImportError(
                "--tokenizer-type HuggingFaceTokenizer needs the optional package `transformers` "
                "(pip install transformers)"
            ) from exc
        if not os.path.exists(pretrained_model_name_or_path):
            raise FileNotFoundError(
                f"--tokenizer-model: no such local directory or file: "
                f"{pretrained_model_name_or_path} "
                "(HuggingFaceTokenizer loads local files only)"
            )
        kwargs.setdefault("local_files_only", True)
        self._tokenizer = transformers.AutoTokenizer.from_pretrained(
            pretrained_model_name_or_path=pretrained_model_name_or_path, **kwargs
        )
        self._vocab = self._tokenizer.get_vocab()
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}

    @property
    def vocab_size(self):
        return len(self._tokenizer)

    @property
    def vocab(self):
        return self._vocab

    @property
    def inv_vocab(self):
        return self._inv_vocab

    @property
    def decoder(self):
        return self._inv_vocab

    def tokenize(self, text, **kwargs):
        return self._tokenizer(text, **kwargs).input_ids

    def detokenize(self, token_ids, **kwargs):
        return self._tokenizer.decode(token_ids, **kwargs)

    @property
    def bos(self):
        return self._tokenizer.bos_token_id

    @property
    def eod(self):
        return self._tokenizer.eos_token_id

    @property
    def eos(self):
        return self._tokenizer.eos_token_id

    @property
    def pad(self):
        return self._tokenizer.pad_token_id
