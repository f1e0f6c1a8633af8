"""The interleaved 1F1B schedule over virtual pipeline stages (model chunks).

Re-exported by `schedules.py`, where `get_forward_backward_func` picks it when a virtual pipeline
size is set. Stage boundary tensors are [s, b, h] as in `schedules.py`.

Structure: `_Layout` holds the fixed quantities of one call (sizes, micro-batch -> chunk maps),
`_State` everything that changes while it runs (queued tensors, tokens, in-flight p2p handles,
the grad-sync context), and `_InterleavedSchedule` the named steps that read and update them.
`forward_backward_pipelining_with_interleaving` validates, then runs

    warm-up:      for k in warm-up:      warmup_step(k)
    steady state: for k in remaining:    steady_step(k)    (or steady_step_with_overlap(k))
    cool-down:    for k in the rest:     cooldown_step(k)

with the same operations, in the same order, as Megatron's schedules.py.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Union

import torch

from megatron.core import group_fallbacks, parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.pipeline_parallel.microbatch_step import (
    PipelineScheduleError,
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    finalize_model_grads_if_training,
    forward_step,
    start_timer,
    stop_timer,
    validate_pipeline_config,
)
from megatron.core.utils import get_current_device, get_model_config, get_model_type


def get_num_warmup_microbatches_with_interleaving(
    pipeline_parallel_size: int,
    pipeline_parallel_rank: int,
    num_microbatches: int,
    num_model_chunks: int,
    forward_only: bool,
):
    """Warm-up forwards of the interleaved schedule on one stage.

    All (num_microbatches x num_model_chunks) forwards are warm-up when forward_only or when
    num_microbatches == pp; otherwise (pp - rank - 1) * 2 + (chunks - 1) * pp, capped at the total.

    Returns:
        (num_warmup_microbatches, all_warmup_microbatches).
    """
    total_num_microbatches = num_microbatches * num_model_chunks
    if forward_only:
        return total_num_microbatches, False
    if num_microbatches == pipeline_parallel_size:
        # Running all micro-batches in warm-up is exactly the 1F1B order for this case.
        return total_num_microbatches, True
    num_warmup_microbatches = (pipeline_parallel_size - pipeline_parallel_rank - 1) * 2
    num_warmup_microbatches += (num_model_chunks - 1) * pipeline_parallel_size
    return min(num_warmup_microbatches, total_num_microbatches), False


@dataclass(frozen=True)
class _Layout:
    """Fixed quantities of one schedule call: which chunk and micro-batch the k-th step handles.

    Forward step k runs chunk (k mod (pp * v)) // pp; backward step k the mirrored chunk.
    """

    pp_size: int
    pp_rank: int
    num_chunks: int
    num_microbatches: int
    num_warmup: int
    all_warmup: bool
    forward_only: bool
    tensor_shape: List[int]
    max_outstanding_backprops: Optional[int]
    num_partial_checkpoints: Optional[int]

    @property
    def total(self) -> int:
        return self.num_microbatches * self.num_chunks

    @property
    def remaining(self) -> int:
        return self.total - self.num_warmup

    def chunk_id(self, k: int, forward: bool) -> int:
        """The model chunk the k-th forward (or backward) step runs."""
        chunk = (k % (self.pp_size * self.num_chunks)) // self.pp_size
        return chunk if forward else self.num_chunks - chunk - 1

    def microbatch_in_chunk(self, k: int) -> int:
        """The micro-batch index, within its chunk, of the k-th forward step."""
        group = k // (self.pp_size * self.num_chunks)
        return group * self.pp_size + k % self.pp_size

    def is_first_microbatch_for_chunk(self, k: int) -> bool:
        group_size = self.pp_size * self.num_chunks
        return k // group_size == 0 and (k % group_size) % self.pp_size == 0

    def is_last_microbatch_for_chunk(self, k: int) -> bool:
        group_size = self.pp_size * self.num_chunks
        last_group = self.total // group_size - 1
        return k // group_size == last_group and (k % group_size) % self.pp_size == self.pp_size - 1

    def checkpoint_flag(self, k: int) -> Optional[bool]:
        """Whether forward step k checkpoints partial activations (None: feature off)."""
        if self.max_outstanding_backprops is None:
            return None
        return k % self.max_outstanding_backprops >= self.num_partial_checkpoints


@dataclass
class _State:
    """What changes while the schedule runs (one instance per call)."""

    input_tensors: List[list]
    output_tensors: List[list]
    output_tensor_grads: List[list]
    total_num_tokens: torch.Tensor
    forward_data_store: list = field(default_factory=list)
    synchronized_chunks: set = field(default_factory=set)
    no_sync_context: Optional[contextlib.AbstractContextManager] = None
    # The latest forward output (None where nothing was sent); freed after the steady state.
    output_tensor: Optional[torch.Tensor] = None
    # overlap_p2p_comm: outstanding handles, and the sent output to free once its send is done.
    fwd_wait_handles: Optional[list] = None
    bwd_wait_handles: Optional[list] = None
    output_tensor_in_flight: Optional[torch.Tensor] = None


def _per_chunk(hook, model) -> Optional[list]:
    """One hook per model chunk (config hooks may be a single callable or a list)."""
    if hook is None or isinstance(hook, list):
        return hook
    return [hook for _ in model]


def _no_sync_factory(no_sync_func) -> Callable:
    """A context factory disabling grad sync on every chunk (config may give one per chunk)."""
    if isinstance(no_sync_func, list):

        def multi_no_sync():
            stack = contextlib.ExitStack()
            for model_chunk_no_sync_func in no_sync_func:
                stack.enter_context(model_chunk_no_sync_func())
            return stack

        return multi_no_sync
    return no_sync_func if no_sync_func is not None else contextlib.nullcontext


class _InterleavedSchedule:
    """The named steps of the interleaved schedule over one `_Layout` and one `_State`."""

    def __init__(
        self,
        *,
        forward_step_func,
        data_iterator,
        model,
        config,
        layout,
        state,
        collect_non_loss_data,
        first_val_step,
        pp_group,
    ):
        self.pp_group = pp_group
        self.forward_step_func = forward_step_func
        self.data_iterator = data_iterator
        self.model = model
        self.config = config
        self.layout = layout
        self.state = state
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.model_type = get_model_type(model[0])
        self.no_sync_func = _no_sync_factory(config.no_sync_func)
        # Per-chunk hooks; config itself is left untouched.
        self.grad_sync_func = _per_chunk(config.grad_sync_func, model)
        self.param_sync_func = _per_chunk(config.param_sync_func, model)

    # -- stages: from pp_group's rank and size and the chunk, never the global pipeline group ----

    def _first_rank(self) -> bool:
        return self.layout.pp_rank == 0

    def _last_rank(self) -> bool:
        return self.layout.pp_rank == self.layout.pp_size - 1

    def _first_virtual_stage(self, chunk: int) -> bool:
        return self._first_rank() and chunk == 0

    def _last_virtual_stage(self, chunk: int) -> bool:
        return self._last_rank() and chunk == self.layout.num_chunks - 1

    # -- grad sync -------------------------------------------------------------------------------

    def disable_grad_sync(self):
        """Disable asynchronous grad reductions."""
        if self.state.no_sync_context is None:
            self.state.no_sync_context = self.no_sync_func()
            self.state.no_sync_context.__enter__()

    def enable_grad_sync(self):
        """Enable asynchronous grad reductions."""
        if self.state.no_sync_context is not None:
            self.state.no_sync_context.__exit__(None, None, None)
            self.state.no_sync_context = None

    def sync_first_params(self):
        """Synchronize params of the first two model chunks (the rest follow during forwards)."""
        if self.param_sync_func is not None:
            self.param_sync_func[0](self.model[0].parameters())
            if self.layout.num_chunks > 1:
                self.param_sync_func[1](self.model[1].parameters())

    def _launch_param_sync(self, k):
        # Launched at the same step on every stage, so the pipeline's asynchronous
        # communication overlaps the same compute (mismatched micro-batch times idle less).
        param_sync_k = k + self.layout.pp_rank
        if param_sync_k < self.layout.total and self.layout.is_first_microbatch_for_chunk(
            param_sync_k
        ):
            chunk = self.layout.chunk_id(param_sync_k, forward=True) + 1
            if 1 < chunk < self.layout.num_chunks:
                self.param_sync_func[chunk](self.model[chunk].parameters())

    def _launch_grad_sync(self, k):
        # Custom grad sync, launched at the same step on every stage (see _launch_param_sync).
        grad_sync_k = k - self.layout.pp_rank
        if grad_sync_k >= 0 and self.layout.is_last_microbatch_for_chunk(grad_sync_k):
            chunk = self.layout.chunk_id(grad_sync_k, forward=False)
            self.enable_grad_sync()
            self.grad_sync_func[chunk](self.model[chunk].parameters())
            self.state.synchronized_chunks.add(chunk)

    def finish_grad_sync(self):
        """Launch the grad reductions that have not run yet (none after forward only)."""
        self.enable_grad_sync()
        if self.grad_sync_func is not None and not self.layout.forward_only:
            for chunk in range(self.layout.num_chunks):
                if chunk not in self.state.synchronized_chunks:
                    self.grad_sync_func[chunk](self.model[chunk].parameters())
                    self.state.synchronized_chunks.add(chunk)

    # -- compute ---------------------------------------------------------------------------------

    def forward(self, k: int) -> torch.Tensor:
        """Forward step k on its chunk; queues the output for its backward."""
        layout, state = self.layout, self.state
        chunk = layout.chunk_id(k, forward=True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        if self.param_sync_func is not None:
            self._launch_param_sync(k)

        if self._first_virtual_stage(chunk):
            if len(state.input_tensors[chunk]) == len(state.output_tensors[chunk]):
                state.input_tensors[chunk].append(None)
        input_tensor = state.input_tensors[chunk][-1]

        output_tensor, num_tokens = forward_step(
            self.forward_step_func,
            self.data_iterator[chunk],
            self.model[chunk],
            layout.num_microbatches,
            input_tensor,
            state.forward_data_store,
            self.config,
            self.collect_non_loss_data,
            layout.checkpoint_flag(k),
            check_first_val_step(
                self.first_val_step, layout.forward_only, layout.is_first_microbatch_for_chunk(k)
            ),
            current_microbatch=layout.microbatch_in_chunk(k),
            pp_group=self.pp_group,
        )
        state.output_tensors[chunk].append(output_tensor)
        state.total_num_tokens += torch.as_tensor(num_tokens).to(state.total_num_tokens.device)

        # Forward only: nothing is kept for a backward pass.
        if layout.forward_only:
            state.input_tensors[chunk].pop()
            state.output_tensors[chunk].pop()
        return output_tensor

    def backward(self, k: int) -> Optional[torch.Tensor]:
        """Backward step k on its chunk; returns the gradient of the chunk's input."""
        state = self.state
        chunk = self.layout.chunk_id(k, forward=False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)

        # Default grad sync: the chunk's last backward re-enables the DDP hooks.
        if self.grad_sync_func is None and self.layout.is_last_microbatch_for_chunk(k):
            self.enable_grad_sync()
            state.synchronized_chunks.add(chunk)

        if self._last_virtual_stage(chunk):
            if len(state.output_tensor_grads[chunk]) == 0:
                state.output_tensor_grads[chunk].append(None)
        input_tensor = state.input_tensors[chunk].pop(0)
        output_tensor = state.output_tensors[chunk].pop(0)
        output_tensor_grad = state.output_tensor_grads[chunk].pop(0)
        input_tensor_grad = backward_step(
            input_tensor,
            output_tensor,
            output_tensor_grad,
            self.model_type,
            self.config,
            pp_group=self.pp_group,
        )

        if self.grad_sync_func is not None:
            self._launch_grad_sync(k)
        self.disable_grad_sync()
        return input_tensor_grad

    # -- what the neighbours send ----------------------------------------------------------------

    def output_to_send(self, k: int, output_tensor):
        """The forward output of step k, or None where the last virtual stage has no next."""
        chunk = self.layout.chunk_id(k, True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        return None if self._last_virtual_stage(chunk) else output_tensor

    def grad_to_send(self, k: int, input_tensor_grad):
        """The input gradient of backward step k, or None on the first virtual stage."""
        chunk = self.layout.chunk_id(k, False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        return None if self._first_virtual_stage(chunk) else input_tensor_grad

    def next_forward_receive(self, forward_k: int):
        """(recv_prev, chunk that receives it) for the steady-state step running forward_k.

        The first stage runs (pp - 1) forwards ahead of the last, so its next input comes from the
        chunk (pp - 1) steps back, and nothing arrives when that chunk is the last one.
        """
        layout = self.layout
        if self._first_rank():
            chunk = layout.chunk_id(forward_k - (layout.pp_size - 1), forward=True)
            return chunk != layout.num_chunks - 1, chunk + 1
        return True, layout.chunk_id(forward_k + 1, forward=True)

    def next_backward_receive(self, backward_k: int):
        """(recv_next, chunk that receives it) for the steady-state step running backward_k.

        Mirror of next_forward_receive: the last stage runs (pp - 1) backwards ahead of the first.
        """
        layout = self.layout
        if self._last_rank():
            chunk = layout.chunk_id(backward_k - (layout.pp_size - 1), forward=False)
            return chunk != 0, chunk - 1
        return True, layout.chunk_id(backward_k + 1, forward=False)

    def _warmup_receives(self, k: int):
        """(recv_prev, chunk receiving it) after warm-up forward k."""
        layout = self.layout
        next_chunk = layout.chunk_id(k + 1, forward=True)
        recv_prev = not (self._first_rank() and next_chunk == 0)
        if k == layout.total - 1:
            recv_prev = False
        return recv_prev, next_chunk

    def _starts_steady_state(self, k: int) -> bool:
        """After the last warm-up forward, the first output gradient is received as well."""
        layout = self.layout
        return k == layout.num_warmup - 1 and not layout.forward_only and not layout.all_warmup

    # -- overlap_p2p_comm handles ----------------------------------------------------------------

    def wait_forward_handles(self):
        """Wait for the background forward sends / receives, then free the sent output."""
        state = self.state
        if state.fwd_wait_handles is not None:
            for req in state.fwd_wait_handles:
                req.wait()
            state.fwd_wait_handles = None
        deallocate_output_tensor(
            state.output_tensor_in_flight, self.config.deallocate_pipeline_outputs
        )
        state.output_tensor_in_flight = None

    def wait_backward_handles(self):
        """Wait for the background backward sends / receives."""
        state = self.state
        if state.bwd_wait_handles is not None:
            for req in state.bwd_wait_handles:
                req.wait()
            state.bwd_wait_handles = None

    # -- the three phases ------------------------------------------------------------------------

    def receive_first_input(self):
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
        self.state.input_tensors[0].append(
            p2p_communication.recv_forward(
                self.layout.tensor_shape, self.config, pp_group=self.pp_group
            )
        )

    def warmup_step(self, k: int):
        """Forward k; send its output and receive the next input (and, on the last warm-up step
        before a steady state, the first output gradient)."""
        layout, state, config = self.layout, self.state, self.config
        last_chunk = layout.num_chunks - 1
        self.wait_forward_handles()
        output_tensor = self.output_to_send(k, self.forward(k))
        recv_prev, next_chunk = self._warmup_receives(k)
        state.output_tensor = output_tensor
        recv_next = not self._last_rank()

        if config.overlap_p2p_comm:
            input_tensor, state.fwd_wait_handles = p2p_communication.send_forward_recv_forward(
                output_tensor,
                recv_prev=recv_prev,
                tensor_shape=layout.tensor_shape,
                config=config,
                overlap_p2p_comm=True,
                pp_group=self.pp_group,
            )
            state.output_tensor_in_flight = output_tensor
            if self._starts_steady_state(k):
                output_tensor_grad, state.bwd_wait_handles = (
                    p2p_communication.send_backward_recv_backward(
                        None,
                        recv_next=recv_next,
                        tensor_shape=layout.tensor_shape,
                        config=config,
                        overlap_p2p_comm=True,
                        pp_group=self.pp_group,
                    )
                )
                state.output_tensor_grads[last_chunk].append(output_tensor_grad)
            state.input_tensors[next_chunk].append(input_tensor)
            return

        if self._starts_steady_state(k):
            input_tensor, output_tensor_grad = (
                p2p_communication.send_forward_backward_recv_forward_backward(
                    output_tensor,
                    None,
                    recv_prev=recv_prev,
                    recv_next=recv_next,
                    tensor_shape=layout.tensor_shape,
                    config=config,
                    pp_group=self.pp_group,
                )
            )
            state.output_tensor_grads[last_chunk].append(output_tensor_grad)
        else:
            input_tensor = p2p_communication.send_forward_recv_forward(
                output_tensor,
                recv_prev=recv_prev,
                tensor_shape=layout.tensor_shape,
                config=config,
                pp_group=self.pp_group,
            )
        state.input_tensors[next_chunk].append(input_tensor)
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    def steady_step(self, k: int):
        """Forward k + warm-up and backward k, then one exchange in both directions."""
        layout, state, config = self.layout, self.state, self.config
        forward_k = k + layout.num_warmup
        output_tensor = self.forward(forward_k)
        input_tensor_grad = self.backward(k)
        output_tensor = self.output_to_send(forward_k, output_tensor)
        input_tensor_grad = self.grad_to_send(k, input_tensor_grad)
        state.output_tensor = output_tensor

        recv_prev, next_forward_chunk = self.next_forward_receive(forward_k)
        recv_next, next_backward_chunk = self.next_backward_receive(k)
        # The last step's input was already received before the steady state began.
        if k == layout.remaining - 1:
            recv_prev = False

        input_tensor, output_tensor_grad = (
            p2p_communication.send_forward_backward_recv_forward_backward(
                output_tensor,
                input_tensor_grad,
                recv_prev=recv_prev,
                recv_next=recv_next,
                tensor_shape=layout.tensor_shape,
                config=config,
                pp_group=self.pp_group,
            )
        )
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)
        if recv_prev:
            state.input_tensors[next_forward_chunk].append(input_tensor)
        if recv_next:
            state.output_tensor_grads[next_backward_chunk].append(output_tensor_grad)

    def steady_step_with_overlap(self, k: int):
        """steady_step whose sends / receives run in the background of the other direction's
        compute (overlap_p2p_comm)."""
        layout, state, config = self.layout, self.state, self.config
        forward_k = k + layout.num_warmup
        self.wait_forward_handles()
        output_tensor = self.output_to_send(forward_k, self.forward(forward_k))
        state.output_tensor = output_tensor
        recv_prev, next_forward_chunk = self.next_forward_receive(forward_k)
        if k == layout.remaining - 1:
            recv_prev = False
        input_tensor, state.fwd_wait_handles = p2p_communication.send_forward_recv_forward(
            output_tensor,
            recv_prev=recv_prev,
            tensor_shape=layout.tensor_shape,
            config=config,
            overlap_p2p_comm=True,
            pp_group=self.pp_group,
        )
        state.output_tensor_in_flight = output_tensor

        self.wait_backward_handles()
        input_tensor_grad = self.grad_to_send(k, self.backward(k))
        recv_next, next_backward_chunk = self.next_backward_receive(k)
        output_tensor_grad, state.bwd_wait_handles = p2p_communication.send_backward_recv_backward(
            input_tensor_grad,
            recv_next=recv_next,
            tensor_shape=layout.tensor_shape,
            config=config,
            overlap_p2p_comm=True,
            pp_group=self.pp_group,
        )
        if recv_prev:
            state.input_tensors[next_forward_chunk].append(input_tensor)
        if recv_next:
            state.output_tensor_grads[next_backward_chunk].append(output_tensor_grad)

    def finish_steady_state(self):
        """Every background transfer must have arrived (and every sent buffer be free) before
        the cool-down uses them."""
        self.wait_forward_handles()
        self.wait_backward_handles()
        deallocate_output_tensor(self.state.output_tensor, self.config.deallocate_pipeline_outputs)

    def receive_first_grad(self):
        """With every forward in warm-up, the first output gradient is received here."""
        self.state.output_tensor_grads[self.layout.num_chunks - 1].append(
            p2p_communication.recv_backward(
                self.layout.tensor_shape, config=self.config, pp_group=self.pp_group
            )
        )

    def cooldown_step(self, k: int):
        """Backward k; send its input gradient and receive the next output gradient."""
        layout = self.layout
        input_tensor_grad = self.backward(k)
        next_chunk = layout.chunk_id(k + 1, forward=False)
        recv_next = True
        if self._last_rank() and next_chunk == layout.num_chunks - 1:
            recv_next = False
        if k == layout.total - 1:
            recv_next = False
        self.state.output_tensor_grads[next_chunk].append(
            p2p_communication.send_backward_recv_backward(
                input_tensor_grad,
                recv_next=recv_next,
                tensor_shape=layout.tensor_shape,
                config=self.config,
                pp_group=self.pp_group,
            )
        )


def _check_chunks(model, data_iterator) -> list:
    """Per-chunk data iterators: a list of one per chunk, or one iterator (or None) shared by
    every chunk, as Megatron r0.8 takes it; raises PipelineScheduleError otherwise."""
    if not isinstance(data_iterator, list):
        return [data_iterator] * len(model)
    if len(data_iterator) != len(model):
        raise PipelineScheduleError(
            f"got {len(data_iterator)} data iterators for {len(model)} model chunks; "
            "pass one per chunk, or a single iterator shared by every chunk"
        )
    return data_iterator


def _check_config(model, config, num_microbatches, seq_length, decoder_seq_length):
    """Raise ValueError for settings the interleaved schedule cannot run."""
    if config.overlap_p2p_comm and config.batch_p2p_comm:
        raise PipelineScheduleError("Can not use both overlap_p2p_comm and batch_p2p_comm")
    validate_pipeline_config(config, num_microbatches, num_model_chunks=len(model))
    if get_model_type(model[0]) == ModelType.encoder_and_decoder:
        raise PipelineScheduleError(
            "Interleaving is not supported with an encoder and decoder model."
        )
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        raise PipelineScheduleError(
            f"Interleaving is not supported with a different decoder sequence length "
            f"(decoder_seq_length={decoder_seq_length}, seq_length={seq_length})."
        )


def _make_layout(
    config, num_chunks, num_microbatches, seq_length, micro_batch_size, forward_only, pp_group
) -> _Layout:
    pp_size, pp_rank = pp_group.size(), pp_group.rank()
    # [s, b, h], the sequence split by context parallel (and by TP under sequence parallelism).
    tensor_shape = [seq_length, micro_batch_size, config.hidden_size]
    tensor_shape[0] = tensor_shape[0] // parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        tensor_shape[0] = tensor_shape[0] // parallel_state.get_tensor_model_parallel_world_size()
    num_warmup, all_warmup = get_num_warmup_microbatches_with_interleaving(
        pp_size, pp_rank, num_microbatches, num_chunks, forward_only
    )
    # Partial activation checkpointing applies within the outstanding backward window.
    partial = config.num_microbatches_with_partial_activation_checkpoints
    return _Layout(
        pp_size=pp_size,
        pp_rank=pp_rank,
        num_chunks=num_chunks,
        num_microbatches=num_microbatches,
        num_warmup=num_warmup,
        all_warmup=all_warmup,
        forward_only=forward_only,
        tensor_shape=tensor_shape,
        max_outstanding_backprops=None if partial is None else num_warmup + 1,
        num_partial_checkpoints=partial,
    )


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Interleaved 1F1B schedule over virtual pipeline stages (model chunks).

    Each rank holds `len(model)` chunks; chunk c of rank r is virtual stage c * pp + r.
    Micro-batches go through the chunks in groups of pp: the k-th forward step runs chunk
    (k mod (pp * v)) // pp, the k-th backward step the mirrored chunk. `model` is a list with
    one entry per chunk; `data_iterator` is such a list too, or one iterator (or None) that every
    chunk reads from.

    The pipeline is `pp_group` (None: the global pipeline group): its rank and size place this
    rank's stages, and every send and receive goes to its neighbours there (the last stage's
    output wraps to the first stage's next chunk). The current chunk is still published as the
    global virtual pipeline rank, which the model chunks and the loss step read.

    Returns:
        The list of loss-reduction dicts on the last stage, [] on the others.
    """
    if not isinstance(model, list):
        raise PipelineScheduleError(
            "interleaving needs a list of model chunks (one per virtual stage)"
        )
    config = get_model_config(model[0])
    # The layout is checked before the iterators (Megatron raises its errors first).
    _check_config(model, config, num_microbatches, seq_length, decoder_seq_length)
    data_iterator = _check_chunks(model, data_iterator)
    start_timer(config, 'forward-backward')

    num_chunks = len(model)
    pp_group = group_fallbacks.get_pipeline_model_parallel_group_if_none(pp_group)
    layout = _make_layout(
        config, num_chunks, num_microbatches, seq_length, micro_batch_size, forward_only, pp_group
    )
    state = _State(
        input_tensors=[[] for _ in range(num_chunks)],
        output_tensors=[[] for _ in range(num_chunks)],
        output_tensor_grads=[[] for _ in range(num_chunks)],
        total_num_tokens=torch.zeros([], dtype=torch.int, device=get_current_device()),
    )
    schedule = _InterleavedSchedule(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        config=config,
        layout=layout,
        state=state,
        collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step,
        pp_group=pp_group,
    )

    schedule.disable_grad_sync()
    schedule.sync_first_params()
    schedule.receive_first_input()
    for k in range(layout.num_warmup):
        schedule.warmup_step(k)
    steady_step = (
        schedule.steady_step_with_overlap if config.overlap_p2p_comm else schedule.steady_step
    )
    for k in range(layout.remaining):
        steady_step(k)
    schedule.finish_steady_state()
    if not forward_only:
        if layout.all_warmup:
            schedule.receive_first_grad()
        for k in range(layout.remaining, layout.total):
            schedule.cooldown_step(k)
    schedule.finish_grad_sync()

    # Leave the virtual rank where model construction and single-chunk code expect it.
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    finalize_model_grads_if_training(config, model, forward_only, state.total_num_tokens)
    stop_timer(config, 'forward-backward')
    return state.forward_data_store
