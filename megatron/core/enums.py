"""Enumerations shared across megatron.core."""

import enum


class ModelType(enum.Enum):
    """How a model is laid out across pipeline stages.

    encoder_or_decoder: one stack (GPT, BERT) split evenly over all pipeline stages.
    encoder_and_decoder: two stacks (T5); ranks below the pipeline split rank hold the encoder.
    """

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4
