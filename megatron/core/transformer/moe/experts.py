"""The experts of one MoE layer on this rank: `SequentialMLP` (one MLP per expert) and
`GroupedMLP` (all experts' weights in two tensors, one grouped GEMM per linear layer).

Notation: N rows handed to the local experts (expert-major), nle local experts, h hidden size,
f the expert ffn size (moe_ffn_hidden_size), g = 2 for gated (SwiGLU) experts else 1, tp the
experts' tensor-parallel size (tp x ep with moe_extended_tp).

Tensor parallelism: expert e's first linear is split along its g f outputs and the second along
its f inputs, as in the dense MLP, but with no collective of their own: the token dispatcher
gathers the rows and reduce-scatters the partial outputs. With ep > 1 expert weights carry
`allreduce=False`, so their gradients are averaged over the expert-data-parallel group.

Initialization with `use_cpu_initialization`: the full weights of every *global* expert are drawn
from the CPU generator in expert order on every rank, and each rank keeps its experts' slices, so a
model holds the same experts at any ep (and grouped and sequential experts are equal).
"""

from typing import List, Optional, Tuple

import torch

from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide, get_current_device


def expert_tensor_parallel_group(config: TransformerConfig, pg_collection: ProcessGroupCollection):
    """The group splitting each expert's weights: tp, or tp x ep with moe_extended_tp."""
    return pg_collection.tp_ep if config.moe_extended_tp else pg_collection.tp


def _draw_expert_master_weights(config: TransformerConfig, ffn_hidden_size: int):
    """The full fc1 [g f, h] and fc2 [h, f] weights of one expert, drawn as the linear layers'
    CPU initialization draws them (fc1 first)."""
    fc1_out = ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    fc1 = torch.empty(fc1_out, config.hidden_size, dtype=torch.float)
    config.init_method(fc1)
    fc2 = torch.empty(config.hidden_size, ffn_hidden_size, dtype=torch.float)
    config.output_layer_init_method(fc2)
    return fc1, fc2


def _global_expert_ids(local_expert_indices: Optional[List[int]], num_local_experts: int):
    if local_expert_indices is None:
        return list(range(num_local_experts))
    return list(local_expert_indices)


class SequentialMLP(MegatronModule):
    """The local experts as a list of `MLP(is_expert=True)`, each run on its slice of the rows.

    State-dict keys: `local_experts.{i}.linear_fc1.weight` [g f / tp, h] and
    `local_experts.{i}.linear_fc2.weight` [h, f / tp], i the local index (global id =
    local_expert_indices[i]).

    Args:
        num_local_experts: nle.
        config (TransformerConfig): the model config.
        submodules (MLPSubmodules): the experts' linear layers.
        pg_collection (ProcessGroupCollection, optional): tp (and tp_ep) groups.
        local_expert_indices (List[int], optional): global ids of the local experts (default
            0 .. nle - 1).
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        pg_collection: Optional[ProcessGroupCollection] = None,
        local_expert_indices: Optional[List[int]] = None,
    ):
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        pgs = resolve_process_groups(pg_collection, ("tp", "tp_ep"))
        self.tp_group = expert_tensor_parallel_group(config, pgs)
        self.add_bias = config.add_bias_linear
        ffn_hidden_size = config.moe_ffn_hidden_size
        expert_pgs = ProcessGroupCollection(tp=self.tp_group)
        mine = _global_expert_ids(local_expert_indices, num_local_experts)
        draw_others = config.use_cpu_initialization and config.perform_initialization
        self.local_experts = torch.nn.ModuleList()
        for expert_id in range(config.num_moe_experts):
            if expert_id in mine:
                self.local_experts.append(
                    MLP(
                        config,
                        submodules,
                        is_expert=True,
                        pg_collection=expert_pgs,
                        ffn_hidden_size=ffn_hidden_size,
                    )
                )
            elif draw_others:
                # Another rank's expert: draw (and drop) its weights so ours match serial.
                _draw_expert_master_weights(config, ffn_hidden_size)

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> Tuple[torch.Tensor, None]:
        """[N, h] rows (expert-major) and rows per local expert -> ([N, h] outputs, None).

        With tp > 1 the outputs are partial sums over the tp ranks' slices of f. A bias of the
        second linear layer is added here, divided by tp so that the reduction adds it once.
        """
        splits = tokens_per_expert.tolist()
        chunks = torch.split(permuted_local_hidden_states, splits, dim=0)
        outputs = []
        for expert, chunk in zip(self.local_experts, chunks):
            output, output_bias = expert(chunk)
            if output_bias is not None:
                output = output + output_bias / self.tp_group.size()
            outputs.append(output)
        if not outputs:
            return permuted_local_hidden_states.new_empty(0, self.config.hidden_size), None
        return torch.cat(outputs, dim=0), None


class _GroupedGemm(torch.autograd.Function):
    """out[rows of e] = x[rows of e] @ w[e] for consecutive row groups; one weight gradient
    tensor for all experts (zeros for experts without rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, splits: List[int]):
        ctx.save_for_backward(x, w)
        ctx.splits = splits
        out = x.new_empty(x.shape[0], w.shape[-1])
        start = 0
        for e, n in enumerate(splits):
            if n:
                torch.matmul(x[start : start + n], w[e], out=out[start : start + n])
            start += n
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        start = 0
        for e, n in enumerate(ctx.splits):
            if n:
                rows = slice(start, start + n)
                if grad_x is not None:
                    torch.matmul(grad_out[rows], w[e].t(), out=grad_x[rows])
                if grad_w is not None:
                    torch.matmul(x[rows].t(), grad_out[rows], out=grad_w[e])
            start += n
        return grad_x, grad_w, None


