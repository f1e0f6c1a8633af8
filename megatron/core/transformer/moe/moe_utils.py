"""Routing math, token permutation and the auxiliary-loss tracker of the MoE layer.

Notation: T tokens routed by this rank (rows of the router logits), E experts, k top-k,
h hidden size, cap the expert capacity.

- Losses: the Switch load-balancing loss (`switch_load_balancing_loss_func`), its per-sequence
  form (`sequence_load_balancing_loss_func`, DeepSeek-V3's sequence-wise loss), the z-loss
  (`z_loss_func`) and `MoEAuxLossAutoScaler`, which attaches a loss to an activation so that its
  gradient flows in the activation's backward (the loss is never added to the LM loss).
- Routing: `topk_softmax_with_capacity` (top-k, softmax or sigmoid scores, optional expert bias,
  capacity with the `probs` / `position` drop policies, pad-to-capacity) and `sinkhorn`.
- Permutation: `permute` / `unpermute` sort the routed (token, slot) pairs by expert and back.
- Tracking: every router forward adds its losses and per-expert token counts to a tracker, which
  `track_moe_metrics` reduces, logs and clears once per iteration.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.utils import get_current_device

#: Index of a (token, slot) pair dropped by the capacity (as Megatron: int64 max).
DROPPED_INDEX = torch.iinfo(torch.long).max


# ---------------------------------------------------------------------------------------------
# losses


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    topk: int,
    moe_aux_loss_coeff: float,
    sequence_partition_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss: coeff * E / (N^2 k) * sum_e n_e * sum_t p_te.

    `n_e` (the top-k counts) is summed over `sequence_partition_group`, the ranks that each hold a
    slice of the same sequence, and N = T x group size; `sum_t p_te` stays local, so each rank's
    loss is a partial and the partials add up to the loss of the whole sequence. Perfect balance
    gives coeff.

    Args:
        probs: [T, E] routing scores of every expert (fp32 softmax of the logits).
        tokens_per_expert: [E] top-k counts of this rank's tokens (not modified).
        topk: k.
        moe_aux_loss_coeff: coeff.
        sequence_partition_group: group whose ranks split the sequence (None: no split).
    """
    num_sub_sequence = 1
    tokens_per_expert = tokens_per_expert.detach().to(probs.dtype)
    if sequence_partition_group is not None and sequence_partition_group.size() > 1:
        num_sub_sequence = sequence_partition_group.size()
        tokens_per_expert = tokens_per_expert.clone()
        torch.distributed.all_reduce(tokens_per_expert, group=sequence_partition_group)
    num_tokens = probs.shape[0] * num_sub_sequence
    num_experts = probs.shape[1]
    aggregated_probs_per_expert = probs.sum(dim=0)  # [E]
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (num_tokens * num_tokens * topk)
    )


