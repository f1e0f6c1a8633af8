"""T5 span-corruption samples over sentence-level (or document-level) WordPiece data.

Sample `idx` (as Megatron's megatron/core/datasets/t5_dataset.py builds it):

1. Row (beg, end, target) -> the sentences' tokens flattened; only the first `target` are kept
   (`truncated` = 1 if more were there). No segment split, no draws before masking.
2. Masking with geometric span lengths over whole words (budget from `target`).
3. Spans in order take sentinels from `additional_special_tokens_ids` front to back
   (`<extra_id_0>` first): encoder input = text with each span replaced by its sentinel (no
   [BOS]/[EOS]); decoder input = [BOS] then, per span, sentinel + original tokens; labels = per span
   sentinel + original tokens, then [EOS] (decoder input shifted left by one).
4. Encoder input padded to `sequence_length_encoder`, decoder input to
   `sequence_length_decoder` with the pad id, labels with -1; loss_mask = 1 over the decoder
   input's real length.
5. int64 masks, 1 = attend, a position being real iff its id >= 1 (pad id 0 assumed):
   enc_mask [S_enc, S_enc], enc_dec_mask [S_dec, S_enc], dec_mask [S_dec, S_dec] (also causal).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.utils import Split


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration object for Megatron Core T5 WordPiece datasets.

    The tokenizer must carry sentinel tokens (`additional_special_tokens_ids`, from
    `--vocab-extra-ids`).
    """

    sequence_length_encoder: Optional[int] = field(init=False, default=None)
    """A sequence_length alias and the sequence length for the encoder."""

    sequence_length_decoder: int = None
    """The sequence length for the decoder (--decoder-seq-length)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sequence_length_encoder = self.sequence_length
        if self.sequence_length_decoder is None:
            raise ValueError("--decoder-seq-length is required for T5 data")
        if self.sequence_length_decoder < 2:
            raise ValueError(
                f"--decoder-seq-length must be >= 2 ([BOS] and one token), got "
                f"{self.sequence_length_decoder}"
            )
        if self.sequence_length_encoder < 4:
            # build_mapping needs a target length (encoder length - 2) of at least 2.
            raise ValueError(
                f"--encoder-seq-length must be >= 4 for T5 data, got {self.sequence_length_encoder}"
            )
        if len(self.tokenizer.additional_special_tokens_ids) == 0:
            raise ValueError(
                "T5 data needs sentinel tokens: pass --vocab-extra-ids N with N > 0 (e.g. 100)"
            )


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """The T5 dataset that assumes WordPiece tokenization.

    Args:
        indexed_dataset: the IndexedDataset.
        dataset_path: its path prefix.
        indexed_indices: the documents of this split.
        num_samples: minimum number of samples (whole epochs are built).
        index_split: the split.
        config: the config.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: str,
        indexed_indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: T5MaskedWordPieceDatasetConfig,
    ) -> None:
        super().__init__(
            indexed_dataset,
            dataset_path,
            indexed_indices,
            num_samples=num_samples,
            index_split=index_split,
            config=config,
        )
        # Every id of the vocabulary, for the 10 % of masked positions that get a random token.
        self.token_lookup = list(config.tokenizer.inv_vocab.keys())
        # Megatron reserves two positions (for [BOS] and [EOS]) out of the encoder length.
        self.sample_index = self._build_sample_index(self.config.sequence_length - 2, 1)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return super(
            T5MaskedWordPieceDataset, T5MaskedWordPieceDataset
        )._key_config_attributes() + ["sequence_length_decoder"]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        """Sample `idx`: text_enc, text_dec, labels, loss_mask, truncated, and the three masks."""
        idx_beg, idx_end, target_sequence_length = (int(v) for v in self.sample_index[idx])
        tokens = [t for i in range(idx_beg, idx_end) for t in self.dataset[i].tolist()]
        numpy_random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        assert target_sequence_length <= self.config.sequence_length
        tokenizer = self.config.tokenizer

        truncated = len(tokens) > target_sequence_length
        tokens = tokens[:target_sequence_length]
        tokens, _, _, _, masked_spans = self._create_masked_lm_predictions(
            tokens, target_sequence_length, numpy_random_state
        )
        encoder_input, decoder_input, decoder_output = self._corrupt_spans(tokens, masked_spans)

        length_toks_encoder = len(encoder_input)
        length_toks_decoder = len(decoder_input)
        length_pads_encoder = self.config.sequence_length_encoder - length_toks_encoder
        length_pads_decoder = self.config.sequence_length_decoder - length_toks_decoder
        assert length_pads_encoder >= 0
        if length_pads_decoder < 0:
            raise ValueError(
                f"T5 sample {idx}: the decoder input needs {length_toks_decoder} tokens ([BOS], "
                f"{len(masked_spans)} sentinels, {length_toks_decoder - 1 - len(masked_spans)} "
                f"masked tokens) but --decoder-seq-length is {self.config.sequence_length_decoder}"
            )

        enc = _right_pad(encoder_input, length_pads_encoder, tokenizer.pad)
        dec = _right_pad(decoder_input, length_pads_decoder, tokenizer.pad)
        # -1 marks target positions the loss ignores.
        targets = _right_pad(decoder_output, length_pads_decoder, -1)
        loss_mask = (
            numpy.arange(self.config.sequence_length_decoder) < length_toks_decoder
        ).astype(numpy.int64)
        # The decoder sees real tokens only, and of those only the ones not after itself.
        causal = self._make_attention_mask(dec, dec) * self._make_history_mask(dec)
        return {
            "text_enc": enc,
            "text_dec": dec,
            "labels": targets,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": self._make_attention_mask(enc, enc),
            "dec_mask": causal,
            "enc_dec_mask": self._make_attention_mask(dec, enc),
        }

    def _corrupt_spans(self, tokens: List[int], masked_spans) -> tuple:
        """(encoder input, decoder input, decoder output) lists with one sentinel per span.

        Raises:
            IndexError: more masked spans than sentinels (`--vocab-extra-ids` too small).
        """
        tokenizer = self.config.tokenizer
        sentinels = list(tokenizer.additional_special_tokens_ids)
        if len(masked_spans) > len(sentinels):
            raise IndexError(
                f"T5 sample has more masked spans ({len(masked_spans)}) than sentinel tokens "
                f"({len(sentinels)}); raise --vocab-extra-ids"
            )
        encoder_input, decoder_input, decoder_output = [], [tokenizer.bos], []
        kept_from = 0
        # Each span collapses to its sentinel in the encoder; the decoder spells it out after it.
        for (positions, originals), sentinel in zip(masked_spans, sentinels):
            encoder_input += tokens[kept_from : positions[0]] + [sentinel]
            decoder_input += [sentinel, *originals]
            decoder_output += [sentinel, *originals]
            kept_from = positions[-1] + 1
        encoder_input += tokens[kept_from:]
        return encoder_input, decoder_input, decoder_output + [tokenizer.eos]

    @staticmethod
    def _make_attention_mask(
        source_block: numpy.ndarray, target_block: numpy.ndarray
    ) -> numpy.ndarray:
        """int64 `[len(source), len(target)]`: 1 where both positions hold a real id (>= 1)."""
        mask = (target_block[None, :] >= 1) * (source_block[:, None] >= 1)
        return mask.astype(numpy.int64)

    @staticmethod
    def _make_history_mask(block: numpy.ndarray) -> numpy.ndarray:
        """int64 lower-triangular `[n, n]` (key position <= query position)."""
        arange = numpy.arange(block.shape[0])
        mask = arange[None,] <= arange[:, None]
        return mask.astype(numpy.int64)

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> int:
        """Always [MASK] and no draw: the masked spans are replaced by sentinels anyway."""
        return self.config.tokenizer.mask


def _right_pad(ids: List[int], count: int, fill: int) -> numpy.ndarray:
    """int64 array of `ids` followed by `count` copies of `fill`."""
    return numpy.pad(numpy.array(ids, dtype=numpy.int64), (0, count), constant_values=fill)
