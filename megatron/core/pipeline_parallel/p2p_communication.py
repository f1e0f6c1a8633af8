"""Point-to-point communication between adjacent pipeline stages.

Shape legend: s sequence length (divided by TP under sequence parallelism and by CP), b micro-batch
size, h hidden size. Every tensor that crosses a stage boundary is an activation or an activation
gradient of shape [s, b, h].

All exchanges go through `_communicate`, which posts every send and receive of one step at once
(`torch.distributed.batch_isend_irecv` by default, or individual isend/irecv) and waits for them.
That works on NCCL and on gloo.

Matching rule. Two messages can travel between the same pair of ranks in the same direction within
one step: with 2 physical stages (and with interleaving, whose last stage sends forward to the first
one) rank A's "next" and "prev" are the same rank B, so A may send B an activation (to next) and an
activation gradient (to prev) together. Backends match messages between a pair in posting order
(gloo also by tag; NCCL ignores tags), so every rank posts its operations in one canonical order:
forward-direction traffic (send to next / receive from prev) before backward-direction traffic
(send to prev / receive from next), and each direction carries its own tag. Then, for every ordered
pair (A, B), A's sends and B's receives are posted in the same order and cannot cross or deadlock.
The unbatched path additionally uses Megatron's even/odd ordering, so that blocking backends that
complete a send only when it is received still make progress.
"""

import contextlib
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, Union

import torch

from megatron.core import group_fallbacks, parallel_state
from megatron.core.utils import get_current_device

if TYPE_CHECKING:
    from megatron.core.model_parallel_config import ModelParallelConfig

# One tensor shape: [s, b, h] as a list / tuple of ints, or a torch.Size.
Shape = Union[List[int], torch.Size, Tuple[int, ...]]

# Tags keep the two directions apart on backends that honour tags (gloo, MPI).
_FORWARD_TAG = 0
_BACKWARD_TAG = 1


@contextlib.contextmanager
def _timed(config: 'ModelParallelConfig', name: str):
    """Time the block with the Megatron timer `name` (log level 2) when config.timers is set."""
    timer = None if config.timers is None else config.timers(name, log_level=2)
    if timer is not None:
        timer.start()
    yield
    if timer is not None:
        timer.stop()


def _pipeline_peers(pp_group) -> Tuple[torch.distributed.ProcessGroup, int, int, int]:
    """(group, prev global rank, next global rank, stage index) of this rank in `pp_group`.

    `pp_group` None falls back to the global pipeline group (Megatron's group-less calls).
    """
    group = group_fallbacks.get_pipeline_model_parallel_group_if_none(pp_group)
    ranks = torch.distributed.get_process_group_ranks(group)
    index = group.rank()
    return group, ranks[(index - 1) % len(ranks)], ranks[(index + 1) % len(ranks)], index


def _is_first_stage(pp_group=None) -> bool:
    """`_is_first_stage(pp_group)` with the stage taken from `pp_group` (the
    virtual pipeline rank, set by the interleaved schedule, still comes from parallel_state)."""
    group = group_fallbacks.get_pipeline_model_parallel_group_if_none(pp_group)
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vp_size is not None and parallel_state.get_virtual_pipeline_model_parallel_rank() != 0:
        return False
    return group.rank() == 0


def _is_last_stage(pp_group=None) -> bool:
    """`_is_last_stage(pp_group)` with the stage taken from `pp_group`."""
    group = group_fallbacks.get_pipeline_model_parallel_group_if_none(pp_group)
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    vp_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
    if vp_size is not None and vp_rank != vp_size - 1:
        return False
    return group.rank() == group.size() - 1


def _make_ops(
    *,
    tensor_send_prev: Optional[torch.Tensor],
    tensor_recv_prev: Optional[torch.Tensor],
    tensor_send_next: Optional[torch.Tensor],
    tensor_recv_next: Optional[torch.Tensor],
    peers: Tuple[torch.distributed.ProcessGroup, int, int, int],
) -> List[torch.distributed.P2POp]:
    """The P2POps of one step in the canonical order (forward direction first, see module doc)."""
    group, prev_rank, next_rank, _ = peers
    ops = []
    # Forward direction: activations flow prev -> self -> next.
    if tensor_send_next is not None:
        ops.append(
            torch.distributed.P2POp(
                torch.distributed.isend, tensor_send_next, next_rank, group, _FORWARD_TAG
            )
        )
    if tensor_recv_prev is not None:
        ops.append(
            torch.distributed.P2POp(
                torch.distributed.irecv, tensor_recv_prev, prev_rank, group, _FORWARD_TAG
            )
        )
    # Backward direction: gradients flow next -> self -> prev.
    if tensor_send_prev is not None:
        ops.append(
            torch.distributed.P2POp(
                torch.distributed.isend, tensor_send_prev, prev_rank, group, _BACKWARD_TAG
            )
        )
    if tensor_recv_next is not None:
        ops.append(
            torch.distributed.P2POp(
                torch.distributed.irecv, tensor_recv_next, next_rank, group, _BACKWARD_TAG
            )
        )
    return ops


