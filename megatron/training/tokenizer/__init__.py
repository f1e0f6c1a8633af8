"""Tokenizers of the training layer (`--tokenizer-type`)."""

from .tokenizer import build_tokenizer
