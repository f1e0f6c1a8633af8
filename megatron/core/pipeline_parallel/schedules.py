"""Forward-backward schedules over micro-batches: no pipelining, 1F1B, and interleaved 1F1B.

Shape legend: s sequence length (divided by TP under sequence parallelism and by CP), b micro-batch
size, h hidden size; stage boundary tensors are [s, b, h].

Every schedule has Megatron's keyword-only signature

    forward_backward_func(*, forward_step_func, data_iterator, model, num_microbatches,
                          seq_length, micro_batch_size, decoder_seq_length=None,
                          forward_only=False, collect_non_loss_data=False, first_val_step=None)

and returns the list of loss-reduction dicts produced by `loss_func` on the last pipeline stage
(an empty list elsewhere). Everything else (no_sync_func, grad_sync_func, param_sync_func,
finalize_model_grads_func, grad_scale_func, pipeline_dtype, variable_seq_lengths,
sequence_parallel, deallocate_pipeline_outputs, timers, batch_p2p_comm) is read from the model's
config, `get_model_config(model[0])`.

`forward_step_func(data_iterator, model) -> (output_tensor, loss_func)`; on the last stage
`loss_func(output_tensor)` returns `(loss, reduced_dict)` or `(loss, num_tokens, reduced_dict)`;
the loss is divided by num_microbatches (and by num_tokens in the 3-tuple form unless
`calculate_per_token_loss`) before backward, so gradients are averages over micro-batches.
"""

import contextlib
from typing import Callable, Iterator, List, Optional, Union

import torch
from torch.autograd.variable import Variable

from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.utils import (
    get_attr_wrapped_model,
    get_current_device,
    get_model_config,
    get_model_type,
)

# Types
Shape = Union[List[int], torch.Size]


def get_forward_backward_func() -> Callable:
    """The schedule matching the current pipeline layout.

    Returns:
        forward_backward_no_pipelining when the pipeline has one stage;
        forward_backward_pipelining_with_interleaving when a virtual pipeline size is set;
        forward_backward_pipelining_without_interleaving (1F1B) otherwise.
    """
    pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pipeline_model_parallel_size > 1:
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
            forward_backward_func = forward_backward_pipelining_with_interleaving
        else:
            forward_backward_func = forward_backward_pipelining_without_interleaving
    else:
        forward_backward_func = forward_backward_no_pipelining
    return forward_backward_func


def validate_pipeline_config(config, num_microbatches: int, num_model_chunks: int = 1) -> None:
    """Raise ValueError for layouts no schedule can run; called before any communication.

    Checks that config.num_layers (when the config has one) splits evenly over
    pipeline size x virtual size, and that the interleaved schedule gets a number of
    micro-batches divisible by the pipeline size.

    Args:
        config: the model's config (TransformerConfig or ModelParallelConfig).
        num_microbatches: micro-batches per step.
        num_model_chunks: model chunks on this rank (the virtual pipeline size, 1 without).
    """
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches ({num_microbatches}) must be at least 1")
    if vp_size is not None and num_model_chunks != vp_size:
        raise ValueError(
            f"got {num_model_chunks} model chunks but virtual_pipeline_model_parallel_size is "
            f"{vp_size}; pass one model chunk per virtual stage"
        )
    num_layers = getattr(config, 'num_layers', None)
    if num_layers is not None:
        stages = pp_size * (vp_size or 1)
        if num_layers % stages != 0:
            raise ValueError(
                f"num_layers ({num_layers}) is not divisible by pipeline_model_parallel_size "
                f"({pp_size}) x virtual_pipeline_model_parallel_size ({vp_size or 1}) = {stages}"
            )
    if vp_size is not None and num_microbatches % pp_size != 0:
        raise ValueError(
            f"number of microbatches ({num_microbatches}) is not divisible by "
            f"pipeline-model-parallel-size ({pp_size}) when using interleaved schedule"
        )


