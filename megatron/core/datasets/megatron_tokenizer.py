"""Abstract tokenizer base class of megatron.core (the datasets only need `eod` and the ids)."""

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any

import numpy


class MegatronTokenizer(ABC):
    """Base class for the tokenizers the datasets and the training layer use.

    The constructor records what identifies the tokenizer (`unique_identifiers`: class, file paths
    and options) so a dataset cache key changes when the tokenizer does.

    Args:
        tokenizer_paths: files the tokenizer was built from.
        tokenizer_options: options that change its output.
    """

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any):
        identity = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", list(tokenizer_paths))]
        )
        # Options as strings, in the order given: they become part of every dataset cache key.
        identity.update((option, str(value)) for option, value in tokenizer_options.items())
        self.unique_identifiers = identity
        self.unique_description = json.dumps(identity, indent=4)
        super().__init__()

    @abstractmethod
    def tokenize(self, text: str) -> numpy.ndarray:
        """Convert text to embedding ids."""
        pass

    def detokenize(self, ids: numpy.ndarray) -> str:
        """Convert embedding ids to text."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    def offsets(self, ids: list, text: str) -> list:
        """Character offsets of each token in `text`."""
        raise NotImplementedError(f"{type(self).__name__} has no method 'offsets'")

    @property
    @abstractmethod
    def vocab(self):
        """Dictionary from vocab text token to id token."""
        pass

    @property
    @abstractmethod
    def inv_vocab(self):
        """Dictionary from vocab id token to text token."""
        pass

    @property
    @abstractmethod
    def vocab_size(self):
        """The vocabulary size."""
        pass

    @property
    def cls(self):
        """The CLS token id."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'cls'")

    @property
    def sep(self):
        """The SEP token id."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'sep'")

    @property
    def pad(self):
        """The PAD token id."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'pad'")

    @property
    def eod(self):
        """The EOD token id."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'eod'")

    @property
    def bos(self):
        """The BOS token id."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'bos'")

    @property
    def eos(self):
        """The EOS token id."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'eos'")

    @property
    def mask(self):
        """The MASK token id."""
        raise NotImplementedError(f"{type(self).__name__} has no attribute 'mask'")
