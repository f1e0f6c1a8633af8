"""GPTFIMDataset (`--fim-data`): GPT samples rewritten with fill-in-the-middle.

It reads the ordinary `.bin/.idx` data with the ordinary GPT indices and rewrites each sample's
window of `--seq-length` + 1 tokens (`megatron.core.datasets.fim.fim_transform`), cut at the tail or
right-padded with the FIM pad token back to that length; everything after that (the shift, the
`--reset-*` and `--eod-mask-loss` masks) is GPTDataset's. The FIM pads carry no loss (Megatron
trains them unless the FIM pad is the tokenizer's pad).

Sentinels are looked up by name in the tokenizer's vocabulary (`--fim-prefix-token` ...); a name
that is not one token is refused when the dataset is built (Megatron maps it to unk or None). The
random draws of sample i come from a generator seeded with (--seed, split, i), so a sample
depends on its index only (Megatron draws from one generator per dataset, in access order).
Tokenizers: HuggingFaceTokenizer (and SFTTokenizer) and GPT2BPETokenizer, whose text round trip
is exact; the others are refused.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy
import torch

from megatron.core.datasets.fim import FIMTokenIds, fim_transform, fit_length
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig


@dataclass
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig plus the fill-in-the-middle settings."""

    fim_rate: float = 0.5
    """Probability of rewriting a document (--fim-rate)."""

    fim_spm_rate: float = 0.5
    """Probability of SPM rather than PSM (--fim-spm-rate)."""

    fim_split_sample: Optional[str] = None
    """Token splitting a document into fragments (--fim-split-sample)."""

    fim_fragment_rate: Optional[float] = None
    """Probability of rewriting each fragment (--fim-fragment-rate)."""

    fim_no_prefix: Optional[str] = None
    """Leave pieces whose text starts with this unchanged (--fim-no-prefix)."""

    fim_extra_tokens: Dict[str, str] = field(
        default_factory=lambda: {
            "prefix": "<fim_prefix>",
            "middle": "<fim_middle>",
            "suffix": "<fim_suffix>",
            "pad": "<fim_pad>",
            "eod": "<|endoftext|>",
        }
    )
    """Token names of the sentinels and of the document separator."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            raise ValueError("fim_split_sample needs fim_fragment_rate (--fim-fragment-rate)")


def _text_codec(tokenizer):
    """(encode, decode) without special tokens, for tokenizers whose text round trip is exact."""
    from megatron.training.tokenizer.tokenizer import _GPT2BPETokenizer, _HuggingFaceTokenizer

    if isinstance(tokenizer, _HuggingFaceTokenizer):
        hf = tokenizer._tokenizer

        def encode(text):
            return hf(text, add_special_tokens=False).input_ids

        def decode(ids):
            return hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

        return encode, decode
    if isinstance(tokenizer, _GPT2BPETokenizer):
        return tokenizer.tokenize, tokenizer.detokenize
    raise ValueError(
        f"--fim-data needs a tokenizer whose text round trip is exact (HuggingFaceTokenizer or "
        f"GPT2BPETokenizer); --tokenizer-type {type(tokenizer).__name__.lstrip('_')} is not"
    )


def _token_id(tokenizer, name: str, flag: str) -> int:
    vocab = tokenizer.vocab
    if name not in vocab:
        raise ValueError(
            f"{flag} {name!r} is not a token of the vocabulary of --tokenizer-type "
            f"{type(tokenizer).__name__.lstrip('_')}; add it to the tokenizer (e.g. as a special "
            "token of the Hugging Face tokenizer) or name a token it has"
        )
    return int(vocab[name])


class GPTFIMDataset(GPTDataset):
    """GPTDataset whose windows are rewritten with fill-in-the-middle (see the module docstring).

    Raises:
        ValueError: a sentinel, EOD or split token that is not one token of the vocabulary, or a
            tokenizer without an exact text round trip.
    """

    def __init__(
        self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
    ):
        tokenizer = config.tokenizer
        names = config.fim_extra_tokens
        self.fim_ids = FIMTokenIds(
            prefix=_token_id(tokenizer, names["prefix"], "--fim-prefix-token"),
            middle=_token_id(tokenizer, names["middle"], "--fim-middle-token"),
            suffix=_token_id(tokenizer, names["suffix"], "--fim-suffix-token"),
            pad=_token_id(tokenizer, names["pad"], "--fim-pad-token"),
            eod=_token_id(tokenizer, names["eod"], "--fim-eod-token"),
        )
        sentinels = {
            "--fim-prefix-token": self.fim_ids.prefix,
            "--fim-middle-token": self.fim_ids.middle,
            "--fim-suffix-token": self.fim_ids.suffix,
            "--fim-pad-token": self.fim_ids.pad,
            "--fim-eod-token": self.fim_ids.eod,
        }
        seen = {}
        for flag, token_id in sentinels.items():
            if token_id in seen:
                raise ValueError(
                    f"{seen[token_id]} and {flag} name the same token (id {token_id}); the FIM "
                    "sentinels and the end-of-document token must be five different tokens"
                )
            seen[token_id] = flag
        self.fim_split_id = None
        if config.fim_split_sample is not None:
            self.fim_split_id = _token_id(tokenizer, config.fim_split_sample, "--fim-split-sample")
        self._encode, self._decode = _text_codec(tokenizer)
        super().__init__(
            indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config
        )

    def _query_document_sample_shuffle_indices(self, idx: int):
        # The real tokens only: a short last sample's padding is not text, and a tokenizer pad id
        # equal to the end-of-document id must not delete the document boundaries.
        tokens, document_ids = self._query_unpadded(idx)
        length = self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        rng = numpy.random.default_rng([self.config.random_seed, self.index_split.value, int(idx)])
        rewritten = fim_transform(
            tokens,
            rng,
            self.fim_ids,
            self._encode,
            self._decode,
            self.config.fim_rate,
            self.config.fim_spm_rate,
            split_id=self.fim_split_id,
            fragment_rate=self.config.fim_fragment_rate,
            no_prefix=self.config.fim_no_prefix,
        )
        return fit_length(rewritten, length, self.fim_ids.pad), document_ids

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        sample = super().__getitem__(idx)
        sample["loss_mask"][sample["labels"] == self.fim_ids.pad] = 0.0
        return sample