def sequence_load_balancing_loss_func(
    scores: torch.Tensor,
    batch_size: int,
    topk: int,
    moe_aux_loss_coeff: float,
    sequence_partition_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, averaged over the sequences.

    For every sequence of S tokens: f_e = E / (k S) x (tokens whose top-k of `scores` holds e),
    P_e = mean_t scores_te, loss = coeff x sum_e f_e P_e; the result is the mean over the b
    sequences. The counts come from the top-k of the unbiased scores (DeepSeek-V3's indicator):
    an expert bias or a group limit changes which experts the tokens are sent to, not f.

    The rows are this rank's slice of b sequences, in [s, b] order. Under sequence or context
    parallelism the per-sequence counts are summed over `sequence_partition_group` (all-reduce,
    no gradient) and S = s x group size, while sum_t scores_te stays local: each rank returns a
    partial and the partials add up to the loss of the whole sequences.

    Args:
        scores: [s * b, E] routing scores of every expert, normalised per token (fp32).
        batch_size: b, the sequences the rows belong to.
        topk: k.
        moe_aux_loss_coeff: coeff.
        sequence_partition_group: group whose ranks split the sequences (None: no split).
    """
    num_experts = scores.shape[1]
    scores = scores.view(-1, batch_size, num_experts)  # [s, b, E]
    with torch.no_grad():
        top = torch.topk(scores, k=topk, dim=-1).indices  # [s, b, k]
        choices = top.transpose(0, 1).reshape(batch_size, -1)  # [b, s * k]
        counts = scores.new_zeros(batch_size, num_experts).scatter_add_(
            1, choices, scores.new_ones(choices.shape)
        )  # [b, E]
        num_sub_sequence = 1
        if sequence_partition_group is not None and sequence_partition_group.size() > 1:
            num_sub_sequence = sequence_partition_group.size()
            torch.distributed.all_reduce(counts, group=sequence_partition_group)
    seq_len = scores.shape[0] * num_sub_sequence
    fraction = counts * (num_experts / (topk * seq_len))  # [b, E]
    mean_scores = scores.sum(dim=0) / seq_len  # [b, E], this rank's partial
    return torch.sum(fraction * mean_scores) * (moe_aux_loss_coeff / batch_size)


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """Router z-loss (ST-MoE): coeff * mean_t (logsumexp_e logits_te)^2 over this rank's tokens
    (in fp32 at least)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_loss_coeff


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Attach an auxiliary loss to an activation: forward is the identity on the activation; in
    backward the loss receives the gradient `main_loss_backward_scale` (the loss scale divided
    by the number of micro-batches, set by the schedule after every forward), as if it had been
    added to the main loss."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scaled_aux_loss_grad = torch.ones_like(aux_loss)
        else:
            scaled_aux_loss_grad = torch.ones_like(aux_loss) * scale.to(aux_loss.device)
        return grad_output, scaled_aux_loss_grad

    @staticmethod
    def set_loss_scale(scale: torch.Tensor):
        """The gradient the auxiliary losses receive in the next backward passes."""
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale


# ---------------------------------------------------------------------------------------------
# routing


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Sinkhorn balancing of exp(cost) [T, E] to uniform row (1/T) and column (1/E) marginals."""
    weights = torch.exp(cost)
    num_rows, num_cols = weights.shape
    eps = 0.00000001
    # Alternately rescale rows and columns (scaling vectors r [T] and c [E]) until c settles.
    col_scale = torch.ones(num_cols, device=weights.device, dtype=weights.dtype)
    while True:
        row_scale = (1 / num_rows) / (torch.sum(col_scale * weights, 1) + eps)
        new_col_scale = (1 / num_cols) / (torch.sum(row_scale.unsqueeze(1) * weights, 0) + eps)
        change = torch.mean(torch.abs(col_scale - new_col_scale))
        col_scale = new_col_scale
        if not change > tol:
            break
    return col_scale * weights * row_scale.unsqueeze(1)  # [T, E]


def get_capacity(
    num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None
) -> int:
    """Expert capacity: ceil(num_tokens / num_experts * capacity_factor) (num_tokens = T * k)."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def group_limited_selection(
    selection: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> torch.Tensor:
    """Keep the experts of each token's `group_topk` best groups, -inf elsewhere.

    A group's score is the sum of its topk / group_topk highest selection scores (DeepSeek-V3:
    the top 2 of each of 8 groups, 4 groups kept).

    Args:
        selection: [T, E] the scores the top-k is taken over.

    Returns:
        [T, E] selection scores with the experts of the other groups at -inf.
    """
    num_tokens, num_experts = selection.shape
    grouped = selection.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E/G]
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    chosen = torch.topk(group_scores, k=group_topk, dim=-1).indices  # [T, group_topk]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)  # [T, G]
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)  # [T, E]
    return selection.masked_fill(~keep, float("-inf"))


def _topk(
    scores: torch.Tensor,
    topk: int,
    expert_bias: Optional[torch.Tensor],
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
):
    """(values of `scores`, indices) of the top-k per row; with an expert bias the selection
    uses scores + bias, the values stay unbiased (aux-loss-free balancing); with groups the
    selection is limited to each row's best groups (`group_limited_selection`)."""
    if expert_bias is None and num_groups is None:
        return torch.topk(scores, k=topk, dim=1)
    selection = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    if num_groups is not None:
        selection = group_limited_selection(selection, topk, num_groups, group_topk)
    _, indices = torch.topk(selection, k=topk, dim=1)
    return torch.gather(scores, 1, indices), indices