def _torch_grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped GEMM kernel: CUDA, bf16, compute capability >= 9.0."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor):
    """[N, i] rows (expert-major, tokens_per_expert[e] rows for expert e) x w [nle, i, o] ->
    [N, o]. One kernel (`torch._grouped_mm`) on CUDA bf16 devices that have it, else a loop of
    GEMMs into one output (the same results as running each expert separately)."""
    if _torch_grouped_mm_available(x, w):
        offsets = torch.cumsum(tokens_per_expert.to(x.device), 0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    return _GroupedGemm.apply(x, w, [int(n) for n in tokens_per_expert.tolist()])


class GroupedMLP(MegatronModule):
    """All local experts in two weights, run with grouped GEMMs (plain PyTorch; no external
    `grouped_gemm` package).

    `weight1` [h, nle g f / tp] is viewed as [nle, h, g f / tp] and `weight2` [nle f / tp, h]
    as [nle, f / tp, h] (Megatron's layout): w1[e] = local_experts[e].linear_fc1.weight^T and
    w2[e] = local_experts[e].linear_fc2.weight^T of the equivalent SequentialMLP.

    Args:
        num_local_experts: nle.
        config (TransformerConfig): the model config (no linear biases).
        pg_collection (ProcessGroupCollection, optional): tp (and tp_ep) groups.
        local_expert_indices (List[int], optional): global ids of the local experts.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
        local_expert_indices: Optional[List[int]] = None,
    ):
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError(
                "bias in the expert layer is not supported in Grouped GEMM yet, please set "
                "'--disable-bias-linear' instead."
            )
        self.num_local_experts = num_local_experts
        pgs = resolve_process_groups(pg_collection, ("tp", "tp_ep"))
        self.tp_group = expert_tensor_parallel_group(config, pgs)
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.ffn_hidden_size = config.moe_ffn_hidden_size
        fc1_output_size = self.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
        self.fc1_per_partition = divide(fc1_output_size, tp_size)
        self.fc2_in_per_partition = divide(self.ffn_hidden_size, tp_size)
        h = config.hidden_size
        device = None if config.use_cpu_initialization else get_current_device()
        self.weight1 = torch.nn.Parameter(
            torch.empty(
                h,
                num_local_experts * self.fc1_per_partition,
                dtype=config.params_dtype,
                device=device,
            )
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(
                num_local_experts * self.fc2_in_per_partition,
                h,
                dtype=config.params_dtype,
                device=device,
            )
        )
        if config.perform_initialization:
            if config.use_cpu_initialization:
                self._init_from_master_weights(
                    _global_expert_ids(local_expert_indices, num_local_experts), tp_size, tp_rank
                )
            else:
                expert_parallel = config.expert_model_parallel_size > 1
                tracker = get_cuda_rng_tracker()
                fork = (
                    tracker.fork(get_expert_parallel_rng_tracker_name())
                    if expert_parallel
                    else tracker.fork()
                )
                with fork:
                    config.init_method(self.weight1)
                    config.output_layer_init_method(self.weight2)
        allreduce = not (config.expert_model_parallel_size > 1)
        set_tensor_model_parallel_attributes(self.weight1, True, 1, 1)
        set_tensor_model_parallel_attributes(self.weight2, True, 0, 1)
        setattr(self.weight1, "allreduce", allreduce)
        setattr(self.weight2, "allreduce", allreduce)

    @torch.no_grad()
    def _init_from_master_weights(self, mine: List[int], tp_size: int, tp_rank: int):
        w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, self.config.hidden_size)
        for expert_id in range(self.config.num_moe_experts):
            fc1, fc2 = _draw_expert_master_weights(self.config, self.ffn_hidden_size)
            if expert_id not in mine:
                continue
            e = mine.index(expert_id)
            fc1_shard = torch.chunk(fc1, tp_size, dim=0)[tp_rank]  # [g f / tp, h]
            fc2_shard = torch.chunk(fc2, tp_size, dim=1)[tp_rank]  # [h, f / tp]
            w1[e].copy_(fc1_shard.t())
            w2[e].copy_(fc2_shard.t())

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> Tuple[torch.Tensor, None]:
        """[N, h] rows (expert-major) -> ([N, h] outputs, partial sums over tp; None)."""
        w1 = self.weight1.view(self.num_local_experts, self.config.hidden_size, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, self.config.hidden_size)
        fc1_output = grouped_gemm(permuted_local_hidden_states, w1, tokens_per_expert)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(fc1_output, 2, dim=-1)  # [N, g f / tp] -> 2 x [N, f / tp]
            intermediate = self.config.activation_func(gate) * up
        else:
            intermediate = self.config.activation_func(fc1_output)
        return grouped_gemm(intermediate, w2, tokens_per_expert), None