def deallocate_output_tensor(
    out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = False
):
    """Free an output tensor's data once it has been sent to the next stage.

    Only the tensor's `.grad_fn` is needed for the backward pass, so its storage is replaced with a
    one-element tensor; `custom_backward` then runs backward without the shape check.
    """
    if (out is None) or (not deallocate_pipeline_outputs):
        return
    assert isinstance(out, torch.Tensor), "expected Tensor, found %s." % type(out).__name__
    assert out._base is None, "counter-productive to free a view of another tensor."
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]):
    """Run backward from `output` with `grad_output`, skipping autograd's shape check.

    `torch.autograd.backward` requires output and grad to have equal shapes; after
    `deallocate_output_tensor` the output's data is a one-element placeholder, so the C++ engine
    is called directly.
    """
    assert output.numel() == 1, "output should be pseudo-'freed' in schedule, to optimize memory"
    assert isinstance(output, torch.Tensor), "output == '%s'." % type(output).__name__
    assert isinstance(grad_output, (torch.Tensor, type(None))), (
        "grad_output == '%s'." % type(grad_output).__name__
    )

    # Handle scalar output (the loss on the last stage).
    if grad_output is None:
        assert output.numel() == 1, "implicit grad requires scalar output."
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)

    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def set_current_microbatch(model, microbatch_id: int) -> None:
    """Tell the model's decoder which micro-batch runs (used by some layers for logging/FP8)."""
    decoder_exists = True
    decoder = None
    try:
        decoder = get_attr_wrapped_model(model, "decoder")
    except RuntimeError:
        decoder_exists = False
    if decoder_exists and decoder is not None:
        decoder.current_microbatch = microbatch_id


def _calculate_per_token_loss(config) -> bool:
    # A ModelParallelConfig (no transformer fields) never asks for per-token loss normalisation.
    return bool(getattr(config, 'calculate_per_token_loss', False))


