"""One micro-batch's forward and backward step, shared by every schedule in `schedules.py`.

`forward_step` runs the user's forward_step_func on one model chunk and, on the last stage, applies
the loss function and scales the loss by 1/num_microbatches; `backward_step` back-propagates a
stage's output gradient to its input. Neither communicates: the schedules move tensors between
stages with `p2p_communication`.
"""

import contextlib
from typing import Optional

import torch
from torch.autograd.variable import Variable

from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.transformer.pipeline_layer_split import uneven_split_requested
from megatron.core.utils import get_attr_wrapped_model, get_current_device, get_model_type


class PipelineScheduleError(ValueError, RuntimeError):
    """A layout or setting the schedules cannot run.

    A ValueError (a user error, one line with the numbers); also a RuntimeError, which Megatron
    r0.8's schedules raise for these and library code (its unit tests among it) catches.
    """


def validate_pipeline_config(config, num_microbatches: int, num_model_chunks: int = 1) -> None:
    """Raise PipelineScheduleError for layouts no schedule can run, before any communication.

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
        raise PipelineScheduleError(f"num_microbatches ({num_microbatches}) must be at least 1")
    if vp_size is not None and num_model_chunks != vp_size:
        raise PipelineScheduleError(
            f"got {num_model_chunks} model chunks but virtual_pipeline_model_parallel_size is "
            f"{vp_size}; pass one model chunk per virtual stage"
        )
    num_layers = getattr(config, 'num_layers', None)
    split_rank = parallel_state.get_pipeline_model_parallel_split_rank()
    if num_layers is not None and split_rank is not None and pp_size > 1:
        # Encoder-decoder: config.num_layers is the encoder depth, spread over the stages before
        # the split (the model checks the decoder's share).
        if vp_size is not None:
            raise PipelineScheduleError(
                "interleaved (virtual) pipelines are not supported for encoder-decoder models "
                f"(pipeline_model_parallel_split_rank {split_rank})"
            )
        if num_layers % split_rank != 0:
            raise PipelineScheduleError(
                f"encoder num_layers ({num_layers}) is not divisible by the "
                f"{split_rank} encoder pipeline stages (pipeline_model_parallel_split_rank)"
            )
    elif uneven_split_requested(
        getattr(config, 'first_pipeline_num_layers', None),
        getattr(config, 'last_pipeline_num_layers', None),
    ):
        pass  # TransformerConfig checked the uneven split when it was built.
    elif num_layers is not None:
        stages = pp_size * (vp_size or 1)
        if num_layers % stages != 0:
            raise PipelineScheduleError(
                f"num_layers ({num_layers}) is not divisible by pipeline_model_parallel_size "
                f"({pp_size}) x virtual_pipeline_model_parallel_size ({vp_size or 1}) = {stages}"
            )
    if vp_size is not None and num_microbatches % pp_size != 0:
        raise PipelineScheduleError(
            f"number of microbatches ({num_microbatches}) is not divisible by "
            f"pipeline-model-parallel-size ({pp_size}) when using interleaved schedule"
        )


def _is_last_stage(pp_group) -> bool:
    """Last (virtual) stage; from `pp_group` when given, else parallel_state's global stage."""
    if pp_group is None:
        return parallel_state.is_pipeline_last_stage()
    # The virtual pipeline rank is global state (set by the interleaved schedule per chunk).
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if (
        vp_size is not None
        and parallel_state.get_virtual_pipeline_model_parallel_rank() != vp_size - 1
    ):
        return False
    return pp_group.rank() == pp_group.size() - 1


def is_stage_before_split(rank: Optional[int] = None, pp_group=None) -> bool:
    """`parallel_state.is_pipeline_stage_before_split(rank)` with the stage index `rank` (default:
    this rank's) and the pipeline size taken from `pp_group` when given; the split rank is global.
    """
    if pp_group is None:
        return parallel_state.is_pipeline_stage_before_split(rank)
    if pp_group.size() == 1:
        return True
    rank = pp_group.rank() if rank is None else rank
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    return split is None or rank < split


