"""Muon (`--optimizer muon`, later Megatron's v0.16 flags): orthogonalised momentum for the 2-D
hidden weights, AdamW for everything else, in one torch optimizer.

Update of a Muon parameter W [out, in] with gradient g (lr and weight decay from its group):

    W <- W (1 - lr wd);  m <- beta m + (1 - beta) g;  u = (1 - beta) g + beta m (Nesterov) or m
    W <- W - lr * s * extra * NS(u)

NS is `num_ns_steps` Newton-Schulz iterations X <- aX + (bA + cA^2) X, A = X X^T, on
X = u / ||u||_F (transposed when out > in), with the (3.4445, -4.7750, 2.0315) coefficients. s is
the scale mode: spectral sqrt(max(out, in)), shape_scaling sqrt(max(1, out / in)) (torch's
`adjust_lr_fn="original"`), unit_rms_norm sqrt(out / in). `linear_qkv` weights are split per query
group into their q, k and v row blocks, each orthogonalised alone (unless --muon-no-split-qkv).

Tensor parallelism (`--muon-tp-mode`): a weight split over TP is orthogonalised as a whole matrix
in `duplicated` mode (every rank all-gathers u over TP along the split dimension, runs NS on the
full matrix and keeps its own block: the update equals TP = 1), or per shard in `blockwise` mode
(each rank orthogonalises its own block: no communication, a different update for TP > 1, which
is Megatron v0.16's default). The full-matrix reference of both choices is tested.

Which parameters: 2-D weights other than the embedding and output layer (the params marked
`is_embedding_or_output_parameter`) get Muon; all others AdamW with the --adam-* settings. State:
`momentum_buffer` (Muon), `exp_avg`, `exp_avg_sq`, `step` (AdamW), saved with the optimizer.
The distributed optimizer is refused (it shards the matrices Muon must see whole).
"""

import math
from typing import Tuple

import torch
from torch import Tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    u: Tensor,
    steps: int = 5,
    coefficients: Tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    matmul_precision: str = "high",
) -> Tensor:
    """An approximately orthogonal matrix with u's singular vectors, [out, in] -> [out, in].

    matmul_precision: "high" fp32 throughout; "medium" normalise in fp32, then iterate in bf16
    (Megatron's); "low" cast to bf16 first, then normalise and iterate (torch.optim.Muon's order).
    """
    a, b, c = coefficients
    x = u.float()
    if matmul_precision == "low":
        x = x.bfloat16()
    x = x / x.norm().clamp(min=eps)
    if matmul_precision == "medium":
        x = x.bfloat16()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.t()
    for _ in range(steps):
        gram = x @ x.t()
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.addmm(x, gram_update, x, beta=a)  # a X + (b A + c A^2) X
    if transposed:
        x = x.t()
    return x.to(u.dtype)