def count_tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] number of (token, slot) pairs routed to each expert; dropped pairs are not counted."""
    flat = indices.reshape(-1)
    flat = flat[flat != DROPPED_INDEX]
    return torch.bincount(flat, minlength=num_experts)


def topk_softmax_with_capacity(
    logits: torch.Tensor,
    topk: int,
    capacity_factor: Optional[float] = None,
    pad_to_capacity: bool = False,
    drop_policy: str = "probs",
    use_pre_softmax: bool = False,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    scaling_factor: Optional[float] = None,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing with optional capacity.

    Scores:
      - softmax (default): top-k of the raw logits, then the softmax over those k (fp32, cast
        back); equals "softmax over E, top-k, renormalize" (Hugging Face's Mixtral routing);
      - softmax with `use_pre_softmax`: softmax over E, then top-k, not renormalized;
      - sigmoid: sigmoid of the logits, top-k, renormalized over the k when k > 1.
    With `expert_bias` the top-k selection uses score + bias; the probs stay unbiased. With
    `num_groups` / `group_topk` each token selects only among the experts of its best groups.

    Capacity (`capacity_factor` set): cap = ceil(T k / E x factor) slots per expert. The `probs`
    policy keeps each expert's cap highest routing probs, `position` its cap earliest tokens.
    Without padding, a dropped (token, slot) gets prob 0 and index DROPPED_INDEX; with
    `pad_to_capacity` the result is per expert: [E, cap] token ids (ascending) and probs, filler
    slots holding prob 0. A capacity above T drops nothing.

    Args:
        logits: [T, E].

    Returns:
        (probs, indices, tokens_per_expert): probs and indices [T, k] (or [E, cap] when padded);
        tokens_per_expert [E] counts the top-k choices before any drop.
    """
    if logits.dim() != 2:
        raise ValueError(f"expected logits of shape [T, E], got {tuple(logits.shape)}")
    num_tokens, num_experts = logits.shape
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = _topk(scores, topk, expert_bias, num_groups, group_topk)
        else:
            top_logits, top_indices = _topk(logits, topk, expert_bias, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        probs, top_indices = _topk(scores, topk, expert_bias, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"Unsupported MoE router score function: {score_function}")
    if scaling_factor is not None:
        probs = probs * scaling_factor

    tokens_per_expert = torch.bincount(top_indices.view(-1), minlength=num_experts)
    if capacity_factor is None:
        return probs, top_indices, tokens_per_expert

    capacity = get_capacity(num_tokens * topk, num_experts, capacity_factor)
    topk_masked_gates = torch.zeros_like(logits).scatter(1, top_indices, probs)  # [T, E]
    topk_mask = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    if drop_policy == "probs":
        keep_scores = topk_masked_gates.float()
    elif drop_policy == "position":
        # Earlier tokens score higher; unchosen pairs score 0 (deterministic, earliest first).
        order = torch.arange(num_tokens, 0, -1, device=logits.device, dtype=torch.float32)
        keep_scores = topk_mask.float() * order.unsqueeze(1)
    else:
        raise ValueError(f"Invalid drop_policy: {drop_policy}")
    kept = min(capacity, num_tokens)
    _, capacity_indices = torch.topk(keep_scores, k=kept, dim=0)  # [kept, E]
    capacity_indices, _ = torch.sort(capacity_indices, dim=0)
    capacity_mask = torch.zeros_like(topk_mask).scatter(0, capacity_indices, True)

    if pad_to_capacity:
        # Slots of a column beyond its chosen tokens hold unchosen tokens, whose gate is 0.
        capacity_probs = torch.gather(topk_masked_gates, 0, capacity_indices)  # [kept, E]
        if kept < capacity:
            # More slots than tokens: filler slots of token 0 with prob 0.
            pad = capacity - kept
            capacity_probs = torch.cat([capacity_probs, capacity_probs.new_zeros(pad, num_experts)])
            capacity_indices = torch.cat(
                [capacity_indices, capacity_indices.new_zeros(pad, num_experts)]
            )
        return capacity_probs.T.contiguous(), capacity_indices.T.contiguous(), tokens_per_expert

    final_mask = torch.logical_and(topk_mask, capacity_mask)
    exceed_mask = torch.gather(torch.logical_not(final_mask), 1, top_indices)  # [T, k]
    final_probs = probs * torch.logical_not(exceed_mask)
    final_indices = top_indices.clone().masked_fill_(exceed_mask, DROPPED_INDEX)
    return final_probs, final_indices, tokens_per_expert


# ---------------------------------------------------------------------------------------------
# permutation


def pair_rows_inverse(pairs: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """[T k] row of each (token, slot) pair in a row list built from `pairs` (the flat pair index
    of each row), or len(pairs) for pairs not in the list."""
    row_of_pair = torch.full((num_pairs,), pairs.numel(), dtype=torch.long, device=pairs.device)
    row_of_pair[pairs] = torch.arange(pairs.numel(), device=pairs.device)
    return row_of_pair


def _sum_pairs(rows: torch.Tensor, row_of_pair: torch.Tensor, num_tokens: int, topk: int):
    """out[t] = sum over slots j of rows[row_of_pair[t k + j]] (a missing pair adds 0), summed
    in slot order: [N, h] -> [T, h]."""
    if rows.shape[0] < row_of_pair.numel():
        # Some pairs have no row: they read an appended row of zeros.
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])  # [N + 1, h]
    return rows.index_select(0, row_of_pair).view(num_tokens, topk, -1).sum(dim=1)


