"""The interleaved 1F1B schedule over virtual pipeline stages (model chunks).

Re-exported by `schedules.py`, where `get_forward_backward_func` picks it when a virtual pipeline
size is set. Stage boundary tensors are [s, b, h] as in `schedules.py`.
"""

import contextlib
from typing import Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.pipeline_parallel.microbatch_step import (
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
):
    """Interleaved 1F1B schedule over virtual pipeline stages (model chunks).

    Each rank holds `len(model)` chunks; chunk c of rank r is virtual stage c * pp + r.
    Micro-batches go through the chunks in groups of pp: the k-th forward step runs chunk (k mod (pp * v)) // pp,
    the k-th backward step the mirrored chunk. `model` and `data_iterator` are lists with one entry
    per chunk.

    Returns:
        The list of loss-reduction dicts on the last stage, [] on the others.
    """
    if not isinstance(model, list):
        raise ValueError("interleaving needs a list of model chunks (one per virtual stage)")
    if not isinstance(data_iterator, list):
        raise ValueError("interleaving needs a list of data iterators (one per model chunk)")
    if len(data_iterator) != len(model):
        raise ValueError(
            f"got {len(data_iterator)} data iterators for {len(model)} model chunks; "
            "pass one per chunk"
        )

    config = get_model_config(model[0])
    if config.overlap_p2p_comm and config.batch_p2p_comm:
        raise ValueError("Can not use both overlap_p2p_comm and batch_p2p_comm")

    pipeline_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    pipeline_parallel_rank = parallel_state.get_pipeline_model_parallel_rank()
    validate_pipeline_config(config, num_microbatches, num_model_chunks=len(model))

    model_type = get_model_type(model[0])
    if model_type == ModelType.encoder_and_decoder:
        raise ValueError("Interleaving is not supported with an encoder and decoder model.")
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        raise ValueError(
            f"Interleaving is not supported with a different decoder sequence length "
            f"(decoder_seq_length={decoder_seq_length}, seq_length={seq_length})."
        )

    start_timer(config, 'forward-backward')

    # Disable async grad reductions
    no_sync_func = config.no_sync_func
    if isinstance(no_sync_func, list):

        def multi_no_sync():
            stack = contextlib.ExitStack()
            for model_chunk_no_sync_func in config.no_sync_func:
                stack.enter_context(model_chunk_no_sync_func())
            return stack

        no_sync_func = multi_no_sync
    if no_sync_func is None:
        no_sync_func = contextlib.nullcontext
    no_sync_context = None

    # Per-chunk hooks; config itself is left untouched.
    grad_sync_func = config.grad_sync_func
    if grad_sync_func is not None and not isinstance(grad_sync_func, list):
        grad_sync_func = [grad_sync_func for _ in model]
    param_sync_func = config.param_sync_func
    if param_sync_func is not None and not isinstance(param_sync_func, list):
        param_sync_func = [param_sync_func for _ in model]

    def disable_grad_sync():
        """Disable asynchronous grad reductions"""
        nonlocal no_sync_context
        if no_sync_context is None:
            no_sync_context = no_sync_func()
            no_sync_context.__enter__()

    def enable_grad_sync():
        """Enable asynchronous grad reductions"""
        nonlocal no_sync_context
        if no_sync_context is not None:
            no_sync_context.__exit__(None, None, None)
            no_sync_context = None

    disable_grad_sync()

    # Model chunk IDs with synchronized grads
    synchronized_model_chunks = set()

    input_tensors = [[] for _ in range(len(model))]
    output_tensors = [[] for _ in range(len(model))]
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_current_device())

    forward_data_store = []
    if not forward_only:
        output_tensor_grads = [[] for _ in range(len(model))]

    tensor_shape = [seq_length, micro_batch_size, config.hidden_size]
    tensor_shape[0] = tensor_shape[0] // parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        tensor_shape[0] = tensor_shape[0] // parallel_state.get_tensor_model_parallel_world_size()

    # Compute number of warmup and remaining microbatches.
    num_model_chunks = len(model)
    total_num_microbatches = num_microbatches * num_model_chunks
    num_warmup_microbatches, all_warmup_microbatches = (
        get_num_warmup_microbatches_with_interleaving(
            pipeline_parallel_size,
            pipeline_parallel_rank,
            num_microbatches,
            num_model_chunks,
            forward_only,
        )
    )
    num_microbatches_remaining = total_num_microbatches - num_warmup_microbatches

    # Checkpoint the activations of partial Transformer layers in a number of micro-batches
    # within the maximum outstanding micro-batch backpropagations.
    max_outstanding_backprops = None
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        max_outstanding_backprops = num_warmup_microbatches + 1

    def checkpoint_flag(microbatch_index):
        if max_outstanding_backprops is None:
            return None
        return (
            microbatch_index % max_outstanding_backprops
            >= config.num_microbatches_with_partial_activation_checkpoints
        )

    # Synchronize params for first two model chunks
    if param_sync_func is not None:
        param_sync_func[0](model[0].parameters())
        if num_model_chunks > 1:
            param_sync_func[1](model[1].parameters())

    def get_model_chunk_id(microbatch_id, forward):
        """Helper method to get the model chunk ID given the iteration number."""
        microbatch_id_in_group = microbatch_id % (pipeline_parallel_size * num_model_chunks)
        model_chunk_id = microbatch_id_in_group // pipeline_parallel_size
        if not forward:
            model_chunk_id = num_model_chunks - model_chunk_id - 1
        return model_chunk_id

    def next_forward_receive(forward_k):
        """(recv_prev, chunk that receives it) for the steady-state step running forward_k.

        The first stage runs (pp - 1) forwards ahead of the last, so its next input comes from the
        chunk (pp - 1) steps back, and nothing arrives when that chunk is the last one.
        """
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            chunk_id = get_model_chunk_id(forward_k - (pipeline_parallel_size - 1), forward=True)
            return chunk_id != num_model_chunks - 1, chunk_id + 1
        return True, get_model_chunk_id(forward_k + 1, forward=True)

    def next_backward_receive(backward_k):
        """(recv_next, chunk that receives it) for the steady-state step running backward_k.

        Mirror of next_forward_receive: the last stage runs (pp - 1) backwards ahead of the first.
        """
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            chunk_id = get_model_chunk_id(backward_k - (pipeline_parallel_size - 1), forward=False)
            return chunk_id != 0, chunk_id - 1
        return True, get_model_chunk_id(backward_k + 1, forward=False)

    def get_microbatch_id_in_model_chunk(iteration_id, forward):
        """Helper method to get the microbatch_id within model chunk given the iteration number."""
        assert forward
        iteration_group_id = iteration_id // (pipeline_parallel_size * num_model_chunks)
        microbatch_id_in_model_chunk = (iteration_group_id * pipeline_parallel_size) + (
            iteration_id % pipeline_parallel_size
        )
        return microbatch_id_in_model_chunk

    def is_first_microbatch_for_model_chunk(microbatch_id: int) -> bool:
        """Check if an iteration is the first for a model chunk."""
        microbatch_group_size = pipeline_parallel_size * num_model_chunks
        microbatch_group_id = microbatch_id // microbatch_group_size
        microbatch_id_in_group = microbatch_id % microbatch_group_size
        if microbatch_group_id == 0:
            return microbatch_id_in_group % pipeline_parallel_size == 0
        return False

    def is_last_microbatch_for_model_chunk(microbatch_id: int) -> bool:
        """Check if an iteration is the last for a model chunk."""
        microbatch_group_size = pipeline_parallel_size * num_model_chunks
        num_microbatch_groups = total_num_microbatches // microbatch_group_size
        microbatch_group_id = microbatch_id // microbatch_group_size
        microbatch_id_in_group = microbatch_id % microbatch_group_size
        if microbatch_group_id == num_microbatch_groups - 1:
            return microbatch_id_in_group % pipeline_parallel_size == pipeline_parallel_size - 1
        return False

    def forward_step_helper(microbatch_id, current_microbatch, checkpoint_activations_microbatch):
        """Forward step for passed-in model chunk (which is determined by microbatch_id)."""
        model_chunk_id = get_model_chunk_id(microbatch_id, forward=True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(model_chunk_id)

        # launch param synchronization for next model chunk
        # Note: Asynchronous communication tends to slow down compute.
        # To reduce idling from mismatched microbatch times, we launch
        # asynchronous communication at the same time across the
        # pipeline-parallel group.
        if param_sync_func is not None:
            param_sync_microbatch_id = microbatch_id + pipeline_parallel_rank
            if (
                param_sync_microbatch_id < total_num_microbatches
                and is_first_microbatch_for_model_chunk(param_sync_microbatch_id)
            ):
                param_sync_chunk_id = get_model_chunk_id(param_sync_microbatch_id, forward=True) + 1
                if 1 < param_sync_chunk_id < num_model_chunks:
                    param_sync_func[param_sync_chunk_id](model[param_sync_chunk_id].parameters())

        # forward step
        if parallel_state.is_pipeline_first_stage():
            if len(input_tensors[model_chunk_id]) == len(output_tensors[model_chunk_id]):
                input_tensors[model_chunk_id].append(None)
        input_tensor = input_tensors[model_chunk_id][-1]

        output_tensor, num_tokens = forward_step(
            forward_step_func,
            data_iterator[model_chunk_id],
            model[model_chunk_id],
            num_microbatches,
            input_tensor,
            forward_data_store,
            config,
            collect_non_loss_data,
            checkpoint_activations_microbatch,
            check_first_val_step(
                first_val_step, forward_only, is_first_microbatch_for_model_chunk(microbatch_id)
            ),
            current_microbatch=current_microbatch,
        )
        output_tensors[model_chunk_id].append(output_tensor)

        nonlocal total_num_tokens
        total_num_tokens += torch.as_tensor(num_tokens).to(total_num_tokens.device)

        # if forward-only, no need to save tensors for a backward pass
        if forward_only:
            input_tensors[model_chunk_id].pop()
            output_tensors[model_chunk_id].pop()

        return output_tensor

    def backward_step_helper(microbatch_id):
        """Backward step through passed-in output tensor (chunk determined by microbatch_id)."""
        model_chunk_id = get_model_chunk_id(microbatch_id, forward=False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(model_chunk_id)

        # launch grad synchronization (default)
        if grad_sync_func is None and is_last_microbatch_for_model_chunk(microbatch_id):
            enable_grad_sync()
            synchronized_model_chunks.add(model_chunk_id)

        if parallel_state.is_pipeline_last_stage():
            if len(output_tensor_grads[model_chunk_id]) == 0:
                output_tensor_grads[model_chunk_id].append(None)
        input_tensor = input_tensors[model_chunk_id].pop(0)
        output_tensor = output_tensors[model_chunk_id].pop(0)
        output_tensor_grad = output_tensor_grads[model_chunk_id].pop(0)
        input_tensor_grad = backward_step(
            input_tensor, output_tensor, output_tensor_grad, model_type, config
        )

        # launch grad synchronization (custom grad sync)
        # Note: Asynchronous communication tends to slow down compute.
        # To reduce idling from mismatched microbatch times, we launch
        # asynchronous communication at the same time across the
        # pipeline-parallel group.
        if grad_sync_func is not None:
            grad_sync_microbatch_id = microbatch_id - pipeline_parallel_rank
            if grad_sync_microbatch_id >= 0 and is_last_microbatch_for_model_chunk(
                grad_sync_microbatch_id
            ):
                grad_sync_chunk_id = get_model_chunk_id(grad_sync_microbatch_id, forward=False)
                enable_grad_sync()
                grad_sync_func[grad_sync_chunk_id](model[grad_sync_chunk_id].parameters())
                synchronized_model_chunks.add(grad_sync_chunk_id)
        disable_grad_sync()

        return input_tensor_grad

    def steady_state_step_with_overlap(k, forward_k, current_microbatch):
        """One 1F1B step whose sends / receives overlap with the other direction's compute."""
        nonlocal input_tensor, output_tensor, output_tensor_grad
        nonlocal fwd_wait_handles, bwd_wait_handles, output_tensor_in_flight
        wait_forward_handles()
        output_tensor = forward_step_helper(
            forward_k, current_microbatch, checkpoint_flag(forward_k)
        )

        # Determine if current stage has anything to send, otherwise set tensor to None.
        forward_model_chunk_id = get_model_chunk_id(forward_k, forward=True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(forward_model_chunk_id)
        # Last virtual stage no activation tensor to send
        if parallel_state.is_pipeline_last_stage():
            output_tensor = None

        # Determine if peers are sending, and where in data structure to put received tensors.
        recv_prev, next_forward_model_chunk_id = next_forward_receive(forward_k)

        # If last iteration, don't receive; we already received one extra
        # before the start of the for loop.
        if k == (num_microbatches_remaining - 1):
            recv_prev = False

        # Send activation tensor to the next stage and receive activation tensor from the
        # previous stage, in the background.
        input_tensor, fwd_wait_handles = p2p_communication.send_forward_recv_forward(
            output_tensor,
            recv_prev=recv_prev,
            tensor_shape=tensor_shape,
            config=config,
            overlap_p2p_comm=True,
        )
        output_tensor_in_flight = output_tensor

        wait_backward_handles()

        # Backward pass.
        backward_k = k
        input_tensor_grad = backward_step_helper(backward_k)

        backward_model_chunk_id = get_model_chunk_id(backward_k, forward=False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(backward_model_chunk_id)

        # First virtual stage no activation gradient tensor to send
        if parallel_state.is_pipeline_first_stage():
            input_tensor_grad = None

        # Determine if the current virtual stage has an activation gradient tensor to receive
        recv_next, next_backward_model_chunk_id = next_backward_receive(backward_k)

        output_tensor_grad, bwd_wait_handles = p2p_communication.send_backward_recv_backward(
            input_tensor_grad,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            config=config,
            overlap_p2p_comm=True,
        )
        return recv_prev, next_forward_model_chunk_id, recv_next, next_backward_model_chunk_id

    # Run warmup forward passes.
    input_tensor = None
    output_tensor_grad = None
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    input_tensors[0].append(p2p_communication.recv_forward(tensor_shape, config))

    # With overlap_p2p_comm, sends and receives run in the background while the next chunk
    # computes: fwd_wait_handles / bwd_wait_handles are waited on before the received tensors are
    # used. An output tensor is freed only once its (asynchronous) send has completed.
    fwd_wait_handles = None
    bwd_wait_handles = None
    output_tensor_in_flight = None

    def wait_forward_handles():
        nonlocal fwd_wait_handles, output_tensor_in_flight
        if fwd_wait_handles is not None:
            for req in fwd_wait_handles:
                req.wait()
            fwd_wait_handles = None
        deallocate_output_tensor(output_tensor_in_flight, config.deallocate_pipeline_outputs)
        output_tensor_in_flight = None

    def wait_backward_handles():
        nonlocal bwd_wait_handles
        if bwd_wait_handles is not None:
            for req in bwd_wait_handles:
                req.wait()
            bwd_wait_handles = None

    output_tensor = None
    for k in range(num_warmup_microbatches):
        wait_forward_handles()
        current_microbatch = get_microbatch_id_in_model_chunk(k, forward=True)
        output_tensor = forward_step_helper(k, current_microbatch, checkpoint_flag(k))

        # Determine if tensor should be received from previous stage.
        next_forward_model_chunk_id = get_model_chunk_id(k + 1, forward=True)
        recv_prev = True
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            if next_forward_model_chunk_id == 0:
                recv_prev = False
        if k == (total_num_microbatches - 1):
            recv_prev = False

        # Don't send tensor downstream if on last stage.
        if parallel_state.is_pipeline_last_stage():
            output_tensor = None

        # Send and receive tensors as appropriate (send tensors computed
        # in this iteration; receive tensors for next iteration).
        if config.overlap_p2p_comm:
            input_tensor, fwd_wait_handles = p2p_communication.send_forward_recv_forward(
                output_tensor,
                recv_prev=recv_prev,
                tensor_shape=tensor_shape,
                config=config,
                overlap_p2p_comm=True,
            )
            output_tensor_in_flight = output_tensor
            if (
                k == (num_warmup_microbatches - 1)
                and not forward_only
                and not all_warmup_microbatches
            ):
                input_tensor_grad = None
                recv_next = True
                if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                    recv_next = False
                output_tensor_grad, bwd_wait_handles = (
                    p2p_communication.send_backward_recv_backward(
                        input_tensor_grad,
                        recv_next=recv_next,
                        tensor_shape=tensor_shape,
                        config=config,
                        overlap_p2p_comm=True,
                    )
                )
                output_tensor_grads[num_model_chunks - 1].append(output_tensor_grad)
            input_tensors[next_forward_model_chunk_id].append(input_tensor)
            continue

        if k == (num_warmup_microbatches - 1) and not forward_only and not all_warmup_microbatches:
            input_tensor_grad = None
            recv_next = True
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                recv_next = False
            (
                input_tensor,
                output_tensor_grad,
            ) = p2p_communication.send_forward_backward_recv_forward_backward(
                output_tensor,
                input_tensor_grad,
                recv_prev=recv_prev,
                recv_next=recv_next,
                tensor_shape=tensor_shape,
                config=config,
            )
            output_tensor_grads[num_model_chunks - 1].append(output_tensor_grad)
        else:
            input_tensor = p2p_communication.send_forward_recv_forward(
                output_tensor, recv_prev=recv_prev, tensor_shape=tensor_shape, config=config
            )
        input_tensors[next_forward_model_chunk_id].append(input_tensor)
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    # Run 1F1B in steady state.
    for k in range(num_microbatches_remaining):
        # Forward pass.
        forward_k = k + num_warmup_microbatches
        current_microbatch = get_microbatch_id_in_model_chunk(forward_k, forward=True)
        if config.overlap_p2p_comm:
            recv_prev, next_forward_model_chunk_id, recv_next, next_backward_model_chunk_id = (
                steady_state_step_with_overlap(k, forward_k, current_microbatch)
            )
            if recv_prev:
                input_tensors[next_forward_model_chunk_id].append(input_tensor)
            if recv_next:
                output_tensor_grads[next_backward_model_chunk_id].append(output_tensor_grad)
            continue

        output_tensor = forward_step_helper(
            forward_k, current_microbatch, checkpoint_flag(forward_k)
        )

        # Backward pass.
        backward_k = k
        input_tensor_grad = backward_step_helper(backward_k)

        # Send output_tensor and input_tensor_grad, receive input_tensor
        # and output_tensor_grad.

        # Determine if current stage has anything to send in either direction,
        # otherwise set tensor to None.
        forward_model_chunk_id = get_model_chunk_id(forward_k, forward=True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(forward_model_chunk_id)
        if parallel_state.is_pipeline_last_stage():
            output_tensor = None

        backward_model_chunk_id = get_model_chunk_id(backward_k, forward=False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(backward_model_chunk_id)
        if parallel_state.is_pipeline_first_stage():
            input_tensor_grad = None

        # Determine if peers are sending, and where in data structure to put
        # received tensors.
        recv_prev, next_forward_model_chunk_id = next_forward_receive(forward_k)

        recv_next, next_backward_model_chunk_id = next_backward_receive(backward_k)

        # If last iteration, don't receive; we already received one extra
        # before the start of the for loop.
        if k == (num_microbatches_remaining - 1):
            recv_prev = False

        # Communicate tensors.
        (
            input_tensor,
            output_tensor_grad,
        ) = p2p_communication.send_forward_backward_recv_forward_backward(
            output_tensor,
            input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            config=config,
        )
        deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

        # Put input_tensor and output_tensor_grad in data structures in the
        # right location.
        if recv_prev:
            input_tensors[next_forward_model_chunk_id].append(input_tensor)
        if recv_next:
            output_tensor_grads[next_backward_model_chunk_id].append(output_tensor_grad)

    # Every tensor received in the background must have arrived before it is used below (and
    # every send must have completed before its buffer is freed).
    wait_forward_handles()
    wait_backward_handles()
    deallocate_output_tensor(output_tensor, config.deallocate_pipeline_outputs)

    # Run cooldown backward passes (flush out pipeline).
    if not forward_only:
        if all_warmup_microbatches:
            output_tensor_grads[num_model_chunks - 1].append(
                p2p_communication.recv_backward(tensor_shape, config=config)
            )
        for k in range(num_microbatches_remaining, total_num_microbatches):
            input_tensor_grad = backward_step_helper(k)
            next_backward_model_chunk_id = get_model_chunk_id(k + 1, forward=False)
            recv_next = True
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                if next_backward_model_chunk_id == (num_model_chunks - 1):
                    recv_next = False
            if k == (total_num_microbatches - 1):
                recv_next = False
            output_tensor_grads[next_backward_model_chunk_id].append(
                p2p_communication.send_backward_recv_backward(
                    input_tensor_grad, recv_next=recv_next, tensor_shape=tensor_shape, config=config
                )
            )

        # Launch any remaining grad reductions.
        enable_grad_sync()
        if grad_sync_func is not None:
            for model_chunk_id in range(num_model_chunks):
                if model_chunk_id not in synchronized_model_chunks:
                    grad_sync_func[model_chunk_id](model[model_chunk_id].parameters())
                    synchronized_model_chunks.add(model_chunk_id)
    else:
        enable_grad_sync()

    # Leave the virtual rank where model construction and single-chunk code expect it.
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)

    finalize_model_grads_if_training(config, model, forward_only, total_num_tokens)
    stop_timer(config, 'forward-backward')
    return forward_data_store