def muon_scale(rows: int, cols: int, mode: str) -> float:
    """The update's scale for an [rows, cols] matrix under --muon-scale-mode."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(
        f"--muon-scale-mode must be spectral, shape_scaling or unit_rms_norm, got {mode!r}"
    )


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `use_muon=True`, AdamW for the others.

    Args:
        param_groups: Megatron's groups, each with `use_muon` (and the usual lr / weight decay).
        lr, weight_decay: defaults.
        momentum, nesterov, num_ns_steps, scale_mode, extra_scale_factor, matmul_precision:
            the Muon settings (see the module docstring).
        split_qkv (bool): orthogonalise q, k and v blocks of `linear_qkv` apart (a param with a
            `muon_qkv_layout` = (groups, heads per group, head size) attribute).
        tp_mode (str): "duplicated" or "blockwise" for TP-split weights.
        tp_group: the tensor-parallel group (None = no TP).
        betas, eps: AdamW's.
    """

    def __init__(
        self,
        param_groups,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        nesterov: bool = False,
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        matmul_precision: str = "medium",
        split_qkv: bool = True,
        tp_mode: str = "duplicated",
        tp_group=None,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
    ):
        defaults = dict(lr=lr, weight_decay=weight_decay, use_muon=False)
        super().__init__(param_groups, defaults)
        self.momentum, self.nesterov, self.num_ns_steps = momentum, nesterov, num_ns_steps
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        self.matmul_precision, self.split_qkv = matmul_precision, split_qkv
        self.tp_mode, self.tp_group = tp_mode, tp_group
        self.betas, self.eps = betas, eps

    def _orthogonalise(self, u: Tensor) -> Tensor:
        return newton_schulz(u, self.num_ns_steps, matmul_precision=self.matmul_precision)

    def _update_of(self, param: Tensor, u: Tensor) -> Tuple[Tensor, float]:
        """The orthogonalised update of one Muon parameter (same shape as u) and the scale it
        still has to be multiplied by."""
        dim = (
            getattr(param, "partition_dim", None)
            if getattr(param, "tensor_model_parallel", False)
            else None
        )
        tp = self.tp_group.size() if self.tp_group is not None else 1
        gathered = dim is not None and tp > 1 and self.tp_mode == "duplicated"
        if gathered:
            pieces = [torch.empty_like(u) for _ in range(tp)]
            torch.distributed.all_gather(pieces, u.contiguous(), group=self.tp_group)
            u = torch.cat(pieces, dim=dim)
        layout = getattr(param, "muon_qkv_layout", None) if self.split_qkv else None
        if layout is not None:
            groups, heads_per_group, head = layout
            if gathered:
                groups *= tp
            blocks = u.view(groups, heads_per_group + 2, head, -1)  # [ng, np/ng + 2, hn, h]
            q, k, v = torch.split(blocks, [heads_per_group, 1, 1], dim=1)
            parts = []
            for block in (q, k, v):
                flat = block.reshape(-1, u.size(-1))  # [ng * rows, h]
                scale = muon_scale(flat.size(0), flat.size(1), self.scale_mode)
                parts.append((self._orthogonalise(flat) * scale).view(block.shape))
            update, scale = torch.cat(parts, dim=1).view_as(u), 1.0
        else:
            update = self._orthogonalise(u)
            scale = muon_scale(u.size(0), u.size(1), self.scale_mode)
        if gathered:
            rank = self.tp_group.rank()
            update = update.chunk(tp, dim=dim)[rank]
        return update, scale * self.extra_scale_factor

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        beta1, beta2 = self.betas
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if group.get("use_muon"):
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(param))
                    param.mul_(1 - lr * wd)
                    buf.lerp_(grad, 1 - self.momentum)
                    u = grad.lerp(buf, self.momentum) if self.nesterov else buf
                    update, scale = self._update_of(param, u)
                    param.add_(update, alpha=-lr * scale)
                    continue
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                step = float(state["step"])
                param.mul_(1 - lr * wd)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt().add_(self.eps)
                param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))
        return loss


def muon_init_state_fn(optimizer: torch.optim.Optimizer) -> None:
    """Empty Muon / AdamW state for every param that has none (before loading state)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            if group.get("use_muon"):
                state["momentum_buffer"] = torch.zeros_like(param.data)
            else:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param.data)
                state["exp_avg_sq"] = torch.zeros_like(param.data)


def mark_muon_params(model_chunks) -> None:
    """Tag every parameter with `use_muon` (2-D and not an embedding or output-layer table) and
    the fused QKV weights with `muon_qkv_layout` (query groups of this rank, heads per
    group, head size)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            qkv = getattr(module, "linear_qkv", None)
            groups = getattr(module, "num_query_groups_per_partition", None)
            if qkv is not None and groups is not None and hasattr(qkv, "weight"):
                heads = module.num_attention_heads_per_partition // groups
                qkv.weight.muon_qkv_layout = (groups, heads, module.hidden_size_per_attention_head)
        for name, param in chunk.named_parameters():
            table = "embedding" in name or "output_layer" in name
            param.use_muon = param.dim() == 2 and not table


def split_muon_groups(param_groups):
    """Each Megatron group split into its Muon part (params marked `use_muon`) and the rest."""
    out = []
    for group in param_groups:
        muon, other = [], []
        for param in group["params"]:
            (muon if getattr(param, "use_muon", False) else other).append(param)
        for params, use_muon in ((muon, True), (other, False)):
            if params:
                out.append({**group, "params": params, "use_muon": use_muon})
    return out
