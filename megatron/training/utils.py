"""Training-layer helpers: rank-aware printing, loss averaging, norms, memory reports, batches.

`get_batch_on_this_tp_rank` is how every tensor-parallel rank gets the same micro-batch: only TP
rank 0 reads the data iterator, then it broadcasts the tensors over the TP group.
"""

import logging
import math
import os
import sys
from datetime import datetime

import torch

from megatron.core import parallel_state as mpu
from megatron.core.transformer.context_parallel.layout import (
    get_batch_on_this_cp_rank as core_get_batch_on_this_cp_rank,
)
from megatron.core.utils import (  # noqa: F401
    StragglerDetector,
    check_param_hashes_across_dp_replicas,
    get_attr_wrapped_model,
    get_current_device,
    unwrap_model,
    uses_cuda,
)
from megatron.training.global_vars import get_args


def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def print_rank_0(message):
    """Print only on global rank 0 (or when torch.distributed is not initialized)."""
    if _rank() == 0:
        print(message, flush=True)


def is_last_rank():
    """True on the last global rank (the one that prints the training log)."""
    if not torch.distributed.is_initialized():
        return True
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank_last(message):
    """Print only on the last global rank."""
    if is_last_rank():
        print(message, flush=True)


def print_datetime(string):
    """Print `[string] datetime: YYYY-MM-DD HH:MM:SS ` on rank 0 after a barrier."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    time_str = datetime.now().strftime('%Y-%m-%d %H:%M:%S')
    print_rank_0('[' + string + '] datetime: {} '.format(time_str))


def append_to_progress_log(string, barrier=True):
    """Append a line to <save>/progress.txt (rank 0), as --log-progress does."""
    args = get_args()
    if args.save is None:
        return
    progress_log_filename = os.path.join(args.save, 'progress.txt')
    if barrier and torch.distributed.is_initialized():
        torch.distributed.barrier()
    if _rank() == 0:
        os.makedirs(args.save, exist_ok=True)
        with open(progress_log_filename, 'a') as f:
            job_id = os.getenv('SLURM_JOB_ID', '')
            num_gpus = args.world_size
            f.write(
                f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}\tJob ID: {job_id}\t"
                f"# GPUs: {num_gpus}\t{string}\n"
            )


def average_losses_across_data_parallel_group(losses):
    """Mean of each loss over the data-parallel group (one all-reduce of the concatenated
    losses)."""
    averaged_losses = torch.cat([loss.clone().detach().view(1) for loss in losses])
    torch.distributed.all_reduce(averaged_losses, group=mpu.get_data_parallel_group())
    averaged_losses = averaged_losses / torch.distributed.get_world_size(
        group=mpu.get_data_parallel_group()
    )
    return averaged_losses


def calc_params_l2_norm(model):
    """L2 norm of all parameters, each counted once.

    Parameters duplicated across TP ranks (norms, row-parallel biases) are counted on TP rank 0
    only, the tied output weight once (`shared` params are skipped on non-first stages); squares
    are summed over the model-parallel group. With expert parallelism, dense parameters (equal on
    every expert-parallel rank) are counted on expert-parallel rank 0 and each rank adds its own
    experts; the sum runs over the tensor x expert x pipeline group.
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    if not isinstance(model, list):
        model = [model]
    expert_parallel = mpu.get_expert_model_parallel_world_size() > 1
    count_dense = not expert_parallel or mpu.get_expert_model_parallel_rank() == 0
    total = torch.zeros(1, dtype=torch.float, device=get_current_device())
    for model_module in model:
        for param in model_module.parameters():
            is_not_shared = not (
                getattr(param, 'shared', False)
                and not mpu.is_pipeline_first_stage(ignore_virtual=True)
            )
            is_expert = not getattr(param, 'allreduce', True)
            if not is_expert and not count_dense:
                continue
            if is_not_shared and param_is_not_tensor_parallel_duplicate(param):
                data = param.main_param if getattr(param, 'main_param', None) is not None else param
                total += data.detach().float().pow(2).sum()
    torch.distributed.all_reduce(
        total, group=mpu.get_model_parallel_group(with_expert_parallel=expert_parallel)
    )
    return total.item() ** 0.5


