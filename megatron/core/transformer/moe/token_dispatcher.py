"""Token dispatchers: move each routed (token, slot) pair to the rank holding its expert and the
expert outputs back.

Notation: T tokens of this rank, k top-k, h hidden size, tp / ep tensor / expert parallel sizes,
nle local experts per rank, N rows handed to the local experts.

Both dispatchers hand the local experts the same rows in the same order: expert-major, then the
source rank (in expert-parallel rank order), then token, then slot. With tp = 1 and k <= 2 the
two therefore give bit-identical outputs and gradients (a token's two weighted expert outputs
are added exactly once, in either order, which is exact).
"""

from typing import List, Optional, Tuple

import torch

from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    gather_from_sequence_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_utils import (
    CombinePairRows,
    GatherPairRows,
    count_tokens_per_expert,
    pair_rows_inverse,
    permute,
    unpermute,
)
from megatron.core.transformer.transformer_config import TransformerConfig


class MoETokenDispatcher:
    """Base of the dispatchers: the config and the resolved tp / ep / tp x ep groups.

    Args:
        config (TransformerConfig): the model config.
        pg_collection (ProcessGroupCollection, optional): tp, ep and tp_ep groups (None fields:
            the global ones).
    """

    def __init__(
        self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None
    ) -> None:
        self.config = config
        self.pg_collection = resolve_process_groups(pg_collection, ("tp", "ep", "tp_ep"))
        self.tp_group = self.pg_collection.tp
        self.ep_group = self.pg_collection.ep
        self.tp_ep_group = self.pg_collection.tp_ep
        self.tp_size = self.tp_group.size()
        self.ep_size = self.ep_group.size()

    def token_permutation(self, tokens: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        """[s, b, h] hidden states -> (local experts' input rows [N, h], rows per local expert
        (a CPU tensor [nle]))."""
        raise NotImplementedError

    def token_unpermutation(self, expert_output: torch.Tensor, bias: torch.Tensor = None):
        """Local experts' output rows [N, h] -> ([s, b, h] weighted sum per token, None)."""
        raise NotImplementedError


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather dispatcher: every rank of the tp x ep group sees every token of the group.

    Forward: the hidden states [T, h], probs and expert ids of the tp x ep group are all-gathered
    ([T x tp x ep, h]; backward: reduce-scatter, which sums the gradients the tp ranks' expert
    shards and the ep ranks' experts produce); each rank picks the pairs routed to its experts.
    Unpermutation: each token's outputs x probs are summed (slot order; pairs of other ranks'
    experts add 0) into [T x tp x ep, h] and the result is reduce-scattered over tp x ep, which
    sums the tp partials of the experts' second linear layer and the other ep ranks' experts
    ([T, h]; backward: all-gather). Memory grows with tp x ep.

    Args:
        num_local_experts: nle.
        local_expert_indices: the global ids of this rank's experts (contiguous).
        config, pg_collection: see MoETokenDispatcher.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        if num_local_experts <= 0:
            raise ValueError(f"Expected at least one expert, got {num_local_experts}")
        self.local_expert_indices = local_expert_indices
        self.local_start = local_expert_indices[0]
        self.router_topk = config.moe_router_topk

    def token_permutation(
        self, hidden_states: torch.Tensor, max_prob: torch.Tensor, max_ind: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])  # [T, h]
        group = self.tp_ep_group
        if group.size() > 1:
            with torch.no_grad():
                global_indices = _gather_along_first_dim(max_ind, group)  # [T * tp * ep, k]
            # Backward of both gathers: reduce-scatter over tp x ep.
            global_probs = gather_from_sequence_parallel_region(max_prob, group=group)
            global_hidden = gather_from_sequence_parallel_region(hidden_states, group=group)
        else:
            global_indices, global_probs, global_hidden = max_ind, max_prob, hidden_states
        self.num_global_tokens, topk = global_indices.shape[0], global_indices.shape[-1]

        flat = global_indices.reshape(-1)  # pair t * k + j
        every_pair_local = (
            self.num_local_experts == self.config.num_moe_experts
            and self.config.moe_expert_capacity_factor is None
        )
        if every_pair_local:
            # All experts are here and no pair is dropped (DROPPED_INDEX): every pair stays.
            local_ids = flat
            self.pairs = torch.argsort(local_ids, stable=True)
        else:
            local_end = self.local_start + self.num_local_experts
            selected = torch.nonzero((flat >= self.local_start) & (flat < local_end)).squeeze(1)
            local_ids = flat.index_select(0, selected) - self.local_start
            order = torch.argsort(local_ids, stable=True)
            self.pairs = selected.index_select(0, order)
        # self.pairs: the pairs of my experts, expert-major, then (rank, token, slot) order.
        self.token_rows = torch.div(self.pairs, topk, rounding_mode="floor")
        self.row_of_pair = pair_rows_inverse(self.pairs, flat.numel())
        self.topk = topk
        self.global_probs = global_probs
        tokens_per_expert = torch.bincount(local_ids, minlength=self.num_local_experts)
        permuted = GatherPairRows.apply(
            global_hidden, self.token_rows, self.row_of_pair, topk
        )  # [N, h]
        return permuted, tokens_per_expert.cpu()

    def token_unpermutation(
        self, hidden_states: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, None]:
        if bias is not None:
            raise ValueError("the experts add their bias themselves; got a separate bias")
        probs = self.global_probs.reshape(-1).index_select(0, self.pairs)  # [N]
        weighted = hidden_states * probs.unsqueeze(1).to(hidden_states.dtype)
        # Each token's rows summed in slot order (a pair of another rank's expert adds 0).
        output = CombinePairRows.apply(
            weighted, self.token_rows, self.row_of_pair, self.num_global_tokens, self.topk
        )  # [T * tp * ep, h]
        if self.tp_ep_group.size() > 1:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.tp_ep_group)
        self.global_probs = None
        return output.view(self.hidden_shape), None


