"""Cross entropy over logits whose vocabulary dimension is split across tensor parallel ranks.

Shapes: logits [s, b, v/tp] (rank r holds vocabulary entries [r * v/tp, (r + 1) * v/tp)),
target [s, b] with global token ids, loss [s, b]. No rank ever materializes the full [s, b, v].
"""

import torch

from megatron.core import group_fallbacks
from megatron.core.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Vocab-parallel softmax cross entropy.

    Each rank first takes the softmax and log-sum-exp of its own vocabulary slice, with torch's
    fused row-wise softmax kernel (no separate subtract / exp / divide passes; written over fp32
    logits with `inplace`, else into one new [s, b, v/tp] buffer). The slices are then combined
    on [s, b] tensors only.

    Forward (three all-reduces over the tp group, on [s, b] tensors only):
      1. max of the local log-sum-exps (MAX), for a stable global log-sum-exp;
      2. the rescaled local softmax denominators (SUM): lse = m + log(sum_r exp(lse_r - m));
      3. the target's logit (SUM; only the rank owning the target id contributes);
      plus, with label smoothing, the sum of log-probabilities (SUM).
    Backward: local only, grad = softmax - (1 - eps) * onehot(target) - eps / v, scaled by the
    incoming [s, b] gradient. The global softmax is the local one times exp(lse_r - lse); that
    [s, b] factor is folded into the scaling by the incoming gradient (one pass, in place).

    Label smoothing follows Megatron: the smoothing mass `label_smoothing` goes to the v - 1
    non-target classes, i.e. loss = (1 - eps) * nll + eps * mean_j(-log p_j) with
    eps = label_smoothing * v / (v - 1). The mean runs over the whole (global) vocabulary.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0, group=None, inplace=False):
        # Fall back to the global tensor model parallel group when none is given.
        group = group_fallbacks.get_tensor_model_parallel_group_if_none(group)
        rank, world_size = group.rank(), group.size()
        if label_smoothing > 0 and not label_smoothing < 1.0:
            raise ValueError(f'label_smoothing must be in [0, 1), got {label_smoothing}')
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)  # [s * b, v/tp]
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)

        vocab_start_index, vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, rank, world_size
        )
        # Targets outside this rank's slice contribute 0 to the target logit.
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)  # [s, b]
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        masked_target_1d = masked_target.view(-1)  # [s * b]
        # Everything read from the logits is read before the softmax may overwrite them.
        predicted_logits = logits_2d[arange_1d, masked_target_1d].float().view_as(target)  # [s, b]
        predicted_logits[target_mask] = 0.0
        local_max = logits_2d.amax(dim=-1).float()  # [s * b]
        sum_logits = logits_2d.float().sum(dim=-1) if label_smoothing > 0 else None  # [s * b]

        # Local softmax, in the caller's fp32 buffer when it allows (no new vocab-sized buffer,
        # whose first touch costs more than the softmax itself on the CPU).
        if inplace and vocab_parallel_logits.dtype == torch.float32:
            softmax = torch.softmax(logits_2d, dim=-1, out=logits_2d)
        else:
            softmax = torch.softmax(logits_2d, dim=-1, dtype=torch.float32)
        # A fresh view, saved for backward (which scales it in place): saving `logits_2d` itself,
        # the view made above, trips autograd's view / in-place check inside the model.
        softmax_2d = softmax.view(-1, partition_vocab_size)  # [s * b, v/tp]
        # The row's largest softmax entry is at its largest logit, exp(0) / sum_j exp(z_j - max):
        # so lse_r = max - log(max softmax), with no underflow (that entry is >= tp / v).
        local_lse = local_max - torch.log(softmax_2d.amax(dim=-1))  # [s * b]

        global_max = local_lse.clone()
        torch.distributed.all_reduce(global_max, op=torch.distributed.ReduceOp.MAX, group=group)
        sum_exp = torch.exp(local_lse - global_max)  # [s * b]
        torch.distributed.all_reduce(sum_exp, op=torch.distributed.ReduceOp.SUM, group=group)
        lse = global_max + torch.log(sum_exp)  # [s * b]; equals local_lse exactly when tp == 1
        local_scale = torch.exp(local_lse - lse)  # [s * b]: global softmax / local softmax

        torch.distributed.all_reduce(
            predicted_logits, op=torch.distributed.ReduceOp.SUM, group=group
        )

        # loss = log(sum_j exp(z_j)) - z_target
        loss = lse.view_as(target) - predicted_logits  # [s, b]

        vocab_size = partition_vocab_size * world_size
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            # log p_j = z_j - lse; summed over the whole vocabulary.
            sum_log_probs = (sum_logits - partition_vocab_size * lse).view_as(target).contiguous()
            torch.distributed.all_reduce(
                sum_log_probs, op=torch.distributed.ReduceOp.SUM, group=group
            )
            mean_log_probs = sum_log_probs / vocab_size  # [s, b]
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        ctx.label_smoothing, ctx.smoothing, ctx.vocab_size = label_smoothing, smoothing, vocab_size
        ctx.logits_shape = vocab_parallel_logits.shape
        ctx.save_for_backward(softmax_2d, local_scale, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        # The saved softmax becomes the gradient in place: [s * b, v/tp].
        grad_2d, local_scale, target_mask, masked_target_1d = ctx.saved_tensors
        grad_1d = grad_output.reshape(-1).float()  # [s * b]
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        # Local softmax -> global softmax, times the incoming gradient: one in-place pass.
        grad_2d.mul_((local_scale * grad_1d).unsqueeze(dim=-1))
        # Only the rank owning the target id subtracts the one-hot.
        onehot_grad = (1.0 - target_mask.view(-1).float()) * grad_1d  # [s * b]
        if ctx.smoothing > 0:
            grad_2d[arange_1d, masked_target_1d] -= (1.0 - ctx.smoothing) * onehot_grad
            grad_2d -= (ctx.smoothing / ctx.vocab_size) * grad_1d.unsqueeze(dim=-1)
        else:
            grad_2d[arange_1d, masked_target_1d] -= onehot_grad
        return grad_2d.view(ctx.logits_shape), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits, target, label_smoothing=0.0, group=None, inplace=False
):
    """Per-token cross entropy of vocab-parallel logits.

    Args:
        vocab_parallel_logits: [s, b, v/tp] contiguous logits, this rank's vocabulary slice (any
            float dtype; computed in fp32).
        target: [s, b] global token ids.
        label_smoothing: Megatron label smoothing (see _VocabParallelCrossEntropy).
        group: tensor parallel group (default: the global one).
        inplace: fp32 logits may be overwritten with the softmax, saving one vocab-sized buffer,
            as Megatron's own cross entropy overwrites them. The model's loss does this with
            logits no one else reads; by default the caller's logits are left as they were.

    Returns:
        [s, b] fp32 loss, identical on every tp rank.
    """
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, label_smoothing, group, inplace
    )