def report_memory(name):
    """Print this rank's memory use (CUDA allocator stats, or process RSS on CPU), dp rank 0
    only."""
    if mpu.get_data_parallel_rank() != 0:
        return
    mega_bytes = 1024.0 * 1024.0
    if uses_cuda():
        string = name + ' memory (MB)'
        string += ' | allocated: {}'.format(torch.cuda.memory_allocated() / mega_bytes)
        string += ' | max allocated: {}'.format(torch.cuda.max_memory_allocated() / mega_bytes)
        string += ' | reserved: {}'.format(torch.cuda.memory_reserved() / mega_bytes)
        string += ' | max reserved: {}'.format(torch.cuda.max_memory_reserved() / mega_bytes)
    else:
        string = name + ' memory (MB)'
        string += ' | rss: {:.1f}'.format(_rss_bytes() / mega_bytes)
        string += ' | max rss: {:.1f}'.format(_max_rss_bytes() / mega_bytes)
    # One write per line: the dp-rank-0 of every stage prints at once, and separate writes of
    # text and newline interleave between processes sharing a terminal.
    sys.stdout.write('[Rank {}] {}\n'.format(_rank(), string))
    sys.stdout.flush()


def _rss_bytes():
    try:
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError):
        return 0


def _max_rss_bytes():
    try:
        import resource

        scale = 1 if sys.platform == 'darwin' else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    except ImportError:
        return 0


def get_ltor_masks_and_position_ids(
    data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss
):
    """Left-to-right (causal) attention mask, loss mask and position ids for a batch of tokens.

    Args:
        data: [b, s] token ids.
        eod_token: end-of-document id.
        reset_position_ids: restart positions after each EOD.
        reset_attention_mask: block attention across EODs.
        eod_mask_loss: zero the loss on EOD tokens.

    Returns:
        attention_mask: bool [b or 1, 1, s, s], True = masked out.
        loss_mask: float [b, s].
        position_ids: long [b, s].
    """
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(
        torch.ones((att_mask_batch, seq_length, seq_length), device=data.device)
    ).view(att_mask_batch, 1, seq_length, seq_length)  # [b, 1, s, s]
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1) :, : (i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1) :] -= i + 1 - prev_index
                    prev_index = i + 1
    attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


def get_batch_on_this_tp_rank(data_iterator):
    """The next micro-batch, read on TP rank 0 and broadcast to the other TP ranks.

    First stages need tokens and position ids, last stages labels and loss mask (and tokens and
    position ids too with multi-token prediction); both need the attention mask (when the
    dataloader makes one). Returns a dict of tensors on the current device.
    """
    args = get_args()
    device = get_current_device()
    tp_group = mpu.get_tensor_model_parallel_group()
    src = mpu.get_tensor_model_parallel_src_rank()
    # Multi-token prediction embeds the rolled ids on the last stage.
    mtp_on_last_stage = bool(getattr(args, 'mtp_num_layers', None))

    def _broadcast(item):
        if item is not None:
            torch.distributed.broadcast(item, src, group=tp_group)

    if mpu.get_tensor_model_parallel_rank() == 0:
        if data_iterator is not None:
            data = next(data_iterator)
        else:
            data = None
        attention_mask = (
            data.get('attention_mask') if args.create_attention_mask_in_dataloader else None
        )
        batch = {
            'tokens': data['tokens'].to(device, non_blocking=True),
            'labels': data['labels'].to(device, non_blocking=True),
            'loss_mask': data['loss_mask'].to(device, non_blocking=True),
            'attention_mask': None
            if attention_mask is None
            else attention_mask.to(device, non_blocking=True),
            'position_ids': data['position_ids'].to(device, non_blocking=True),
        }
        if args.pipeline_model_parallel_size == 1:
            _broadcast(batch['tokens'])
            _broadcast(batch['labels'])
            _broadcast(batch['loss_mask'])
            _broadcast(batch['attention_mask'])
            _broadcast(batch['position_ids'])
        elif mpu.is_pipeline_first_stage():
            _broadcast(batch['tokens'])
            _broadcast(batch['attention_mask'])
            _broadcast(batch['position_ids'])
        elif mpu.is_pipeline_last_stage():
            _broadcast(batch['labels'])
            _broadcast(batch['loss_mask'])
            _broadcast(batch['attention_mask'])
            if mtp_on_last_stage:
                _broadcast(batch['tokens'])
                _broadcast(batch['position_ids'])
    else:
        mbs, seq = args.micro_batch_size, args.seq_length
        tokens = torch.empty((mbs, seq), dtype=torch.int64, device=device)
        labels = torch.empty((mbs, seq), dtype=torch.int64, device=device)
        loss_mask = torch.empty((mbs, seq), dtype=torch.float32, device=device)
        if args.create_attention_mask_in_dataloader:
            attention_mask = torch.empty((mbs, 1, seq, seq), dtype=torch.bool, device=device)
        else:
            attention_mask = None
        position_ids = torch.empty((mbs, seq), dtype=torch.int64, device=device)
        if args.pipeline_model_parallel_size == 1:
            _broadcast(tokens)
            _broadcast(labels)
            _broadcast(loss_mask)
            _broadcast(attention_mask)
            _broadcast(position_ids)
        elif mpu.is_pipeline_first_stage():
            labels = None
            loss_mask = None
            _broadcast(tokens)
            _broadcast(attention_mask)
            _broadcast(position_ids)
        elif mpu.is_pipeline_last_stage():
            if not mtp_on_last_stage:
                tokens = None
                position_ids = None
            _broadcast(labels)
            _broadcast(loss_mask)
            _broadcast(attention_mask)
            if mtp_on_last_stage:
                _broadcast(tokens)
                _broadcast(position_ids)
        batch = {
            'tokens': tokens,
            'labels': labels,
            'loss_mask': loss_mask,
            'attention_mask': attention_mask,
            'position_ids': position_ids,
        }
    return batch