def _batched_p2p_ops(
    *,
    tensor_send_prev: Optional[torch.Tensor],
    tensor_recv_prev: Optional[torch.Tensor],
    tensor_send_next: Optional[torch.Tensor],
    tensor_recv_next: Optional[torch.Tensor],
    peers: Tuple[torch.distributed.ProcessGroup, int, int, int],
) -> list:
    """Post all operations of one step with one `batch_isend_irecv`; returns the work handles."""
    ops = _make_ops(
        tensor_send_prev=tensor_send_prev,
        tensor_recv_prev=tensor_recv_prev,
        tensor_send_next=tensor_send_next,
        tensor_recv_next=tensor_recv_next,
        peers=peers,
    )
    if len(ops) == 0:
        return []
    return torch.distributed.batch_isend_irecv(ops)


def _p2p_ops(
    *,
    tensor_send_prev: Optional[torch.Tensor],
    tensor_recv_prev: Optional[torch.Tensor],
    tensor_send_next: Optional[torch.Tensor],
    tensor_recv_next: Optional[torch.Tensor],
    peers: Tuple[torch.distributed.ProcessGroup, int, int, int],
) -> list:
    """Post the operations one by one with isend/irecv, even and odd ranks in mirrored order.

    Even ranks send before they receive, odd ranks receive before they send, in each direction; the
    forward direction still comes first on both, so per-pair posting orders agree (module doc).
    """
    group, prev_rank, next_rank, stage = peers
    even = stage % 2 == 0

    def send(tensor, peer, tag):
        return torch.distributed.isend(tensor=tensor, dst=peer, group=group, tag=tag)

    def recv(tensor, peer, tag):
        return torch.distributed.irecv(tensor=tensor, src=peer, group=group, tag=tag)

    steps = []
    forward = [
        (send, tensor_send_next, next_rank, _FORWARD_TAG),
        (recv, tensor_recv_prev, prev_rank, _FORWARD_TAG),
    ]
    backward = [
        (send, tensor_send_prev, prev_rank, _BACKWARD_TAG),
        (recv, tensor_recv_next, next_rank, _BACKWARD_TAG),
    ]
    for pair in (forward, backward):
        steps.extend(pair if even else pair[::-1])
    reqs = []
    for op, tensor, peer, tag in steps:
        if tensor is not None:
            reqs.append(op(tensor, peer, tag))
    return reqs