def forward_step(
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    input_tensor,
    forward_data_store: list,
    config,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: Optional[bool] = None,
    is_first_microbatch: bool = False,
    current_microbatch: Optional[int] = None,
):
    """Forward one micro-batch through one model chunk.

    If this is the last stage, `loss_func` reduces the output: the loss is scaled by
    1/num_microbatches (and 1/num_tokens for the 3-tuple form without per-token loss) and the
    reduced dict is appended to forward_data_store. Otherwise the output tensor is returned to be
    sent downstream.

    Returns:
        (output_tensor, num_tokens): output_tensor is a list unless input_tensor was a single
        tensor; num_tokens is an int tensor (0 unless loss_func reported a token count).
    """
    if config.timers is not None:
        config.timers('forward-compute', log_level=2).start()

    if is_first_microbatch and hasattr(model, 'set_is_first_microbatch'):
        model.set_is_first_microbatch()
    if current_microbatch is not None:
        set_current_microbatch(model, current_microbatch)

    unwrap_output_tensor = False
    if not isinstance(input_tensor, list):
        input_tensor = [input_tensor]
        unwrap_output_tensor = True

    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    set_input_tensor(input_tensor)

    if config.enable_autocast:
        context_manager = torch.autocast(get_current_device().type, dtype=config.autocast_dtype)
    else:
        context_manager = contextlib.nullcontext()
    with context_manager:
        if checkpoint_activations_microbatch is None:
            output_tensor, loss_func = forward_step_func(data_iterator, model)
        else:
            output_tensor, loss_func = forward_step_func(
                data_iterator, model, checkpoint_activations_microbatch
            )

    num_tokens = torch.tensor(0, dtype=torch.int)
    if parallel_state.is_pipeline_last_stage():
        if not collect_non_loss_data:
            outputs = loss_func(output_tensor)
            if len(outputs) == 3:
                output_tensor, num_tokens, loss_reduced = outputs
                if not _calculate_per_token_loss(config):
                    output_tensor = output_tensor / num_tokens
                    output_tensor = output_tensor / num_microbatches
            else:
                # preserve legacy loss averaging behavior (ie, over the number of microbatches)
                assert len(outputs) == 2, "loss_func must return (loss, dict) or (loss, n, dict)"
                output_tensor, loss_reduced = outputs
                output_tensor = output_tensor / num_microbatches
            forward_data_store.append(loss_reduced)
        else:
            data = loss_func(output_tensor, non_loss_data=True)
            forward_data_store.append(data)

    if config.timers is not None:
        config.timers('forward-compute').stop()

    # If T5 model (or other model with encoder and decoder) and in decoder stack, then send encoder
    # hidden state downstream as well.
    model_type = get_model_type(model)
    if (
        parallel_state.is_pipeline_stage_after_split()
        and model_type == ModelType.encoder_and_decoder
    ):
        return [output_tensor, input_tensor[-1]], num_tokens

    if unwrap_output_tensor:
        return output_tensor, num_tokens
    return [output_tensor], num_tokens


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """Backward one micro-batch through one model chunk.

    Seeds autograd with output_tensor_grad (None on the last stage, where output_tensor is the
    scaled loss, then grad_scale_func applies the loss scale) and returns the gradient of the
    stage's input for the previous stage (None on the first stage).
    """
    if config.timers is not None:
        config.timers('backward-compute', log_level=2).start()

    # Retain the grad on the input_tensor.
    unwrap_input_tensor_grad = False
    if not isinstance(input_tensor, list):
        input_tensor = [input_tensor]
        unwrap_input_tensor_grad = True
    for x in input_tensor:
        if x is not None:
            x.retain_grad()

    if not isinstance(output_tensor, list):
        output_tensor = [output_tensor]
    if not isinstance(output_tensor_grad, list):
        output_tensor_grad = [output_tensor_grad]

    # Backward pass.
    if output_tensor_grad[0] is None and config.grad_scale_func is not None:
        output_tensor[0] = config.grad_scale_func(output_tensor[0])

    if config.deallocate_pipeline_outputs:
        custom_backward(output_tensor[0], output_tensor_grad[0])
    else:
        torch.autograd.backward(output_tensor[0], grad_tensors=output_tensor_grad[0])

    # Collect the grad of the input_tensor.
    input_tensor_grad = [None]
    if input_tensor is not None:
        input_tensor_grad = []
        for x in input_tensor:
            if x is None:
                input_tensor_grad.append(None)
            else:
                input_tensor_grad.append(x.grad)

    # Handle skip connections between the encoder and decoder (the decoder consumes the encoder's
    # output too, so its gradient arrives with the decoder's).
    if (
        len(output_tensor_grad) > 1
        and parallel_state.is_pipeline_stage_after_split()
        and model_type == ModelType.encoder_and_decoder
    ):
        if output_tensor_grad[1] is not None:
            input_tensor_grad[-1].add_(output_tensor_grad[1])
    if unwrap_input_tensor_grad:
        input_tensor_grad = input_tensor_grad[0]

    if config.timers is not None:
        config.timers('backward-compute').stop()

    return input_tensor_grad


def check_first_val_step(first_val_step, forward_only, cond):
    """Whether this micro-batch counts as the first one (for FP8 weight caching in validation)."""
    if (first_val_step is not None) and forward_only:
        return first_val_step and cond
    return cond


def _start_timer(config, name):
    if config.timers is not None:
        config.timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)


def _stop_timer(config, name):
    if config.timers is not None:
        config.timers(name).stop()