def get_batch_on_this_cp_rank(batch):
    """Slice a micro-batch to this context parallel rank's part of the sequence.

    The sequence is viewed as 2 x cp chunks; CP rank r keeps chunks r and 2cp-1-r (in that
    order), which balances causal attention work over the ranks. tokens, labels, loss_mask and
    position_ids [b, s] are sliced along dim 1, attention_mask [b, 1, s, s] along its query rows
    (dim 2). CP ranks read the same samples; no data moves between them. Size 1: unchanged.
    """
    cp_size = mpu.get_context_parallel_world_size()
    if cp_size <= 1:
        return batch
    return core_get_batch_on_this_cp_rank(batch, cp_size, mpu.get_context_parallel_rank())


def num_floating_point_operations(args, batch_size):
    """Megatron's model FLOPs per iteration (forward + backward, no recompute) for a GPT.

    With B = batch size, s = seq length, L = layers, h = hidden, the count is
    12*B*s*L*h^2 * ( attention: (1 + groups/heads + s/h) * (kv_channels*heads/h)
                   + MLP: (ffn/h) * experts_routed_to * (3/2 if swiglu else 1)
                   + logits: V_padded / (2*L*h) ).
    """
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = query_projection_size / args.hidden_size
    num_query_groups = (
        args.num_query_groups if args.group_query_attention else args.num_attention_heads
    )
    num_experts_routed_to = 1 if args.num_experts is None else args.moe_router_topk
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1
    return (
        12
        * batch_size
        * args.seq_length
        * args.num_layers
        * args.hidden_size
        * args.hidden_size
        * (
            (
                (
                    1
                    + (num_query_groups / args.num_attention_heads)
                    + (args.seq_length / args.hidden_size)
                )
                * query_projection_to_hidden_size_ratio
            )
            + (
                (args.ffn_hidden_size / args.hidden_size)
                * num_experts_routed_to
                * gated_linear_multiplier
            )
            + (args.padded_vocab_size / (2 * args.num_layers * args.hidden_size))
        )
    )


def perplexity(loss):
    """exp(min(20, loss)), Megatron's capped perplexity."""
    return math.exp(min(20, loss))


def configure_straggler_detector(args):
    """Arm the straggler detector for --log-straggler (its lines are INFO log records)."""
    StragglerDetector().configure(
        torch.distributed.get_world_size(),
        torch.distributed.get_rank(),
        mmcnt=args.straggler_minmax_count,
        enabled=not args.disable_straggler_on_startup,
        port=args.straggler_ctrlr_port,
    )
    if not logging.getLogger().handlers:
        logging.basicConfig()
    if args.logging_level is None:
        logging.getLogger('megatron.core.utils').setLevel(logging.INFO)


def check_weight_hashes(args, iteration, model):
    """--check-weight-hash-across-dp-replicas-interval: every N iterations, all DP replicas must
    hold bit-identical weights."""
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is None or iteration % interval != 0:
        return
    if not check_param_hashes_across_dp_replicas(model):
        raise RuntimeError(
            f'Parameter hashes not matching across DP replicas at iteration {iteration}'
        )
    torch.distributed.barrier()
    print_rank_0(f'>>> Weight hashes match after {iteration} iterations...')


def empty_unused_memory(args, level):
    """Release cached CUDA blocks where Megatron does (--empty-unused-memory-level >= level).

    Level 1: after each forward-backward (training and evaluation); level 2: also after the
    optimizer step. A no-op when the model does not live on a CUDA device.
    """
    if getattr(args, 'empty_unused_memory_level', 0) >= level:
        if get_current_device().type == 'cuda':
            torch.cuda.empty_cache()