class GatherPairRows(torch.autograd.Function):
    """rows = tokens[token_of_row] ([T, h] -> [N, h]); backward sums each token's rows back
    through the inverse map with gathers (no scatter-add, which is slow on the CPU)."""

    @staticmethod
    def forward(ctx, tokens, token_of_row, row_of_pair, topk):
        ctx.save_for_backward(row_of_pair)
        ctx.num_tokens, ctx.topk = tokens.shape[0], topk
        return tokens.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_rows):
        (row_of_pair,) = ctx.saved_tensors
        grad = _sum_pairs(grad_rows.contiguous(), row_of_pair, ctx.num_tokens, ctx.topk)
        return grad, None, None, None


class CombinePairRows(torch.autograd.Function):
    """The inverse direction: [N, h] rows -> [T, h], each token the sum of its rows in slot
    order; backward gathers each row's token gradient."""

    @staticmethod
    def forward(ctx, rows, token_of_row, row_of_pair, num_tokens, topk):
        ctx.save_for_backward(token_of_row)
        return _sum_pairs(rows, row_of_pair, num_tokens, topk)

    @staticmethod
    def backward(ctx, grad_out):
        (token_of_row,) = ctx.saved_tensors
        return grad_out.contiguous().index_select(0, token_of_row), None, None, None, None


def permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    num_out_tokens: Optional[int] = None,
    padded_mode: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows of `tokens` ordered by expert.

    The (token, slot) pairs are flattened row-major (pair t * k + j) and stable-sorted by expert
    id, so within an expert the order is token, then slot; dropped pairs (DROPPED_INDEX) sort last
    and are cut by `num_out_tokens`. In padded mode `indices` is the [E, cap] token table and
    the rows are taken in that order.

    Args:
        tokens: [T, h].
        indices: [T, k] expert ids (or [E, cap] token ids in padded mode).
        num_out_tokens: keep only the first rows (the kept pairs).

    Returns:
        (permuted [N, h], sorted_indices [N]: flat pair index of each row; in padded mode the
        token ids).
    """
    if padded_mode:
        sorted_indices = indices.reshape(-1)
        return tokens.index_select(0, sorted_indices), sorted_indices
    topk = indices.size(1) if indices.dim() > 1 else 1
    flatten_indices = indices.reshape(-1)
    sorted_indices = torch.argsort(flatten_indices, stable=True)
    if num_out_tokens is not None:
        sorted_indices = sorted_indices[:num_out_tokens]
    token_of_row = torch.div(sorted_indices, topk, rounding_mode="floor")
    row_of_pair = pair_rows_inverse(sorted_indices, flatten_indices.numel())
    permuted_tokens = GatherPairRows.apply(tokens, token_of_row, row_of_pair, topk)
    return permuted_tokens, sorted_indices


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor,
    padded_mode: bool = False,
    restore_shape: Optional[torch.Size] = None,
) -> torch.Tensor:
    """Inverse of `permute`, weighting each row by its routing prob and summing a token's slots.

    Non-padded: rows go back to their (token, slot) position ([T k, h], dropped pairs stay 0),
    are multiplied by probs [T, k] and summed over the k slots in slot order. Padded: prob x row
    is added into the token's row of zeros `restore_shape`.

    Returns:
        [T, h].
    """
    if padded_mode:
        weighted = permuted_tokens * probs.reshape(-1, 1).to(permuted_tokens.dtype)
        out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
        return out.index_add(0, sorted_indices, weighted)
    num_tokens, topk = probs.shape[0], (probs.size(1) if probs.dim() > 1 else 1)
    hidden = permuted_tokens.shape[-1]
    unpermuted = torch.zeros(
        num_tokens * topk, hidden, dtype=permuted_tokens.dtype, device=permuted_tokens.device
    )
    unpermuted = unpermuted.index_copy(0, sorted_indices, permuted_tokens)
    unpermuted = unpermuted.reshape(num_tokens, topk, hidden)  # [T, k, h]
    unpermuted = unpermuted * probs.reshape(num_tokens, topk, 1).to(unpermuted.dtype)
    return unpermuted.sum(dim=1)


# ---------------------------------------------------------------------------------------------
# tracker (per-layer losses and expert loads, reduced and logged once per iteration)

#: name -> {'values': [num_layers] or [num_layers, E], 'reduce_group', 'avg_group'}.
_MOE_LAYER_WISE_LOGGING_TRACKER: Dict[str, dict] = {}

#: Name of the per-expert token-count entry (2-D values: [num_layers, E]).
EXPERT_LOAD = "tokens_per_expert"


def _tracker_order(name: str):
    """Deterministic order on every rank; z_loss before load_balancing_loss, as Megatron logs
    them (z_loss is computed first)."""
    order = {"z_loss": 0, "load_balancing_loss": 1, "seq_load_balancing_loss": 2}
    return (order.get(name, 3), name)


def get_moe_layer_wise_logging_tracker() -> Dict[str, dict]:
    """The tracker dict (Megatron keeps it in parallel_state; the content is the same)."""
    return _MOE_LAYER_WISE_LOGGING_TRACKER


def is_recomputing() -> bool:
    """True while activation recomputation re-runs a forward inside backward.

    The recomputed forward must not record its losses or counts a second time (Megatron r0.8
    counts recomputed layers twice).
    """
    return torch._C._current_graph_task_id() != -1


def save_to_aux_losses_tracker(
    name: str,
    loss: torch.Tensor,
    layer_number: Optional[int],
    num_layers: int,
    reduce_group: Optional[torch.distributed.ProcessGroup] = None,
    avg_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Add `loss` (detached) to entry `name` at layer `layer_number` (1-based); summed over
    micro-batches until `track_moe_metrics` clears it. Skipped without a layer number, for the
    multi-token-prediction layers (numbered after the decoder's) and during recomputation.

    Args:
        loss: a scalar, or a [E] vector (expert loads).
        reduce_group: at log time the values are summed over this group.
        avg_group: at log time the values are averaged over this group.
    """
    if layer_number is None or layer_number > num_layers or is_recomputing():
        return
    tracker = _MOE_LAYER_WISE_LOGGING_TRACKER
    shape = (num_layers,) + tuple(loss.shape)
    if name not in tracker or tuple(tracker[name]["values"].shape) != shape:
        tracker[name] = {"values": torch.zeros(shape, device=loss.device, dtype=torch.float32)}
    tracker[name]["values"][layer_number - 1] += loss.detach().float()
    tracker[name]["reduce_group"] = reduce_group
    tracker[name]["avg_group"] = avg_group


def clear_aux_losses_tracker():
    """Zero every entry's values and forget its groups (the next record sets them again)."""
    for entry in _MOE_LAYER_WISE_LOGGING_TRACKER.values():
        entry["values"].zero_()
        entry["reduce_group"] = None
        entry["avg_group"] = None


def reset_aux_losses_tracker():
    """Forget every entry (a new model may have other layers or groups)."""
    _MOE_LAYER_WISE_LOGGING_TRACKER.clear()


