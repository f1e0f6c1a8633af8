"""`InferenceWrapperConfig`: what a model inference wrapper needs to know besides the model."""

from dataclasses import dataclass

import torch


@dataclass
class InferenceWrapperConfig:
    """Settings of a model inference wrapper.

    Attributes:
        hidden_size (int): the model's hidden size (size of the activations sent between
            pipeline stages).
        params_dtype (torch.dtype): dtype of those activations (unless fp32_residual_connection).
        inference_batch_times_seqlen_threshold (int): with pipeline parallelism, a static-batch
            forward of batch x width above this runs as micro-batches of max(1, threshold //
            width) rows (-1: never).
        padded_vocab_size (int): the output layer's (padded) vocabulary size.
        fp32_residual_connection (bool): activations between stages are fp32.
    """

    hidden_size: int
    params_dtype: torch.dtype
    inference_batch_times_seqlen_threshold: int
    padded_vocab_size: int
    fp32_residual_connection: bool = False

    def add_attributes(self, attribute_value_pair: dict) -> None:
        """Set extra attributes (for callers' own wrappers)."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)
