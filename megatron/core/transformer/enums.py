"""Enumerations of the transformer package (attention types, mask types, layer types)."""

import enum

from megatron.core.enums import ModelType  # noqa: F401  (re-exported: Megatron keeps it here too)


class LayerType(enum.Enum):
    """Kind of transformer layer (encoder, decoder, retro variants)."""

    encoder = 1
    decoder = 2
    retro_encoder = 3
    retro_decoder = 4
    retro_decoder_with_retriever = 5


class AttnType(enum.Enum):
    """Self attention (queries, keys and values from one sequence) or cross attention."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """How the attention mask is formed.

    padding: an explicit [b, 1, sq, sk] mask (True = masked out) is passed in.
    causal: upper-triangular mask, built on the fly when no mask is passed.
    no_mask: attend everywhere.
    padding_causal: an explicit mask combined with the causal one.
    arbitrary: an explicit mask of any pattern.
    """

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