def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: List[int], sorted_idxs: List[int]):
    """Split `input` along dim 0 into chunks of `split_sizes` and concatenate them in the order
    `sorted_idxs`."""
    chunks = torch.split(input, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """All-to-all dispatcher: each pair travels once, to the ep rank of its expert.

    Forward:
      1. tp > 1: all-to-all over tp, [T, h] -> [T x tp, h / tp] (every tp rank then holds the
         tokens of its whole tp group, one hidden slice; the router gathered the logits alike);
      2. `permute` by expert (stable);
      3. all-to-all-v over ep (the received rows are source-rank-major, then local expert);
      4. nle > 1: reorder to local-expert-major;
      5. tp > 1: all-gather along the hidden dim over tp, so the experts see full rows.
    Unpermutation mirrors it (reduce-scatter along the hidden dim over tp, which sums the tp
    partials of the experts' second linear layer; reverse reorder; reverse all-to-all; `unpermute`
    with the probs; all-to-all back to [T, h]). Each collective's backward is its mirror.
    Capacity: dropped pairs are not sent; with pad-to-capacity every expert receives exactly
    capacity rows from each ep rank.

    Args:
        num_local_experts: nle.
        local_expert_indices: the global ids of this rank's experts (contiguous).
        config, pg_collection: see MoETokenDispatcher.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.num_experts = config.num_moe_experts
        if num_local_experts <= 0:
            raise ValueError(f"Expected at least one expert, got {num_local_experts}")
        self.local_expert_indices = local_expert_indices
        if len(local_expert_indices) != num_local_experts:
            raise ValueError("Invalid local expert indices")
        for i in range(len(local_expert_indices) - 1):
            if local_expert_indices[i] != local_expert_indices[i + 1] - 1:
                raise ValueError("local_expert_indices must be contiguous")
        self.local_start = local_expert_indices[0]
        self.drop_and_pad = config.moe_pad_expert_input_to_capacity
        self.probs = None
        self.input_splits = None
        self.output_splits = None
        self.num_out_tokens = None

    def preprocess(self, indices: torch.Tensor) -> torch.Tensor:
        """Counts and all-to-all splits for `indices`; returns the rows per local expert (CPU).

        The counts of every ep rank are all-gathered over ep ([ep, E]) so each rank knows what
        it receives. Dropped pairs are not counted (nor sent).
        """
        nle, ep = self.num_local_experts, self.ep_size
        if self.drop_and_pad:
            capacity = indices.size(1)  # indices: [E, capacity]
            self.num_out_tokens = None
            self.input_splits = self.output_splits = None
            self.counts = torch.full((ep, nle), capacity, dtype=torch.long)
            return torch.full((nle,), capacity * ep, dtype=torch.long)
        num_local_tokens_per_expert = count_tokens_per_expert(indices, self.num_experts)  # [E]
        self.num_out_tokens = int(num_local_tokens_per_expert.sum().item())
        if ep > 1:
            gathered = _gather_along_first_dim(num_local_tokens_per_expert, self.ep_group)
            counts = gathered.view(ep, self.num_experts)[
                :, self.local_start : self.local_start + nle
            ].cpu()  # [ep, nle]: rows each source rank sends to each of my experts
            self.input_splits = num_local_tokens_per_expert.view(ep, nle).sum(1).cpu().tolist()
            self.output_splits = counts.sum(1).tolist()
        else:
            counts = num_local_tokens_per_expert.view(1, nle).cpu()
        self.counts = counts
        return counts.sum(0)

    def _to_expert_major(self, rows: torch.Tensor) -> torch.Tensor:
        """[source rank, local expert] blocks -> [local expert, source rank] blocks."""
        nle, ep = self.num_local_experts, self.ep_size
        if nle == 1 or ep == 1:
            return rows
        order = [src * nle + e for e in range(nle) for src in range(ep)]
        return sort_chunks_by_idxs(rows, self.counts.reshape(-1).tolist(), order)

    def _to_source_major(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of `_to_expert_major`."""
        nle, ep = self.num_local_experts, self.ep_size
        if nle == 1 or ep == 1:
            return rows
        order = [e * ep + src for src in range(ep) for e in range(nle)]
        return sort_chunks_by_idxs(rows, self.counts.t().reshape(-1).tolist(), order)

    def token_permutation(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])  # [T, h]
        tokens_per_expert = self.preprocess(indices)
        if self.tp_size > 1:
            hidden_states = all_to_all_sp2hp(hidden_states, group=self.tp_group)  # [T*tp, h/tp]
        self.hidden_shape_before_permute = hidden_states.shape
        permuted, self.reversed_mapping = permute(
            hidden_states,
            indices,
            num_out_tokens=None if self.drop_and_pad else self.num_out_tokens,
            padded_mode=self.drop_and_pad,
        )
        global_input = all_to_all(
            self.ep_group, permuted, self.output_splits, self.input_splits
        )  # [N, h/tp]
        global_input = self._to_expert_major(global_input)
        if self.tp_size > 1:
            # [N, h/tp] -> [N, h]
            global_input = all_gather_last_dim_from_tensor_parallel_region(
                global_input, group=self.tp_group
            )
        return global_input, tokens_per_expert

    def token_unpermutation(
        self, hidden_states: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, None]:
        if bias is not None:
            raise ValueError("Bias is not supported in MoEAlltoAllTokenDispatcher")
        if self.tp_size > 1:
            # [N, h] partial sums -> [N, h/tp]
            hidden_states = reduce_scatter_last_dim_to_tensor_parallel_region(
                hidden_states, group=self.tp_group
            )
        hidden_states = self._to_source_major(hidden_states)
        permuted = all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)
        output = unpermute(
            permuted,
            self.reversed_mapping,
            probs=self.probs,
            padded_mode=self.drop_and_pad,
            restore_shape=self.hidden_shape_before_permute,
        )  # [T * tp, h / tp]
        if self.tp_size > 1:
            output = all_to_all_hp2sp(output, group=self.tp_group)  # [T, h]
        self.probs = None
        return output.view(self.hidden_shape), None
