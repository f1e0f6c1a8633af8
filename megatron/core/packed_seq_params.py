"""Parameters describing packed (variable-length, concatenated) sequences for attention.

Megatron's public type (`from megatron.core.packed_seq_params import PackedSeqParams`), the type of
the `packed_seq_params` argument of GPTModel / TransformerBlock / TransformerLayer / Attention /
DotProductAttention forwards. As in Megatron core_r0.8.0, only Transformer Engine's attention
consumes packed sequences; the local DotProductAttention (the only one here) rejects them.
"""

from dataclasses import dataclass

from torch import Tensor


@dataclass
class PackedSeqParams:
    """Cumulative sequence lengths and maxima of a packed batch ('thd' layout)."""

    qkv_format: str = None
    """Layout of q/k/v: 'thd' (packed tokens) or 'sbhd'."""

    cu_seqlens_q: Tensor = None
    """Cumulative query sequence lengths, int32 [num_seqs + 1]."""

    cu_seqlens_kv: Tensor = None
    """Cumulative key/value sequence lengths, int32 [num_seqs + 1]."""

    max_seqlen_q: Tensor = None
    """Longest query sequence."""

    max_seqlen_kv: Tensor = None
    """Longest key/value sequence."""
