"""Parameters describing packed (variable-length, concatenated) sequences for attention.

Megatron's public type (`from megatron.core.packed_seq_params import PackedSeqParams`), the type of
the `packed_seq_params` argument of GPTModel / TransformerBlock / TransformerLayer / Attention /
DotProductAttention forwards.

The segments are described on the batch-major token stream of a micro-batch of b samples of
length s: sample i's tokens are positions i*s .. (i+1)*s - 1 of the stream, and `cu_seqlens`
(int32, from 0 to b*s) marks where each segment starts, every i*s among them. With b = 1 this is
Megatron's 'thd' layout after its `flatten_batch_for_packed_sequences`; for b > 1 the
activations keep their [s, b, h] shape (so pipeline stages exchange the usual tensors) and the
attention reads the stream through a transpose. Each segment attends only to itself (causally for
causal layers), and rotary position embeddings restart at every segment start.

Padding inside segments (Megatron's `cu_seqlens_*_padded`, Transformer Engine's THD semantics):
when `cu_seqlens_q_padded` is set, segment k occupies positions cu_seqlens_q_padded[k] ..
cu_seqlens_q_padded[k + 1] - 1 of the stream, of which only the first
cu_seqlens_q[k + 1] - cu_seqlens_q[k] are real tokens; the rest are padding, whose attention output
is zero (real tokens never attend to them: they follow the real tokens of their segment). Under
context parallelism the values are those of this CP rank's local stream
(megatron.core.transformer.context_parallel.packed).
"""

from dataclasses import dataclass
from typing import Optional

import torch
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

    cu_seqlens_q_padded: Tensor = None
    """Segment offsets including the padding inside segments, int32 [num_seqs + 1]; None: no
    padding (the offsets are cu_seqlens_q)."""

    cu_seqlens_kv_padded: Tensor = None
    """Key/value counterpart of cu_seqlens_q_padded."""

    def segment_offsets(self) -> Tensor:
        """Where the segments start in the stream (then its end): the padded offsets if set."""
        return self.cu_seqlens_q if self.cu_seqlens_q_padded is None else self.cu_seqlens_q_padded


def packed_seq_params_from_samples(cu_seqlens: Tensor, max_seqlen: Tensor) -> PackedSeqParams:
    """PackedSeqParams of a micro-batch whose samples each carry their own segment starts.

    Args:
        cu_seqlens: int [b, s + 1]: per sample, its segment starts then s, right-filled with s
            (the dataset's layout, so samples collate).
        max_seqlen: int [b]: each sample's longest segment.

    Returns:
        'thd' params over the batch-major stream of b*s tokens (see the module docstring).
    """
    b, s = cu_seqlens.shape[0], cu_seqlens.shape[1] - 1
    offsets = torch.arange(b, device=cu_seqlens.device, dtype=cu_seqlens.dtype) * s
    starts = (cu_seqlens + offsets[:, None])[cu_seqlens < s]  # [num_seqs], increasing
    total = torch.tensor([b * s], device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    cu = torch.cat((starts, total)).to(torch.int32)
    longest = max_seqlen.max().to(torch.int32)
    return PackedSeqParams(
        qkv_format='thd',
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def packed_segment_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """The segment of every position of a stream of `total` tokens: int64 [total]."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), positions, right=True)


def packed_position_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """Positions restarting at every segment start: int64 [total]."""
    segment = packed_segment_ids(cu_seqlens, total)
    positions = torch.arange(total, device=cu_seqlens.device)
    return positions - cu_seqlens.to(torch.int64)[segment]


def packed_real_rows(packed_seq_params: PackedSeqParams, total: int) -> Optional[Tensor]:
    """bool [total]: True where the stream holds a real token, False on padding inside a segment;
    None when the params describe no padding."""
    if packed_seq_params.cu_seqlens_q_padded is None:
        return None
    offsets = packed_seq_params.cu_seqlens_q_padded.to(torch.int64)
    real = torch.diff(packed_seq_params.cu_seqlens_q.to(torch.int64))
    if torch.equal(real, torch.diff(offsets)):
        return None
    segment = packed_segment_ids(offsets, total)
    position = torch.arange(total, device=offsets.device) - offsets[segment]
    return position < real[segment]
