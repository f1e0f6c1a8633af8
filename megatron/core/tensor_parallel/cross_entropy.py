"""Cross entropy over logits whose vocabulary dimension is split across tensor parallel ranks.

Shapes: logits [s, b, v/tp] (rank r holds vocabulary entries [r * v/tp, (r + 1) * v/tp)),
target [s, b] with global token ids, loss [s, b]. No rank ever materializes the full [s, b, v].
"""

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Vocab-parallel softmax cross entropy.

    Forward (three all-reduces over the tp group, on [s, b] tensors only):
      1. max of the logits (MAX) for a stable softmax;
      2. the target's logit (SUM; only the rank owning the target id contributes);
      3. the softmax denominator sum(exp) (SUM);
      plus, with label smoothing, the sum of log-probabilities (SUM).
    Backward: local only, grad = softmax - (1 - eps) * onehot(target) - eps / v, scaled by the
    incoming [s, b] gradient.

    Label smoothing follows Megatron: the smoothing mass `label_smoothing` goes to the v - 1
    non-target classes, i.e. loss = (1 - eps) * nll + eps * mean_j(-log p_j) with
    eps = label_smoothing * v / (v - 1). The mean runs over the whole (global) vocabulary.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, group=None):
        # Fall back to the global tensor model parallel group when none is given.
        group = parallel_state.get_tensor_model_parallel_group_if_none(group)
        rank, world_size = group.rank(), group.size()
        if label_smoothing > 0 and not label_smoothing < 1.0:
            raise ValueError(f'label_smoothing must be in [0, 1), got {label_smoothing}')

        # Stable softmax: subtract the global max (out of place: the caller keeps its logits).
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]  # [s, b]
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        logits = vocab_parallel_logits.float() - logits_max.float().unsqueeze(
            dim=-1
        )  # [s, b, v/tp]

        partition_vocab_size = logits.size()[-1]
        vocab_start_index, vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world_size
        )
        # Targets outside this rank's slice contribute 0 to the target logit.
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)  # [s, b]
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0

        logits_2d = logits.view(-1, partition_vocab_size)  # [s * b, v/tp]
        masked_target_1d = masked_target.view(-1)  # [s * b]
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits = predicted_logits_1d.clone().contiguous().view_as(target)  # [s, b]
        predicted_logits[target_mask] = 0.0
        torch.distributed.all_reduce(
            predicted_logits, op=torch.distributed.ReduceOp.SUM, group=group
        )

        # Label smoothing needs sum_j z_j; take it before exp overwrites the logits in place (the
        # logits tensor is this function's own copy, and one vocab-sized buffer fewer matters).
        sum_logits = logits.sum(dim=-1) if label_smoothing > 0 else None  # [s, b]
        exp_logits = torch.exp(logits, out=logits)  # [s, b, v/tp]
        sum_exp_logits = exp_logits.sum(dim=-1)  # [s, b]
        torch.distributed.all_reduce(sum_exp_logits, op=torch.distributed.ReduceOp.SUM, group=group)

        # loss = log(sum_j exp(z_j)) - z_target
        loss = torch.log(sum_exp_logits) - predicted_logits  # [s, b]

        # Normalize in place: exp_logits becomes the softmax, saved for backward.
        exp_logits.div_(sum_exp_logits.unsqueeze(dim=-1))

        vocab_size = partition_vocab_size * world_size
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # log p_j = z_j - log(sum exp); sum over the whole vocabulary.
            sum_log_probs = sum_logits - partition_vocab_size * torch.log(sum_exp_logits)
            sum_log_probs = sum_log_probs.contiguous()
            torch.distributed.all_reduce(
                sum_log_probs, op=torch.distributed.ReduceOp.SUM, group=group
            )
            mean_log_probs = sum_log_probs / vocab_size  # [s, b]
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.label_smoothing, ctx.smoothing, ctx.vocab_size = label_smoothing, smoothing, vocab_size
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax  # reused in place: [s, b, v/tp]
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)  # [s * b, v/tp]
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        # 1 where this rank owns the target id, else 0.
        softmax_update = 1.0 - target_mask.view(-1).float()
        if ctx.smoothing > 0:
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - ctx.smoothing) * softmax_update
            grad_2d -= ctx.smoothing / ctx.vocab_size
        else:
            grad_2d[arange_1d, masked_target_1d] -= softmax_update
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, group=None):
    """Per-token cross entropy of vocab-parallel logits.

    Args:
        vocab_parallel_logits: [s, b, v/tp] logits, this rank's vocabulary slice (any float
            dtype; computed in fp32).
        target: [s, b] global token ids.
        label_smoothing: Megatron label smoothing (see _VocabParallelCrossEntropy).
        group: tensor parallel group (default: the global one).

    Returns:
        [s, b] fp32 loss, identical on every tp rank.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)