def _finalize(config, model: list, forward_only: bool, total_num_tokens: torch.Tensor) -> None:
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            model, total_num_tokens if _calculate_per_token_loss(config) else None
        )


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, List[Iterator]],
    model: Union[torch.nn.Module, List[torch.nn.Module]],
    num_microbatches: int,
    seq_length: int,  # unused
    micro_batch_size: int,  # unused
    decoder_seq_length: Optional[int] = None,  # unused
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
):
    """Run forward and backward over all micro-batches with no pipeline.

    Micro-batches 0..n-2 run under config.no_sync_func (gradient accumulation without data-parallel
    reduction); the last one runs with gradient sync enabled.

    Returns:
        The list of loss-reduction dicts, one per micro-batch.
    """
    if isinstance(model, list):
        assert len(model) == 1, "non-pipeline-parallel schedule does not support model chunking"
        model = model[0]
    if isinstance(data_iterator, list):
        assert (
            len(data_iterator) == 1
        ), "non-pipeline-parallel schedule does not support model chunking"
        data_iterator = data_iterator[0]

    config = get_model_config(model)
    validate_pipeline_config(config, num_microbatches)
    _start_timer(config, 'forward-backward')

    no_sync_func = config.no_sync_func
    if no_sync_func is None:
        no_sync_func = contextlib.nullcontext

    model_type = get_model_type(model)

    forward_data_store = []
    input_tensor, output_tensor_grad = None, None
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_current_device())
    with no_sync_func():
        for i in range(num_microbatches - 1):
            output_tensor, num_tokens = forward_step(
                forward_step_func,
                data_iterator,
                model,
                num_microbatches,
                input_tensor,
                forward_data_store,
                config,
                collect_non_loss_data,
                is_first_microbatch=check_first_val_step(first_val_step, forward_only, i == 0),
                current_microbatch=i,
            )
            total_num_tokens += torch.as_tensor(num_tokens).to(total_num_tokens.device)
            if not forward_only:
                backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)

    # Run computation for last microbatch out of context handler (want to synchronize gradients).
    output_tensor, num_tokens = forward_step(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        input_tensor,
        forward_data_store,
        config,
        collect_non_loss_data,
        is_first_microbatch=check_first_val_step(
            first_val_step, forward_only, num_microbatches == 1
        ),
        current_microbatch=num_microbatches - 1,
    )
    total_num_tokens += torch.as_tensor(num_tokens).to(total_num_tokens.device)

    if not forward_only:
        backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)

    _finalize(config, [model], forward_only, total_num_tokens)
    _stop_timer(config, 'forward-backward')
    return forward_data_store


def get_tensor_shapes(
    *,
    rank: int,
    model_type: ModelType,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int],
    config,
) -> List[tuple]:
    """Shapes of the tensors a pipeline stage `rank` sends downstream.

    encoder_or_decoder: one tensor [s, b, h]. encoder_and_decoder: stages before the split rank send
    the encoder's [s, b, h]; stages after it send the decoder's [s_dec, b, h] and pass the
    encoder's output [s, b, h] along. s is divided by CP and, under sequence parallelism, by TP.
    """
    tensor_shapes = []
    cp_size = parallel_state.get_context_parallel_world_size()
    seq_length = seq_length // cp_size
    if model_type == ModelType.encoder_and_decoder:
        decoder_seq_length = decoder_seq_length // cp_size
    if config.sequence_parallel:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        seq_length = seq_length // tp_size
        if model_type == ModelType.encoder_and_decoder:
            decoder_seq_length = decoder_seq_length // tp_size

    if model_type == ModelType.encoder_and_decoder:
        if parallel_state.is_pipeline_stage_before_split(rank):
            tensor_shapes.append((seq_length, micro_batch_size, config.hidden_size))
        else:
            tensor_shapes.append((decoder_seq_length, micro_batch_size, config.hidden_size))
            tensor_shapes.append((seq_length, micro_batch_size, config.hidden_size))
    else:
        tensor_shapes.append((seq_length, micro_batch_size, config.hidden_size))
    return tensor_shapes


def recv_forward(tensor_shapes, config):
    """Receive one tensor per shape from the previous stage (None for a None shape)."""
    input_tensors = []
    for tensor_shape in tensor_shapes:
        if tensor_shape is None:
            input_tensors.append(None)
        else:
            input_tensors.append(p2p_communication.recv_forward(tensor_shape, config))
    return input_tensors


