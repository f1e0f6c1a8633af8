"""The micro-batch of a packed-sequence (`--sft`) run on this rank.

TP rank 0 of every pipeline stage reads the data (the SFT dataset is built there, see
pretrain_gpt.is_dataset_built_on_rank) and broadcasts over the tensor-parallel group what its
stage needs: tokens and positions (first stage), labels and loss mask (last stage), and the
segment boundaries (every stage, middle ones included, since every attention layer uses them).

With context parallelism every CP rank reads the same samples and keeps its share of every
packed sequence (Megatron's THD split: chunks r and 2cp-1-r of each sequence, see
megatron/core/transformer/context_parallel/packed.py); size 1 runs the same code and keeps all.
"""

import torch

from megatron.core import parallel_state as mpu
from megatron.core.transformer.context_parallel.packed import get_thd_batch_on_this_cp_rank
from megatron.core.utils import get_current_device
from megatron.training.global_vars import get_args

# name -> (dtype, extra dims after [mbs]); the sequence dim is added from --seq-length.
_FIELDS = {
    'tokens': (torch.int64, 's'),
    'labels': (torch.int64, 's'),
    'loss_mask': (torch.float32, 's'),
    'position_ids': (torch.int64, 's'),
    'cu_seqlens': (torch.int32, 's+1'),
    'cu_seqlens_unpadded': (torch.int32, 's+1'),
    'max_seqlen': (torch.int32, ''),
}


def _stage_fields():
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    fields = ['cu_seqlens', 'cu_seqlens_unpadded', 'max_seqlen']
    # Multi-token prediction embeds the rolled ids on the last stage too.
    if first or (last and getattr(get_args(), 'mtp_num_layers', None)):
        fields += ['tokens', 'position_ids']
    if last:
        fields += ['labels', 'loss_mask']
    return fields


def get_sft_batch(data_iterator):
    """(tokens, labels, loss_mask, position_ids, packed_seq_params) of this rank's micro-batch.

    Tensors are [mbs, seq_length / cp] (this CP rank's share); packed_seq_params describes the
    segments of this rank's batch-major stream (see megatron.core.packed_seq_params). Fields a
    stage does not use are None.
    """
    args = get_args()
    device = get_current_device()
    group = mpu.get_tensor_model_parallel_group()
    src = mpu.get_tensor_model_parallel_src_rank()
    mbs, seq = args.micro_batch_size, args.seq_length
    batch = dict.fromkeys(_FIELDS)
    data = next(data_iterator) if mpu.get_tensor_model_parallel_rank() == 0 else None
    for name in _stage_fields():
        dtype, dims = _FIELDS[name]
        if data is not None:
            tensor = data[name].to(device=device, dtype=dtype, non_blocking=True)
        else:
            shape = (mbs,) + {'s': (seq,), 's+1': (seq + 1,), '': ()}[dims]
            tensor = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(tensor, src, group=group)
        batch[name] = tensor
    batch, packed_seq_params = get_thd_batch_on_this_cp_rank(
        batch, mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
    )
    return (
        batch['tokens'],
        batch['labels'],
        batch['loss_mask'],
        batch['position_ids'],
        packed_seq_params,
    )
