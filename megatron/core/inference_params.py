"""Key/value cache bookkeeping for autoregressive inference (megatron-core's `InferenceParams`).

Each self-attention layer stores its keys and values in
`key_value_memory_dict[layer_number] = (key_memory, value_memory)`, two buffers of shape
[max_sequence_length, max_batch_size, ng, hn] (ng query groups of this tensor-parallel rank, hn
head size) allocated on the layer's first forward. A forward writes its new keys and values at
sequences [sequence_len_offset, sequence_len_offset + sq) and batch rows [batch_size_offset,
batch_size_offset + b), then attends over [0, sequence_len_offset + sq) of those rows.

Recurrent layers (Mamba mixers) store a `RecurrentState` under their layer number instead: per
batch row, the conv inputs [max_batch_size, conv_dim, K] and the SSM state
[max_batch_size, nh, P, N], batch first.
"""

from typing import NamedTuple

import torch


class RecurrentState(NamedTuple):
    """The batch-first state of one recurrent layer (see the module docstring)."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor


class InferenceParams:
    """Inference state shared by every layer of one model during one generation request.

    Args:
        max_batch_size (int): rows of the cache (the request's batch size).
        max_sequence_length (int): positions of the cache (prompt plus generated tokens).

    Attributes:
        sequence_len_offset (int): positions already in the cache; the caller advances it by the
            fed width after each forward.
        batch_size_offset (int): first cache row of the current (pipeline) micro-batch.
        key_value_memory_dict (dict): layer_number -> (key_memory, value_memory).
        materialize_only_last_token_logits (bool): the model computes the logits of the last
            fed position only (what sampling needs; as in later megatron-core versions). False
            keeps every position's logits (log probabilities of the fed tokens).
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        self.max_sequence_length = max_sequence_length
        self.max_batch_size = max_batch_size
        self.sequence_len_offset = 0
        self.batch_size_offset = 0
        self.key_value_memory_dict = {}
        self.materialize_only_last_token_logits = False

    def is_static_batching(self) -> bool:
        """One padded batch in a dense cache (the dynamic engine's context says False)."""
        return True

    def is_dynamic_batching(self) -> bool:
        return False

    def swap_key_value_dict(self, batch_idx):
        """Reorder the batch rows of every layer's cache: row i becomes old row batch_idx[i]
        (beam search keeps the caches of the beams it continues)."""
        if len(self.key_value_memory_dict) == 0:
            raise ValueError("should not swap when dict in empty")

        for layer_number, entry in list(self.key_value_memory_dict.items()):
            if isinstance(entry, RecurrentState):
                assert len(batch_idx) == entry.conv_state.shape[0]
                self.key_value_memory_dict[layer_number] = RecurrentState(
                    entry.conv_state[batch_idx], entry.ssm_state[batch_idx]
                )
                continue
            keys, values = entry
            # Caches are [s, b, ng, hn]: the batch is dimension 1.
            assert len(batch_idx) == keys.shape[1]  # make sure batch size is same
            self.key_value_memory_dict[layer_number] = (keys[:, batch_idx], values[:, batch_idx])

    def __str__(self):
        return (
            f"InferenceParams(max_batch_size={self.max_batch_size}, "
            f"max_sequence_length={self.max_sequence_length}, "
            f"sequence_len_offset={self.sequence_len_offset}, "
            f"batch_size_offset={self.batch_size_offset}, "
            f"layers_cached={sorted(self.key_value_memory_dict)})"
        )