def is_stage_after_split(rank: Optional[int] = None, pp_group=None) -> bool:
    """`parallel_state.is_pipeline_stage_after_split(rank)`, stage and size from `pp_group`."""
    if pp_group is None:
        return parallel_state.is_pipeline_stage_after_split(rank)
    if pp_group.size() == 1:
        return True
    rank = pp_group.rank() if rank is None else rank
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    return split is None or rank >= split


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
    assert grad_output is None or isinstance(grad_output, torch.Tensor), (
        "grad_output == '%s'." % type(grad_output).__name__
    )
    if grad_output is None:
        # The last stage's loss: d loss / d loss = 1.
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    engine = Variable._execution_engine
    engine.run_backward(
        (output,),  # tensors
        (grad_output,),  # grad_tensors
        False,  # keep_graph
        False,  # create_graph
        (),  # inputs: every leaf
        allow_unreachable=True,
        accumulate_grad=True,
    )


def set_current_microbatch(model, microbatch_id: int) -> None:
    """Tell the model's decoder which micro-batch runs (used by some layers for logging/FP8)."""
    try:
        decoder = get_attr_wrapped_model(model, "decoder")
    except RuntimeError:  # a model without a decoder (e.g. a vision encoder)
        return
    if decoder is not None:
        decoder.current_microbatch = microbatch_id


def _calculate_per_token_loss(config) -> bool:
    # A ModelParallelConfig (no transformer fields) never asks for per-token loss normalisation.
    return bool(getattr(config, 'calculate_per_token_loss', False))


def _set_moe_aux_loss_scale(config, num_microbatches: int) -> None:
    """The gradient the MoE auxiliary losses get in backward: the loss scale divided by the
    number of micro-batches, as the main loss (without per-token loss normalisation).

    With context parallelism each CP rank's auxiliary losses are partials over its own tokens
    (they sum to the sequence's loss) and DDP averages gradients over DP x CP, dividing them by
    cp: like the main loss (multiplied by cp in the loss function), they get a factor cp, so the
    router gradient equals CP = 1 (later Megatron's schedules do the same). Per-token losses are
    summed over DP x CP, not averaged: no factor there.
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    one = torch.ones(1, device=get_current_device())
    loss_scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    if not _calculate_per_token_loss(config):
        cp = getattr(config, 'context_parallel_size', 1)
        loss_scale = loss_scale * cp / num_microbatches
    MoEAuxLossAutoScaler.set_loss_scale(loss_scale)


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
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Forward one micro-batch through one model chunk.

    If this is the last stage, `loss_func` reduces the output: the loss is scaled by
    1/num_microbatches (and 1/num_tokens for the 3-tuple form without per-token loss) and the
    reduced dict is appended to forward_data_store. Otherwise the output tensor is returned to be
    sent downstream. The last stage and the encoder-decoder side come from `pp_group` (None: the
    global pipeline group).

    Returns:
        (output_tensor, num_tokens): output_tensor is a list unless input_tensor was a single
        tensor; num_tokens is an int tensor (0 unless loss_func reported a token count).
    """
    timers = config.timers
    if timers is not None:
        timers('forward-compute', log_level=2).start()
    if is_first_microbatch and hasattr(model, 'set_is_first_microbatch'):
        model.set_is_first_microbatch()
    if current_microbatch is not None:
        set_current_microbatch(model, current_microbatch)

    # Stages pass lists of tensors (an encoder-decoder stage passes two); a bare tensor in means
    # a bare tensor out.
    single = not isinstance(input_tensor, list)
    inputs = [input_tensor] if single else input_tensor
    get_attr_wrapped_model(model, "set_input_tensor")(inputs)

    autocast = (
        torch.autocast(get_current_device().type, dtype=config.autocast_dtype)
        if config.enable_autocast
        else contextlib.nullcontext()
    )
    step_args = (
        () if checkpoint_activations_microbatch is None else (checkpoint_activations_microbatch,)
    )
    with autocast:
        output_tensor, loss_func = forward_step_func(data_iterator, model, *step_args)

    num_tokens = torch.tensor(0, dtype=torch.int)
    if _is_last_stage(pp_group) and collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
    elif _is_last_stage(pp_group):
        output_tensor, num_tokens, loss_reduced = _reduce_loss(
            loss_func(output_tensor), config, num_microbatches
        )
        forward_data_store.append(loss_reduced)
    if timers is not None:
        timers('forward-compute').stop()

    if getattr(config, 'num_moe_experts', None) is not None or getattr(
        config, 'mtp_num_layers', None
    ):
        # MTP injects its losses through the same autoscaler.
        _set_moe_aux_loss_scale(config, num_microbatches)

    # If T5 model (or other model with encoder and decoder) and in decoder stack, then send encoder
    # hidden state downstream as well.
    model_type = get_model_type(model)
    if is_stage_after_split(pp_group=pp_group) and model_type == ModelType.encoder_and_decoder:
        return [output_tensor, inputs[-1]], num_tokens
    return (output_tensor if single else [output_tensor]), num_tokens