def reduce_aux_losses_tracker_across_ranks(
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
    dp_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Sum every entry over the pipeline stages (each holds its own layers), then over its
    reduce group, then average it over its avg group and over `dp_group` (the data-parallel
    replicas). Every rank must call it with the same entries (see `track_moe_metrics`)."""
    for name in sorted(_MOE_LAYER_WISE_LOGGING_TRACKER, key=_tracker_order):
        entry = _MOE_LAYER_WISE_LOGGING_TRACKER[name]
        values = entry["values"]
        if pp_group is not None and pp_group.size() > 1:
            torch.distributed.all_reduce(values, group=pp_group)
        for key, op in (("reduce_group", "sum"), ("avg_group", "avg")):
            group = entry.get(key)
            if group is not None and group.size() > 1:
                torch.distributed.all_reduce(values, group=group)
                if op == "avg":
                    values /= group.size()
        if dp_group is not None and dp_group.size() > 1:
            torch.distributed.all_reduce(values, group=dp_group)
            if name != EXPERT_LOAD:
                values /= dp_group.size()


def track_moe_metrics(
    loss_scale: float,
    iteration: int,
    writer=None,
    total_loss_dict: Optional[dict] = None,
    per_layer_logging: bool = False,
    expected_entries: Optional[Dict[str, dict]] = None,
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
    dp_group: Optional[torch.distributed.ProcessGroup] = None,
    log_expert_load: bool = True,
) -> Dict[str, float]:
    """Reduce the tracker, write it to TensorBoard, add it to the log line, clear it.

    For each loss (`load_balancing_loss`, `seq_load_balancing_loss`, `z_loss`): values x
    loss_scale (1/num_microbatches), the mean over all layers goes to TensorBoard under its name
    and into `total_loss_dict`; with `per_layer_logging` also `moe/{name}_layer_{i}`. The expert
    loads go to TensorBoard as `moe/tokens_per_expert_fraction/layer_{i}/expert_{e}` (each
    expert's share of the layer's routed tokens) and `moe/max_expert_fraction/layer_{i}`.

    Collectives: every rank must call this each iteration with the same `expected_entries`
    ({name: values shape}); an entry a rank did not record (a pipeline stage without MoE layers,
    whose tensor- and data-parallel peers hold none either) is created as zeros first, so the
    pipeline all-reduce matches.

    Returns:
        {name: mean over layers} for the losses.
    """
    tracker = _MOE_LAYER_WISE_LOGGING_TRACKER
    if expected_entries is not None:
        for name in [n for n in tracker if n not in expected_entries]:
            del tracker[name]  # left over from another model
        for name, shape in expected_entries.items():
            if name not in tracker or tuple(tracker[name]["values"].shape) != tuple(shape):
                values = torch.zeros(shape, dtype=torch.float32, device=get_current_device())
                tracker[name] = {"values": values, "reduce_group": None, "avg_group": None}
    reduce_aux_losses_tracker_across_ranks(pp_group, dp_group)

    means = {}
    for name in sorted(tracker, key=_tracker_order):
        values = tracker[name]["values"]
        if name == EXPERT_LOAD:
            if writer is not None and log_expert_load:
                _write_expert_load(writer, values, iteration)
            continue
        loss_list = values * loss_scale
        mean = loss_list.mean().item()
        means[name] = mean
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict.get(name, 0.0) + mean
        if writer is not None:
            writer.add_scalar(name, mean, iteration)
            if per_layer_logging:
                for i, loss in enumerate(loss_list.tolist()):
                    writer.add_scalar(f"moe/{name}_layer_{i}", loss, iteration)
    clear_aux_losses_tracker()
    return means


def _write_expert_load(writer, counts: torch.Tensor, iteration: int):
    """Each expert's share of every MoE layer's routed tokens (layers without tokens skipped)."""
    totals = counts.sum(dim=-1)
    for layer, total in enumerate(totals.tolist()):
        if total <= 0:
            continue
        fractions = (counts[layer] / total).tolist()
        for expert, fraction in enumerate(fractions):
            writer.add_scalar(
                f"moe/tokens_per_expert_fraction/layer_{layer}/expert_{expert}", fraction, iteration
            )
        writer.add_scalar(f"moe/max_expert_fraction/layer_{layer}", max(fractions), iteration)


#: Tracker name of each load-balancing type that adds a loss.
_BALANCE_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def expert_metric_names(config) -> List[str]:
    """Names of the tracker entries a model with this config records, in tracker order."""
    names = []
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    name = _BALANCE_LOSS_NAMES.get(config.moe_router_load_balancing_type)
    if name is not None:
        names.append(name)
    return names