def recv_backward(tensor_shapes, config):
    """Receive one output gradient per shape from the next stage."""
    output_tensor_grads = []
    for tensor_shape in tensor_shapes:
        if tensor_shape is None:
            output_tensor_grads.append(None)
        else:
            output_tensor_grads.append(p2p_communication.recv_backward(tensor_shape, config))
    return output_tensor_grads


def send_forward(output_tensors, tensor_shapes, config):
    """Send each output tensor to the next stage."""
    if not isinstance(output_tensors, list):
        output_tensors = [output_tensors]
    for output_tensor, tensor_shape in zip(output_tensors, tensor_shapes):
        if tensor_shape is None:
            continue
        p2p_communication.send_forward(output_tensor, config)


def send_backward(input_tensor_grads, tensor_shapes, config):
    """Send each input gradient to the previous stage."""
    if not isinstance(input_tensor_grads, list):
        input_tensor_grads = [input_tensor_grads]
    for input_tensor_grad, tensor_shape in zip(input_tensor_grads, tensor_shapes):
        if tensor_shape is None:
            continue
        p2p_communication.send_backward(input_tensor_grad, config)


def send_forward_recv_backward(output_tensors, tensor_shapes, config):
    """Send outputs downstream and receive their gradients, tensor by tensor."""
    if not isinstance(output_tensors, list):
        output_tensors = [output_tensors]
    output_tensor_grads = []
    for output_tensor, tensor_shape in zip(output_tensors, tensor_shapes):
        if tensor_shape is None:
            output_tensor_grads.append(None)
            continue
        output_tensor_grad = p2p_communication.send_forward_recv_backward(
            output_tensor, tensor_shape, config
        )
        output_tensor_grads.append(output_tensor_grad)
    return output_tensor_grads


def send_backward_recv_forward(input_tensor_grads, tensor_shapes, config):
    """Send input gradients upstream and receive the next inputs, tensor by tensor."""
    if not isinstance(input_tensor_grads, list):
        input_tensor_grads = [input_tensor_grads]
    input_tensors = []
    for input_tensor_grad, tensor_shape in zip(input_tensor_grads, tensor_shapes):
        if tensor_shape is None:
            input_tensors.append(None)
            continue
        input_tensor = p2p_communication.send_backward_recv_forward(
            input_tensor_grad, tensor_shape, config
        )
        input_tensors.append(input_tensor)
    return input_tensors


def get_num_warmup_microbatches_without_interleaving(
    pipeline_parallel_size: int, pipeline_parallel_rank: int, num_microbatches: int
) -> int:
    """1F1B warm-up forwards on a stage: min(pp - rank - 1, num_microbatches)."""
    return min(pipeline_parallel_size - pipeline_parallel_rank - 1, num_microbatches)


