"""MoE routers: the gate that scores every token against every expert and picks its top-k.

Notation: T tokens of this rank (s/tp * b under sequence parallelism), E experts, k top-k,
h hidden size.
"""

from abc import ABC, abstractmethod
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    EXPERT_LOAD,
    MoEAuxLossAutoScaler,
    is_recomputing,
    save_to_aux_losses_tracker,
    sequence_load_balancing_loss_func,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_softmax_with_capacity,
    z_loss_func,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class Router(ABC, MegatronModule):
    """Base router: the gate weight [E, h] (no bias) and the layer number used for logging.

    The weight is replicated on every tensor / expert / data parallel rank. It is drawn from the
    default generator, which is seeded alike on all ranks of a pipeline stage, so the copies are
    equal. Under sequence parallelism it carries `sequence_parallel`: each tensor-parallel rank
    scores only its slice of the sequence, so finalize_model_grads sums its gradient over tp.

    Args:
        config (TransformerConfig): the model config.
        pg_collection (ProcessGroupCollection, optional): tp, cp, tp_cp (and dp, for the expert
            bias) groups; None fields fall back to the global ones.
    """

    def __init__(
        self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None
    ) -> None:
        super().__init__(config)
        self.config = config
        self.num_experts = config.num_moe_experts
        self.layer_number = None
        self.pg_collection = resolve_process_groups(pg_collection, ("tp", "cp", "tp_cp", "dp"))
        # Drawn on the CPU from the default generator (alike on every rank), then moved.
        weight = torch.empty((self.num_experts, config.hidden_size), dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(weight)
        device = None if config.use_cpu_initialization else get_current_device()
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """logits = input W^T, [T, h] -> [T, E]; in fp32/fp64 with moe_router_dtype."""
        router_dtype = _ROUTER_DTYPES.get(self.config.moe_router_dtype)
        if router_dtype is not None:
            return F.linear(input.to(router_dtype), self.weight.to(router_dtype))
        return F.linear(input, self.weight)

    @abstractmethod
    def routing(self, logits: torch.Tensor):
        """[T, E] logits -> (probs, indices)."""

    @abstractmethod
    def forward(self, input: torch.Tensor):
        """[s, b, h] -> (probs, indices)."""

    def set_layer_number(self, layer_number: int):
        """The global 1-based number of the layer, the index of its losses in the tracker."""
        self.layer_number = layer_number


class TopKRouter(Router):
    """Top-k router with load balancing (aux_loss, seq_aux_loss, sinkhorn, none), z-loss, input
    jitter, capacity, sigmoid scores and an aux-loss-free expert bias.

    Losses are attached to activations with `MoEAuxLossAutoScaler`: the load-balancing loss to
    the returned probs, the z-loss to the logits, so their gradients reach the gate through the
    main backward pass. The tracker records each loss divided by its coefficient.

    With the alltoall dispatcher and tp > 1 the logits are all-gathered over tp (backward:
    reduce-scatter), so every tp rank routes the tokens of the whole tensor-parallel group.
    """

    def __init__(
        self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.input_jitter = None
        if config.moe_router_enable_expert_bias:
            # Persistent: the bias is learned state (Megatron's `mlp.router.expert_bias`).
            self.register_buffer(
                "expert_bias",
                torch.zeros(self.num_experts, dtype=torch.float32, device=self.weight.device),
            )
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32, device=self.weight.device),
                persistent=False,
            )
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None

    def _apply(self, fn, recurse=True):
        """Keep the expert bias and its token counts in fp32 through `.bfloat16()` / `.half()`
        (Float16Module casts every buffer): a bf16 bias would round the small updates away and
        bf16 counts above 256 are inexact."""
        saved = {
            name: buffer
            for name, buffer in (
                ("expert_bias", self.expert_bias),
                ("local_tokens_per_expert", self.local_tokens_per_expert),
            )
            if buffer is not None
        }
        module = super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return module

    # ------------------------------------------------------------------ groups

    @property
    def _routes_gathered_logits(self) -> bool:
        tp_size = self.pg_collection.tp.size()
        return self.config.moe_token_dispatcher_type == "alltoall" and tp_size > 1

    def _sequence_partition_group(self):
        """Ranks that each route a slice of the same sequence: tp x cp (allgather), or cp
        (alltoall, whose tp ranks all route the gathered logits). Without sequence parallelism
        the tp ranks hold the same tokens, so only cp splits them."""
        if self.config.moe_token_dispatcher_type == "alltoall" or not self.config.sequence_parallel:
            return self.pg_collection.cp
        return self.pg_collection.tp_cp

    # ------------------------------------------------------------------ losses

    def apply_load_balancing_loss(
        self, probs: torch.Tensor, num_local_tokens_per_expert: torch.Tensor, activation
    ) -> torch.Tensor:
        """Attach the Switch loss of `probs` [T, E] to `activation` and record it.

        With gathered logits every tp rank computes the whole loss, so each uses coeff / tp and
        the gather's backward (a sum over tp) restores coeff.
        """
        moe_aux_loss_coeff, group = self._aux_loss_coeff(), self._sequence_partition_group()
        aux_loss = switch_load_balancing_loss_func(
            probs, num_local_tokens_per_expert, self.topk, moe_aux_loss_coeff, group
        )
        return self._attach_aux_loss(
            "load_balancing_loss", aux_loss, moe_aux_loss_coeff, group, activation
        )

    def _aux_loss_coeff(self) -> float:
        """The balance-loss coefficient of this rank: with gathered logits every tp rank computes
        the whole loss, so each uses coeff / tp."""
        coeff = self.config.moe_aux_loss_coeff
        if self._routes_gathered_logits:
            coeff /= self.pg_collection.tp.size()
        return coeff

    def _attach_aux_loss(self, name, loss, coeff, group, activation) -> torch.Tensor:
        """Record loss / coeff under `name` and inject `loss` into `activation`'s backward."""
        if coeff != 0:
            save_to_aux_losses_tracker(
                name, loss / coeff, self.layer_number, self.config.num_layers, reduce_group=group
            )
        return MoEAuxLossAutoScaler.apply(activation, loss)

    def apply_seq_load_balancing_loss(
        self, scores: torch.Tensor, batch_size: int, activation
    ) -> torch.Tensor:
        """Attach the sequence-wise loss of `scores` [s * b, E] to `activation` and record it
        as `seq_load_balancing_loss`, with the same coefficient and tp rule as the Switch loss
        (`apply_load_balancing_loss`)."""
        moe_aux_loss_coeff, group = self._aux_loss_coeff(), self._sequence_partition_group()
        seq_aux_loss = sequence_load_balancing_loss_func(
            scores, batch_size, self.topk, moe_aux_loss_coeff, group
        )
        return self._attach_aux_loss(
            "seq_load_balancing_loss", seq_aux_loss, moe_aux_loss_coeff, group, activation
        )

    def apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """Attach coeff / (tp x cp) x mean_t lse_t^2 to the local logits (training only).

        Under sequence parallelism the tp x cp ranks each hold a slice of the tokens, so the
        per-rank coefficient keeps the total at coeff x the global mean. The tracker records the
        local mean of lse^2, averaged over those ranks at log time.
        """
        if self.config.moe_z_loss_coeff is None or not self.training:
            return logits
        group = self.pg_collection.tp_cp if self.config.sequence_parallel else self.pg_collection.cp
        moe_z_loss_coeff = self.config.moe_z_loss_coeff / group.size()
        z_loss = z_loss_func(logits, moe_z_loss_coeff)
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        save_to_aux_losses_tracker(
            "z_loss",
            z_loss / moe_z_loss_coeff,
            self.layer_number,
            self.config.num_layers,
            avg_group=group,
        )
        return logits

    def apply_input_jitter(self, input: torch.Tensor) -> torch.Tensor:
        """Multiply the input by U(1 - eps, 1 + eps) noise, in training only (Megatron also
        jitters in evaluation), in the input's dtype."""
        eps = self.config.moe_input_jitter_eps
        if eps is None or not self.training:
            return input
        if self.input_jitter is None:
            self.input_jitter = torch.distributions.uniform.Uniform(
                torch.tensor(1.0 - eps, device=input.device),
                torch.tensor(1.0 + eps, device=input.device),
            ).rsample
        return input * self.input_jitter(input.shape).to(input.dtype)

    # ------------------------------------------------------------------ routing

    # topk_softmax_with_capacity keyword -> the TransformerConfig field that sets it.
    _TOPK_CONFIG_FIELDS = (
        ('capacity_factor', 'moe_expert_capacity_factor'),
        ('pad_to_capacity', 'moe_pad_expert_input_to_capacity'),
        ('drop_policy', 'moe_token_drop_policy'),
        ('use_pre_softmax', 'moe_router_pre_softmax'),
        ('score_function', 'moe_router_score_function'),
        ('scaling_factor', 'moe_router_topk_scaling_factor'),
        ('num_groups', 'moe_router_num_groups'),
        ('group_topk', 'moe_router_group_topk'),
    )

    def _topk(self, logits: torch.Tensor):
        options = {kw: getattr(self.config, name) for kw, name in self._TOPK_CONFIG_FIELDS}
        return topk_softmax_with_capacity(
            logits, self.topk, expert_bias=self.expert_bias, **options
        )

    def _sinkhorn_activation(self, logits: torch.Tensor) -> torch.Tensor:
        """Routing scores of the Sinkhorn router: a sigmoid for top-1, else a softmax over the
        experts (computed in fp32, returned in the logits' dtype)."""
        if self.topk == 1:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)

    def sinkhorn_load_balancing(self, logits: torch.Tensor):
        """Sinkhorn-balanced expert choice in training (top-k of the balanced assignment), plain
        top-k in evaluation; the probs are the (softmax, or sigmoid for k = 1) scores of the
        chosen experts, not renormalized."""
        if not self.training:
            scores, indices = torch.topk(self._sinkhorn_activation(logits), k=self.topk, dim=1)
        else:
            # The balanced assignment only picks the experts; no gradient flows through it.
            with torch.no_grad():
                balanced = sinkhorn(logits.to(dtype=torch.float32))  # [T, E]
                indices = torch.topk(balanced, k=self.topk, dim=1).indices  # [T, k]
            scores = self._sinkhorn_activation(logits).gather(1, indices)
        return scores, indices, torch.bincount(indices.view(-1), minlength=self.num_experts)

    def _balance_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, E] fp32 scores of every expert that the balance losses average: the softmax,
        or the sigmoid normalised per token to sum to one."""
        if self.config.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits.float())
            return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return torch.softmax(logits, dim=-1, dtype=torch.float32)

    def aux_loss_load_balancing(self, logits: torch.Tensor, batch_size: int = 1):
        """Top-k routing plus, in training, the Switch loss on the full fp32 routing scores;
        with seq_aux_loss the per-sequence loss of `batch_size` sequences instead."""
        probs, indices, tokens_per_expert = self._topk(logits)
        if self.training:
            scores = self._balance_scores(logits)
            if self.routing_type == "seq_aux_loss":
                probs = self.apply_seq_load_balancing_loss(scores, batch_size, activation=probs)
            else:
                probs = self.apply_load_balancing_loss(scores, tokens_per_expert, activation=probs)
        return probs, indices, tokens_per_expert

    def routing(
        self, logits: torch.Tensor, batch_size: int = 1
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """[T, E] logits -> (probs, indices), [T', k] each (T' = T x tp with gathered logits),
        or [E, capacity] each with pad-to-capacity. The rows are [s, b] flattened, b =
        `batch_size` (the sequences seq_aux_loss balances)."""
        logits = logits.view(-1, self.num_experts)
        logits = self.apply_z_loss(logits)
        if self._routes_gathered_logits:
            # [T, E] -> [T * tp, E]; backward: reduce-scatter (sum over tp).
            logits = tensor_parallel.gather_from_sequence_parallel_region(
                logits, group=self.pg_collection.tp
            )
        if self.routing_type == "sinkhorn":
            scores, indices, tokens_per_expert = self.sinkhorn_load_balancing(logits)
        elif self.routing_type in ("aux_loss", "seq_aux_loss"):
            scores, indices, tokens_per_expert = self.aux_loss_load_balancing(logits, batch_size)
        elif self.routing_type == "none":
            scores, indices, tokens_per_expert = self._topk(logits)
        else:
            raise ValueError(f"Unsupported MoE routing type: {self.routing_type}")
        self._record_expert_load(tokens_per_expert)
        return scores, indices

    def _record_expert_load(self, tokens_per_expert: torch.Tensor):
        """Training only: per-expert counts for the logs and the expert-bias update (not again
        when recomputation re-runs the forward)."""
        if not self.training or is_recomputing():
            return
        counts = tokens_per_expert.detach().float()
        group = self._sequence_partition_group()
        save_to_aux_losses_tracker(
            EXPERT_LOAD, counts, self.layer_number, self.config.num_layers, reduce_group=group
        )
        if self.local_tokens_per_expert is not None:
            self.local_tokens_per_expert += counts

    def forward(self, input: torch.Tensor):
        """[s, b, h] -> (probs, indices) of every routed token, see `routing`."""
        batch_size = input.shape[1] if input.dim() == 3 else 1
        input = self.apply_input_jitter(input)
        logits = self.gating(input)
        logits = logits.view(-1, self.num_experts)  # [s * b, E]
        return self.routing(logits, batch_size)


def update_expert_bias(routers, group: torch.distributed.ProcessGroup):
    """Aux-loss-free balancing, once per global batch: sum each router's token counts over
    `group` (tensor x data x context parallel ranks), then move every expert's bias by
    rate x sign(mean count - count) and reset the counts.

    Args:
        routers: TopKRouter modules with an expert bias.
        group: the ranks whose tokens form the global batch of a pipeline stage.
    """
    routers = [r for r in routers if getattr(r, "expert_bias", None) is not None]
    if not routers:
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])  # [layers, E]
    if group is not None and group.size() > 1:
        torch.distributed.all_reduce(counts, group=group)
    with torch.no_grad():
        for router, count in zip(routers, counts):
            offset = count.mean() - count
            router.expert_bias += router.config.moe_router_bias_update_rate * torch.sign(offset)
            router.local_tokens_per_expert.zero_()