def _communicate_shapes(
    tensor_send_next: Optional[torch.Tensor],
    tensor_send_prev: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    config: 'ModelParallelConfig',
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[Optional[List[int]], Optional[List[int]]]:
    """Exchange the shapes of the tensors about to be communicated (variable_seq_lengths).

    Each tensor that will be sent is announced with a 3-element int64 tensor holding its shape; the
    receiver allocates its buffer from it. Uses the same canonical ordering as the data exchange.

    Returns:
        (recv_prev_shape, recv_next_shape); None where nothing is received.
    """
    device = get_current_device()
    recv_prev_shape_tensor = None
    recv_next_shape_tensor = None
    send_prev_shape_tensor = None
    send_next_shape_tensor = None
    if recv_prev:
        recv_prev_shape_tensor = torch.empty((3,), device=device, dtype=torch.int64)
    if recv_next:
        recv_next_shape_tensor = torch.empty((3,), device=device, dtype=torch.int64)
    if tensor_send_prev is not None:
        send_prev_shape_tensor = torch.tensor(
            tensor_send_prev.size(), device=device, dtype=torch.int64
        )
    if tensor_send_next is not None:
        send_next_shape_tensor = torch.tensor(
            tensor_send_next.size(), device=device, dtype=torch.int64
        )

    p2p_func = _batched_p2p_ops if config.batch_p2p_comm else _p2p_ops
    reqs = p2p_func(
        tensor_send_prev=send_prev_shape_tensor,
        tensor_recv_prev=recv_prev_shape_tensor,
        tensor_send_next=send_next_shape_tensor,
        tensor_recv_next=recv_next_shape_tensor,
        peers=_pipeline_peers(pp_group),
    )
    for req in reqs:
        req.wait()

    recv_prev_shape = (
        recv_prev_shape_tensor.tolist() if recv_prev_shape_tensor is not None else None
    )
    recv_next_shape = (
        recv_next_shape_tensor.tolist() if recv_next_shape_tensor is not None else None
    )
    return recv_prev_shape, recv_next_shape


def _communicate(
    *,
    tensor_send_next: Optional[torch.Tensor],
    tensor_send_prev: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Optional[Shape],
    config: 'ModelParallelConfig',
    wait_on_reqs: bool = True,
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[list]]:
    """Send and receive in both directions between this stage and its neighbours in one step.

    Args:
        tensor_send_next: tensor to send to the next rank (None: nothing to send).
        tensor_send_prev: tensor to send to the previous rank (None: nothing to send).
        recv_prev: whether to receive a tensor from the previous rank.
        recv_next: whether to receive a tensor from the next rank.
        tensor_shape: shape [s, b, h] of received tensors (ignored with config.variable_seq_lengths,
            where shapes are exchanged first).
        config: provides pipeline_dtype, variable_seq_lengths, batch_p2p_comm, batch_p2p_sync and
            use_ring_exchange_p2p.
        wait_on_reqs: wait for completion before returning (False only for overlap_p2p_comm).
        pp_group: the pipeline group (None: the global one); neighbours are its adjacent ranks.

    Returns:
        (tensor_recv_prev, tensor_recv_next, reqs): received tensors (None where not received) and,
        when not waited on, the outstanding work handles.
    """
    if config.use_ring_exchange_p2p:
        raise ValueError(
            "use_ring_exchange_p2p=True needs torch.distributed.ring_exchange, which this PyTorch "
            "build does not provide; use batch_p2p_comm instead"
        )
    if config.variable_seq_lengths:
        recv_prev_shape, recv_next_shape = _communicate_shapes(
            tensor_send_next, tensor_send_prev, recv_prev, recv_next, config, pp_group
        )
    else:
        recv_prev_shape = tensor_shape
        recv_next_shape = tensor_shape

    device = get_current_device()
    tensor_recv_prev = None
    tensor_recv_next = None
    # Received tensors require grad: they are the inputs of this stage's forward (activations) and
    # receive .grad in its backward.
    if recv_prev:
        if recv_prev_shape is None:
            raise ValueError(
                "tensor_shape must be given to receive when variable_seq_lengths is False"
            )
        tensor_recv_prev = torch.empty(
            recv_prev_shape, requires_grad=True, device=device, dtype=config.pipeline_dtype
        )
    if recv_next:
        if recv_next_shape is None:
            raise ValueError(
                "tensor_shape must be given to receive when variable_seq_lengths is False"
            )
        tensor_recv_next = torch.empty(
            recv_next_shape, requires_grad=True, device=device, dtype=config.pipeline_dtype
        )

    if config.batch_p2p_comm:
        assert wait_on_reqs, "batched p2p communication is always waited on"
        p2p_func: Callable = _batched_p2p_ops
    else:
        p2p_func = _p2p_ops

    reqs = p2p_func(
        tensor_send_prev=tensor_send_prev,
        tensor_recv_prev=tensor_recv_prev,
        tensor_send_next=tensor_send_next,
        tensor_recv_next=tensor_recv_next,
        peers=_pipeline_peers(pp_group),
    )

    if wait_on_reqs and len(reqs) > 0:
        for req in reqs:
            req.wait()
        reqs = None

    if config.batch_p2p_comm and config.batch_p2p_sync and device.type == "cuda":
        # Guards against a race in batched NCCL p2p (as Megatron does).
        torch.cuda.synchronize()

    return tensor_recv_prev, tensor_recv_next, reqs


def _exchange(
    timer: str,
    config: 'ModelParallelConfig',
    pp_group,
    tensor_shape: Optional[Shape] = None,
    send_next: Optional[torch.Tensor] = None,
    send_prev: Optional[torch.Tensor] = None,
    recv_prev: bool = False,
    recv_next: bool = False,
    wait: bool = True,
):
    """One timed `_communicate` with the neighbours: what goes to / comes from the next and the
    previous stage. Returns (tensor from prev, tensor from next, work handles)."""
    with _timed(config, timer):
        return _communicate(
            tensor_send_next=send_next,
            tensor_send_prev=send_prev,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            wait_on_reqs=wait,
            config=config,
            pp_group=pp_group,
        )


def recv_forward(
    tensor_shape: Shape, config: 'ModelParallelConfig', pp_group=None
) -> Optional[torch.Tensor]:
    """Receive the input activation [s, b, h] from the previous stage (None on the first stage)."""
    if _is_first_stage(pp_group):
        return None
    return _exchange('forward-recv', config, pp_group, tensor_shape, recv_prev=True)[0]


def recv_backward(
    tensor_shape: Shape, config: 'ModelParallelConfig', pp_group=None
) -> Optional[torch.Tensor]:
    """Receive the gradient of this stage's output from the next stage (None on the last stage)."""
    if _is_last_stage(pp_group):
        return None
    return _exchange('backward-recv', config, pp_group, tensor_shape, recv_next=True)[1]


def send_forward(output_tensor: torch.Tensor, config: 'ModelParallelConfig', pp_group=None) -> None:
    """Send this stage's output activation to the next stage (no-op on the last stage)."""
    if not _is_last_stage(pp_group):
        _exchange('forward-send', config, pp_group, send_next=output_tensor)


def send_backward(
    input_tensor_grad: torch.Tensor, config: 'ModelParallelConfig', pp_group=None
) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on the first stage)."""
    if not _is_first_stage(pp_group):
        _exchange('backward-send', config, pp_group, send_prev=input_tensor_grad)


def send_forward_recv_backward(
    output_tensor: torch.Tensor, tensor_shape: Shape, config: 'ModelParallelConfig', pp_group=None
) -> Optional[torch.Tensor]:
    """Send the output to the next stage and receive its gradient back (None on the last stage)."""
    if _is_last_stage(pp_group):
        return None
    timer = 'forward-send-backward-recv'
    return _exchange(
        timer, config, pp_group, tensor_shape, send_next=output_tensor, recv_next=True
    )[1]


def send_backward_recv_forward(
    input_tensor_grad: torch.Tensor,
    tensor_shape: Shape,
    config: 'ModelParallelConfig',
    pp_group=None,
) -> Optional[torch.Tensor]:
    """Send the input gradient to the previous stage and receive the next input from it.

    Returns None on the first stage.
    """
    if _is_first_stage(pp_group):
        return None
    timer = 'backward-send-forward-recv'
    return _exchange(
        timer, config, pp_group, tensor_shape, send_prev=input_tensor_grad, recv_prev=True
    )[0]


def send_forward_recv_forward(
    output_tensor: Optional[torch.Tensor],
    recv_prev: bool,
    tensor_shape: Shape,
    config: 'ModelParallelConfig',
    overlap_p2p_comm: bool = False,
    pp_group=None,
):
    """Send the output to the next stage and receive an input from the previous one (interleaved).

    Returns:
        The received input tensor (None if recv_prev is False); with overlap_p2p_comm, the tuple
        (input_tensor, work handles) without waiting.
    """
    received, _, handles = _exchange(
        'forward-send-forward-recv', config, pp_group, tensor_shape,
        send_next=output_tensor, recv_prev=recv_prev, wait=not overlap_p2p_comm,
    )  # fmt: skip
    return (received, handles) if overlap_p2p_comm else received


def send_backward_recv_backward(
    input_tensor_grad: Optional[torch.Tensor],
    recv_next: bool,
    tensor_shape: Shape,
    config: 'ModelParallelConfig',
    overlap_p2p_comm: bool = False,
    pp_group=None,
):
    """Send the input gradient to the previous stage and receive an output gradient from the next.

    Returns:
        The received output gradient (None if recv_next is False); with overlap_p2p_comm, the tuple
        (output_tensor_grad, work handles) without waiting.
    """
    _, received, handles = _exchange(
        'backward-send-backward-recv', config, pp_group, tensor_shape,
        send_prev=input_tensor_grad, recv_next=recv_next, wait=not overlap_p2p_comm,
    )  # fmt: skip
    return (received, handles) if overlap_p2p_comm else received


def send_forward_backward_recv_forward_backward(
    output_tensor: Optional[torch.Tensor],
    input_tensor_grad: Optional[torch.Tensor],
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Shape,
    config: 'ModelParallelConfig',
    pp_group=None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Send output and input gradient, receive input and output gradient, all in one step.

    Returns:
        (input_tensor, output_tensor_grad); None where not received.
    """
    from_prev, from_next, _ = _exchange(
        'forward-backward-send-forward-backward-recv', config, pp_group, tensor_shape,
        send_next=output_tensor, send_prev=input_tensor_grad,
        recv_prev=recv_prev, recv_next=recv_next,
    )  # fmt: skip
    return from_prev, from_next