def _reduce_loss(outputs, config, num_microbatches: int):
    """(loss to back-propagate, token count, reduced dict) from what loss_func returned.

    (loss, n, dict): a summed loss over n tokens, divided by n (at least 1: a micro-batch with no
    loss token adds 0, not 0/0) and by the micro-batch count, unless losses are normalised per
    token over the whole batch. (loss, dict), Megatron's older form: a mean, divided by the
    micro-batch count.
    """
    if len(outputs) == 3:
        loss, num_tokens, reduced = outputs
        if not _calculate_per_token_loss(config):
            loss = loss / torch.clamp(torch.as_tensor(num_tokens), min=1)
            loss = loss / num_microbatches
        return loss, num_tokens, reduced
    assert len(outputs) == 2, "loss_func must return (loss, dict) or (loss, n, dict)"
    loss, reduced = outputs
    return loss / num_microbatches, torch.tensor(0, dtype=torch.int), reduced


def backward_step(
    input_tensor, output_tensor, output_tensor_grad, model_type, config, pp_group=None
):
    """Backward one micro-batch through one model chunk.

    Seeds autograd with output_tensor_grad (None on the last stage, where output_tensor is the
    scaled loss, then grad_scale_func applies the loss scale) and returns the gradient of the
    stage's input for the previous stage (None on the first stage). `pp_group` (None: the global
    pipeline group) decides the encoder-decoder side for the skip-connection gradient.
    """
    timers = config.timers
    if timers is not None:
        timers('backward-compute', log_level=2).start()

    # A chunk may take / produce one tensor or a list of them (encoder-decoder stages carry two);
    # work on lists and hand back the caller's form.
    single_input = not isinstance(input_tensor, list)
    inputs = [input_tensor] if single_input else input_tensor
    outputs = output_tensor if isinstance(output_tensor, list) else [output_tensor]
    grads_in = output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad]
    for tensor in inputs:
        if tensor is not None:
            tensor.retain_grad()  # a non-leaf received from the previous stage keeps its .grad

    # Only the first output is differentiated; on the last stage it is the loss and gets scaled.
    seed, seed_grad = outputs[0], grads_in[0]
    if seed_grad is None and config.grad_scale_func is not None:
        seed = config.grad_scale_func(seed)
        outputs[0] = seed
    if config.deallocate_pipeline_outputs:
        custom_backward(seed, seed_grad)
    else:
        torch.autograd.backward(seed, grad_tensors=seed_grad)

    input_grads = [None if tensor is None else tensor.grad for tensor in inputs]

    # Decoder stages of an encoder-decoder model also pass the encoder's output through; its
    # gradient arrives as the second output gradient and joins the last input's gradient.
    carries_encoder_grad = (
        model_type == ModelType.encoder_and_decoder
        and len(grads_in) > 1
        and is_stage_after_split(pp_group=pp_group)
    )
    if carries_encoder_grad and grads_in[1] is not None:
        input_grads[-1].add_(grads_in[1])

    if timers is not None:
        timers('backward-compute').stop()
    return input_grads[0] if single_input else input_grads


def check_first_val_step(first_val_step, forward_only, cond):
    """Whether this micro-batch counts as the first one (for FP8 weight caching in validation)."""
    if (first_val_step is not None) and forward_only:
        return first_val_step and cond
    return cond


def start_timer(config, name):
    if config.timers is not None:
        config.timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)


def stop_timer(config, name):
    if config.timers is not None:
        config.timers(name).stop()


def finalize_model_grads_if_training(
    config, model: list, forward_only: bool, total_num_tokens: torch.Tensor
) -> None:
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            model, total_num_tokens if _calculate_per_token_loss(config) else None
        )