def forward_backward_pipelining_without_interleaving(
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
    """1F1B pipeline schedule: warm-up forwards, steady one-forward-one-backward, cool-down.

    Stage r runs min(pp - r - 1, num_microbatches) warm-up forwards, then alternates forward and
    backward, then drains the remaining backwards. Gradient sync (no_sync) is enabled only for the
    last micro-batch's backward.

    Returns:
        The list of loss-reduction dicts on the last stage, [] on the others.
    """
    if isinstance(model, list):
        assert (
            len(model) == 1
        ), "non-interleaved pipeline parallelism does not support model chunking"
        model = model[0]
    if isinstance(data_iterator, list):
        assert (
            len(data_iterator) == 1
        ), "non-interleaved pipeline parallelism does not support model chunking"
        data_iterator = data_iterator[0]

    config = get_model_config(model)
    if config.overlap_p2p_comm:
        raise ValueError(
            "Non-interleaved pipeline parallelism does not support overlapping p2p communication"
        )
    validate_pipeline_config(config, num_microbatches)
    model_type = get_model_type(model)
    if model_type == ModelType.encoder_and_decoder and decoder_seq_length is None:
        raise ValueError("decoder_seq_length must be given for an encoder_and_decoder model")

    _start_timer(config, 'forward-backward')

    # Disable async grad reductions
    no_sync_func = config.no_sync_func
    if no_sync_func is None:
        no_sync_func = contextlib.nullcontext
    no_sync_context = None

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

    # Compute number of warmup microbatches.
    rank = parallel_state.get_pipeline_model_parallel_rank()
    num_warmup_microbatches = get_num_warmup_microbatches_without_interleaving(
        parallel_state.get_pipeline_model_parallel_world_size(), rank, num_microbatches
    )
    num_microbatches_remaining = num_microbatches - num_warmup_microbatches

    # Checkpoint the activations of partial Transformer layers in a number of micro-batches
    # within the maximum outstanding micro-batch backpropagations.
    max_outstanding_backprops = None
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        max_outstanding_backprops = num_warmup_microbatches + 1

    recv_tensor_shapes = get_tensor_shapes(
        rank=rank - 1,
        model_type=model_type,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
    )
    send_tensor_shapes = get_tensor_shapes(
        rank=rank,
        model_type=model_type,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length,
        config=config,
    )

    # Input, output tensors only need to be saved when doing backward passes
    input_tensors = None
    output_tensors = None
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_current_device())

    if not forward_only:
        input_tensors = []
        output_tensors = []
    forward_data_store = []

    def checkpoint_flag(microbatch_index):
        if max_outstanding_backprops is None:
            return None
        return (
            microbatch_index % max_outstanding_backprops
            >= config.num_microbatches_with_partial_activation_checkpoints
        )

    # Run warmup forward passes.
    for i in range(num_warmup_microbatches):
        input_tensor = recv_forward(recv_tensor_shapes, config)
        output_tensor, num_tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            input_tensor,
            forward_data_store,
            config,
            collect_non_loss_data,
            checkpoint_flag(i),
            check_first_val_step(first_val_step, forward_only, i == 0),
            current_microbatch=i,
        )
        send_forward(output_tensor, send_tensor_shapes, config)
        total_num_tokens += torch.as_tensor(num_tokens).to(total_num_tokens.device)

        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            deallocate_output_tensor(output_tensor[0], config.deallocate_pipeline_outputs)

    # Before running 1F1B, need to receive first forward tensor.
    # If all microbatches are run in warmup / cooldown phase, then no need to
    # receive this tensor here.
    if num_microbatches_remaining > 0:
        input_tensor = recv_forward(recv_tensor_shapes, config)

    # Run 1F1B in steady state.
    for i in range(num_microbatches_remaining):
        last_iteration = i == (num_microbatches_remaining - 1)

        output_tensor, num_tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            input_tensor,
            forward_data_store,
            config,
            collect_non_loss_data,
            checkpoint_flag(i + num_warmup_microbatches),
            check_first_val_step(
                first_val_step, forward_only, (i == 0) and (num_warmup_microbatches == 0)
            ),
            current_microbatch=i + num_warmup_microbatches,
        )
        total_num_tokens += torch.as_tensor(num_tokens).to(total_num_tokens.device)

        if forward_only:
            send_forward(output_tensor, send_tensor_shapes, config)

            if not last_iteration:
                input_tensor = recv_forward(recv_tensor_shapes, config)

        else:
            output_tensor_grad = send_forward_recv_backward(
                output_tensor, send_tensor_shapes, config
            )

            # Add input_tensor and output_tensor to end of list.
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            deallocate_output_tensor(output_tensor[0], config.deallocate_pipeline_outputs)

            # Pop input_tensor and output_tensor from the start of the list for
            # the backward pass.
            input_tensor = input_tensors.pop(0)
            output_tensor = output_tensors.pop(0)

            # Enable grad sync for the last microbatch in the batch if the full
            # backward pass completes in the 1F1B stage.
            if num_warmup_microbatches == 0 and last_iteration:
                if config.grad_sync_func is None or rank == 0:
                    enable_grad_sync()

            input_tensor_grad = backward_step(
                input_tensor, output_tensor, output_tensor_grad, model_type, config
            )

            if last_iteration:
                input_tensor = None
                send_backward(input_tensor_grad, recv_tensor_shapes, config)
            else:
                input_tensor = send_backward_recv_forward(
                    input_tensor_grad, recv_tensor_shapes, config
                )

    # Run cooldown backward passes.
    if not forward_only:
        for i in range(num_warmup_microbatches):

            # Enable async grad reduction in the last backward pass
            # Note: If grad sync function is provided, only enable
            # async grad reduction in first pipeline stage. Other
            # pipeline stages do grad reduction during pipeline
            # bubble.
            if i == num_warmup_microbatches - 1:
                if config.grad_sync_func is None or rank == 0:
                    enable_grad_sync()

            input_tensor = input_tensors.pop(0)
            output_tensor = output_tensors.pop(0)

            output_tensor_grad = recv_backward(send_tensor_shapes, config)

            input_tensor_grad = backward_step(
                input_tensor, output_tensor, output_tensor_grad, model_type, config
            )

            send_backward(input_tensor_grad, recv_tensor_shapes, config)

        # Launch any remaining grad reductions.
        if no_sync_context is not None:
            enable_grad_sync()
            if config.grad_sync_func is not None:
                config.grad_sync_func(model.parameters())
    else:
        enable_grad_sync()

    _finalize(config, [model], forward_only, total_num_tokens)
    _stop_timer(config, 'forward-backward')
    return forward_data_store


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

    _start_timer(config, 'forward-backward')

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
        recv_prev = True
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            # First stage is ahead of last stage by (pipeline_parallel_size - 1).
            next_forward_model_chunk_id = get_model_chunk_id(
                forward_k - (pipeline_parallel_size - 1), forward=True
            )
            if next_forward_model_chunk_id == (num_model_chunks - 1):
                recv_prev = False
            next_forward_model_chunk_id += 1
        else:
            next_forward_model_chunk_id = get_model_chunk_id(forward_k + 1, forward=True)

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
        recv_next = True
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            # Last stage is ahead of first stage by (pipeline_parallel_size - 1).
            next_backward_model_chunk_id = get_model_chunk_id(
                backward_k - (pipeline_parallel_size - 1), forward=False
            )
            if next_backward_model_chunk_id == 0:
                recv_next = False
            next_backward_model_chunk_id -= 1
        else:
            next_backward_model_chunk_id = get_model_chunk_id(backward_k + 1, forward=False)

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
        recv_prev = True
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            # First stage is ahead of last stage by (pipeline_parallel_size - 1).
            next_forward_model_chunk_id = get_model_chunk_id(
                forward_k - (pipeline_parallel_size - 1), forward=True
            )
            if next_forward_model_chunk_id == (num_model_chunks - 1):
                recv_prev = False
            next_forward_model_chunk_id += 1
        else:
            next_forward_model_chunk_id = get_model_chunk_id(forward_k + 1, forward=True)

        recv_next = True
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            # Last stage is ahead of first stage by (pipeline_parallel_size - 1).
            next_backward_model_chunk_id = get_model_chunk_id(
                backward_k - (pipeline_parallel_size - 1), forward=False
            )
            if next_backward_model_chunk_id == 0:
                recv_next = False
            next_backward_model_chunk_id -= 1
        else:
            next_backward_model_chunk_id = get_model_chunk_id(backward_k + 1, forward=False)

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

    _finalize(config, model, forward_only, total_num_tokens)
    _stop_timer(config, 'forward-backward')
    return forward_data_store
