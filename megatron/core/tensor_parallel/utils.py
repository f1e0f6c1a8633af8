"""Tensor splitting helpers of the tensor parallel layers, and single-tensor collectives."""

from typing import List, Sequence

import torch

from megatron.core import group_fallbacks
from megatron.core.utils import divide

# torch >= 2.13 renamed the flat-tensor collectives; keep one spelling for every version.
_all_gather_single = getattr(torch.distributed, "all_gather_single", None) or getattr(
    torch.distributed, "all_gather_into_tensor"
)
_reduce_scatter_single = getattr(torch.distributed, "reduce_scatter_single", None) or getattr(
    torch.distributed, "reduce_scatter_tensor"
)


def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group=None, async_op=False):
    """All-gather `input_` from every rank of `group` into `output` (concatenated along dim 0)."""
    return _all_gather_single(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input_: torch.Tensor, group=None, async_op=False):
    """Sum `input_` over `group` and keep this rank's dim-0 chunk of the result in `output`."""
    return _reduce_scatter_single(output, input_, group=group, async_op=async_op)


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> List[torch.Tensor]:
    """Split a tensor into `num_partitions` equal chunks along its last dimension.

    Args:
        tensor: input tensor.
        num_partitions: number of chunks; must divide the last dimension.
        contiguous_split_chunks: make each chunk contiguous in memory (else they are views).

    Returns:
        The list of chunks.
    """
    chunks = tensor.split(divide(tensor.size(-1), num_partitions), dim=tensor.dim() - 1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def split_tensor_into_1d_equal_chunks(
    tensor: torch.Tensor, new_buffer: bool = False, tp_group=None
):
    """This tensor-parallel rank's chunk of the flattened tensor.

    The flattened tensor is cut into tp-size equal chunks; rank r keeps chunk r.

    Args:
        tensor: tensor whose numel is divisible by the tensor parallel size.
        new_buffer: copy the chunk into a fresh buffer (else return a view).
        tp_group: tensor parallel group (default: the global one).
    """
    # Fall back to the global tensor parallel group when none is given.
    tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
    partition_size = divide(torch.numel(tensor), tp_group.size())
    start_index = partition_size * tp_group.rank()
    end_index = start_index + partition_size
    data = tensor.view(-1)[start_index:end_index]
    if new_buffer:
        return data.clone()
    return data


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Inverse of split_tensor_into_1d_equal_chunks: all-gather the 1-D chunks of the TP group.

    Returns a 1-D tensor of tp-size times the input's numel, chunks in rank order.
    """
    # Fall back to the global tensor parallel group when none is given.
    tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)
    numel_gathered = torch.numel(tensor) * tp_group.size()
    gathered = torch.empty(
        numel_gathered, dtype=tensor.dtype, device=tensor.device, requires_grad=False
    )
    all_gather_into_tensor(gathered, tensor.contiguous().view(-1), group=tp_group)
    return gathered


class VocabUtility:
    """Which slice [first, last) of the vocabulary a tensor parallel rank owns.

    The vocabulary is split into world_size contiguous equal ranges, rank r owning the r-th.
    """

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(
        per_partition_vocab_size: int, rank: int, world_size: int
    ) -> Sequence[int]:
        """[first, last) of `rank` when every partition holds per_partition_vocab_size entries."""
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(
        global_vocab_size: int, rank: int, world_size: int
    ) -> Sequence[int]:
        """[first, last) of `rank` for a vocabulary of global_vocab_size split world_size ways."""
        per_partition_vocab_size = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_partition_vocab_size, rank, world_size
        )
