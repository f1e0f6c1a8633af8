"""Tensor parallel communication pipelined with the GEMMs, in plain PyTorch (`--tp-comm-overlap`).

With sequence parallelism a column-parallel linear layer all-gathers its input along the sequence
before its GEMM, and a row-parallel one reduce-scatters its output after it. Megatron overlaps
them with Transformer Engine's userbuffers kernels; here the same overlap is built from
point-to-point sends around the tensor parallel ring, so it runs on any backend (gloo, NCCL):

- all-gather + GEMM (`tp_comm_overlap_ag`): the input travels round the ring one sequence chunk
  per step; each rank multiplies the chunk it holds while the next one is in flight, and writes
  that chunk's rows of the output. No rank waits for the whole gathered input.
- GEMM + reduce-scatter (`tp_comm_overlap_rs`): each rank computes the partial output of one
  destination chunk per step, adds the running sum its ring neighbour sent, and passes it on
  while it computes the next; after tp - 1 steps each rank holds the full sum of its own chunk.

Backward, with tp_comm_overlap on:
- column-parallel: the input is all-gathered again for the weight gradient, asynchronously,
  while the input-gradient GEMM runs (`tp_comm_bulk_dgrad`); the input gradient is then
  reduce-scattered while the weight-gradient GEMM runs (`tp_comm_bulk_wgrad`), or, with
  `tp_comm_overlap_rs_dgrad`, pipelined with its own GEMM as in the forward reduce-scatter;
- row-parallel: the output gradient is all-gathered pipelined with the input-gradient GEMM
  (the forward's all-gather scheme), and the gathered gradient feeds the weight gradient.

The results are those of the plain layers: every output row is the same dot products; a
pipelined reduce-scatter adds the tp partial sums in ring order, so it may differ from the
collective's order in the last bit of fp32.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.comm_overlap_cfg import layer_overlap


def _ring(group):
    """(rank in group, size, global rank of the next rank, global rank of the previous)."""
    rank, size = group.rank(), group.size()
    return (
        rank,
        size,
        dist.get_global_rank(group, (rank + 1) % size),
        dist.get_global_rank(group, (rank - 1) % size),
    )


def _pass_on(send: torch.Tensor, send_to: int, recv_from: int, group) -> tuple:
    """Start sending `send` to one ring neighbour and receiving a tensor of its shape from the
    other; returns (receive buffer, handles)."""
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, send_to, group),
        dist.P2POp(dist.irecv, recv, recv_from, group),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(handles: List) -> None:
    for handle in handles:
        handle.wait()


def ring_all_gather_matmul(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    group,
    bias: Optional[torch.Tensor] = None,
    gathered: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """AG(x) @ weight_t (+ bias), the all-gather along the first dimension pipelined with the
    GEMM.

    Args:
        x: this rank's chunk [n, b, k].
        weight_t: [k, o] (a transposed view is fine).
        bias: optional [o], added inside each chunk's GEMM (addmm, as the plain layer does).
        gathered: optional [tp * n, b, k] buffer that receives AG(x) as a by-product (a backward
            reuses the gathered gradient for its weight gradient).

    Returns:
        [tp * n, b, o]: the rows of chunk j computed from rank j's x.
    """
    rank, size, next_rank, prev_rank = _ring(group)
    n = x.size(0)
    out = x.new_empty((size * n,) + tuple(x.shape[1:-1]) + (weight_t.size(-1),))
    held, source = x.contiguous(), rank
    for step in range(size):
        in_flight = None
        if step < size - 1:
            # The chunk moves one rank down the ring while this rank multiplies it.
            in_flight = _pass_on(held, next_rank, prev_rank, group)
        rows = slice(source * n, (source + 1) * n)
        if bias is None:
            torch.matmul(held, weight_t, out=out[rows])  # [n, b, o]
        else:
            held_2d = held.reshape(-1, held.size(-1))  # [n * b, k]
            torch.addmm(bias, held_2d, weight_t, out=out[rows].view(-1, out.size(-1)))
        if gathered is not None:
            gathered[rows] = held
        if in_flight is not None:
            held, handles = in_flight
            _wait(handles)
            source = (source - 1) % size
    return out


def ring_matmul_reduce_scatter(x: torch.Tensor, weight_t: torch.Tensor, group) -> torch.Tensor:
    """RS(x @ weight_t) along the first dimension, the reduce-scatter pipelined with the GEMM.

    Args:
        x: [tp * n, b, k], this rank's partial-sum operand.
        weight_t: [k, o].

    Returns:
        [n, b, o]: the sum over the group of this rank's chunk of x @ weight_t.
    """
    rank, size, next_rank, prev_rank = _ring(group)
    if x.size(0) % size:
        raise ValueError(
            f"first dimension of the tensor ({x.size(0)}) is not divisible by the tensor "
            f"parallel size ({size})"
        )
    n = x.size(0) // size
    pending, sends = None, []
    for step in range(size):
        # Step k computes chunk (rank + k + 1) % tp, so that the last step is this rank's own.
        target = (rank + step + 1) % size
        partial = torch.matmul(x[target * n : (target + 1) * n], weight_t)  # [n, b, o]
        if pending is not None:
            received, handles = pending
            _wait(handles)
            partial += received
        if step == size - 1:
            _wait(sends)
            return partial
        # The running sum goes to the previous rank, which adds its part of the same chunk next.
        recv = torch.empty_like(partial)
        handles = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, partial, prev_rank, group),
                dist.P2POp(dist.irecv, recv, next_rank, group),
            ]
        )
        sends.extend(handles[:1])
        pending = (recv, handles[1:])
    return None  # unreachable: the loop returns at its last step


def _weight_grad(weight, grad_2d, input_2d, gradient_accumulation_fusion):
    """grad W = grad_2d^T input_2d, or accumulated into weight.main_grad (returning what the
    plain linear layer returns to autograd then)."""
    if not gradient_accumulation_fusion:
        return grad_2d.t().matmul(input_2d)
    if not hasattr(weight, 'main_grad'):
        raise RuntimeError(
            'gradient_accumulation_fusion needs `main_grad` on the weights '
            '(wrap the model in DistributedDataParallel)'
        )
    weight.main_grad.addmm_(
        grad_2d.t().to(weight.main_grad.dtype), input_2d.to(weight.main_grad.dtype)
    )
    if not hasattr(weight, 'grad_added_to_main_grad'):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, 'zero_out_wgrad', False):
        return None
    # Autograd needs a tensor for the DDP hook to fire; the hook drops it unread.
    return torch.empty(weight.shape, dtype=input_2d.dtype, device=input_2d.device)


class AllGatherMatmul(torch.autograd.Function):
    """Column-parallel Y = AG(X) W^T + b with the sequence all-gather pipelined with the GEMM.

    Forward: X [s/tp, b, h] -> Y [s, b, o/tp] (`ring_all_gather_matmul`).
    Backward: grad X = RS(grad Y W), grad W = grad Y^T AG(X) (X gathered again, asynchronously,
    during the grad X GEMM when bulk_dgrad), grad b = sum of grad Y.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, config, group):
        # `config`: the layer's switches (comm_overlap_cfg.LayerOverlap or ModelParallelConfig).
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.config, ctx.group = config, group
        return ring_all_gather_matmul(input, weight.t(), group, bias=bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        config, group = ctx.config, ctx.group
        size = group.size()
        gathered = input.new_empty((size * input.size(0),) + tuple(input.shape[1:]))
        gather = dist.all_gather_into_tensor(
            gathered, input.contiguous(), group=group, async_op=True
        )
        if not config.tp_comm_bulk_dgrad:
            gather.wait()
        grad_output = grad_output.contiguous()
        reduce = None
        if config.tp_comm_overlap_rs_dgrad:
            grad_input = ring_matmul_reduce_scatter(grad_output, weight, group)  # [s/tp, b, h]
        else:
            full = grad_output.matmul(weight)  # [s, b, h]
            grad_input = full.new_empty((full.size(0) // size,) + tuple(full.shape[1:]))
            reduce = dist.reduce_scatter_tensor(grad_input, full, group=group, async_op=True)
            if not config.tp_comm_bulk_wgrad:
                reduce.wait()
        gather.wait()
        grad_2d = grad_output.reshape(-1, grad_output.size(-1))  # [s * b, o/tp]
        input_2d = gathered.reshape(-1, gathered.size(-1))  # [s * b, h]
        grad_weight = _weight_grad(weight, grad_2d, input_2d, ctx.gradient_accumulation_fusion)
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None
        if reduce is not None:
            reduce.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    """Row-parallel Y = RS(X W^T) with the sequence reduce-scatter pipelined with the GEMM.

    Forward: X [s, b, h_in/tp] -> Y [s/tp, b, h] (`ring_matmul_reduce_scatter`).
    Backward: grad X = AG(grad Y) W with the all-gather pipelined with that GEMM, and
    grad W = AG(grad Y)^T X from the gradient the pipeline gathered on the way.
    """

    @staticmethod
    def forward(ctx, input, weight, gradient_accumulation_fusion, group):
        ctx.save_for_backward(input, weight)
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.group = group
        return ring_matmul_reduce_scatter(input, weight.t(), group)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group = ctx.group
        grad_output = grad_output.contiguous()
        gathered = grad_output.new_empty(
            (group.size() * grad_output.size(0),) + tuple(grad_output.shape[1:])
        )
        grad_input = ring_all_gather_matmul(grad_output, weight, group, gathered=gathered)
        grad_2d = gathered.reshape(-1, gathered.size(-1))  # [s * b, h]
        input_2d = input.reshape(-1, input.size(-1))  # [s * b, h_in/tp]
        grad_weight = _weight_grad(weight, grad_2d, input_2d, ctx.gradient_accumulation_fusion)
        return grad_input, grad_weight, None, None


def overlaps_all_gather(
    config, sequence_parallel: bool, group, buffer_name: Optional[str] = None
) -> bool:
    """Whether a column-parallel layer pipelines its input all-gather with its GEMM
    (`buffer_name`: its entry in `config.tp_comm_overlap_ub_cfgs`, see comm_overlap_cfg.py)."""
    return bool(
        config.tp_comm_overlap
        and layer_overlap(config, buffer_name).tp_comm_overlap_ag
        and sequence_parallel
        and group.size() > 1
    )


def overlaps_reduce_scatter(
    config, sequence_parallel: bool, group, buffer_name: Optional[str] = None
) -> bool:
    """Whether a row-parallel layer pipelines its output reduce-scatter with its GEMM."""
    return bool(
        config.tp_comm_overlap
        and layer_overlap(config, buffer_name).tp_comm_overlap_rs
        and sequence_parallel
        and group.size() > 1
    )
