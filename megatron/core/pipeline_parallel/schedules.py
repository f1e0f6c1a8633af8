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

The per-micro-batch steps live in `microbatch_step.py` and the interleaved schedule in
`interleaved_schedule.py`; both are re-exported here, where Megatron users look for them.
"""

import contextlib
from typing import Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.pipeline_parallel.interleaved_schedule import (  # noqa: F401 (re-exported)
    forward_backward_pipelining_with_interleaving,
    get_num_warmup_microbatches_with_interleaving,
)
from megatron.core.pipeline_parallel.microbatch_step import (  # noqa: F401 (re-exported)
    backward_step,
    check_first_val_step,
    custom_backward,
    deallocate_output_tensor,
    finalize_model_grads_if_training,
    forward_step,
    is_stage_before_split,
    set_current_microbatch,
    start_timer,
    stop_timer,
    validate_pipeline_config,
)
from megatron.core.utils import get_current_device, get_model_config, get_model_type

# Types
Shape = Union[List[int], torch.Size]


def get_forward_backward_func() -> Callable:
    """The schedule matching the current pipeline layout.

    Returns:
        forward_backward_no_pipelining when the pipeline has one stage;
        forward_backward_pipelining_with_interleaving when a virtual pipeline size is set;
        forward_backward_pipelining_without_interleaving (1F1B) otherwise.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    interleaved = parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None
    return (
        forward_backward_pipelining_with_interleaving
        if interleaved
        else forward_backward_pipelining_without_interleaving
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
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Run forward and backward over all micro-batches with no pipeline.

    Micro-batches 0..n-2 run under config.no_sync_func (gradient accumulation without data-parallel
    reduction); the last one runs with gradient sync enabled.

    Args:
        pp_group: the pipeline group (None: the global pipeline group, as in Megatron). No p2p
            happens here; the group only decides whether this rank is the last stage (applies
            the loss).

    Returns:
        The list of loss-reduction dicts, one per micro-batch.
    """
    if isinstance(model, list):
        assert len(model) == 1, "non-pipeline-parallel schedule does not support model chunking"
        model = model[0]
    if isinstance(data_iterator, list):
        assert len(data_iterator) == 1, (
            "non-pipeline-parallel schedule does not support model chunking"
        )
        data_iterator = data_iterator[0]

    config = get_model_config(model)
    validate_pipeline_config(config, num_microbatches)
    start_timer(config, 'forward-backward')

    model_type = get_model_type(model)
    losses = []  # what forward_step collects: one loss-reduction dict per micro-batch
    total_num_tokens = torch.zeros([], dtype=torch.int, device=get_current_device())

    def run(index: int) -> None:
        """Forward (and, when training, backward) micro-batch `index`; no stage neighbours, so
        there is no input tensor and the output's gradient is the loss's own."""
        nonlocal total_num_tokens
        output_tensor, num_tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            None,
            losses,
            config,
            collect_non_loss_data,
            is_first_microbatch=check_first_val_step(first_val_step, forward_only, index == 0),
            current_microbatch=index,
            pp_group=pp_group,
        )
        total_num_tokens += torch.as_tensor(num_tokens).to(total_num_tokens.device)
        if not forward_only:
            backward_step(None, output_tensor, None, model_type, config, pp_group)

    # Gradients accumulate locally over all but the last micro-batch (no data-parallel
    # reduction inside no_sync); the last one's backward lets DDP reduce them.
    with (config.no_sync_func or contextlib.nullcontext)():
        for index in range(num_microbatches - 1):
            run(index)
    run(num_microbatches - 1)

    finalize_model_grads_if_training(config, [model], forward_only, total_num_tokens)
    stop_timer(config, 'forward-backward')
    return losses


def get_tensor_shapes(
    *,
    rank: int,
    model_type: ModelType,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int],
    config,
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> List[tuple]:
    """Shapes of the tensors a pipeline stage `rank` sends downstream.

    encoder_or_decoder: one tensor [s, b, h]. encoder_and_decoder: stages before the split rank send
    the encoder's [s, b, h]; stages after it send the decoder's [s_dec, b, h] and pass the
    encoder's output [s, b, h] along. s is divided by CP and, under sequence parallelism, by TP.
    """
    # The sequence each stage holds: split by CP, and by TP under sequence parallelism.
    divisor = parallel_state.get_context_parallel_world_size()
    if config.sequence_parallel:
        divisor *= parallel_state.get_tensor_model_parallel_world_size()

    def shape(length: int) -> tuple:
        return (length // divisor, micro_batch_size, config.hidden_size)  # [s, b, h]

    if model_type != ModelType.encoder_and_decoder or is_stage_before_split(rank, pp_group):
        return [shape(seq_length)]
    # A decoder stage passes its own activations and the encoder's output.
    return [shape(decoder_seq_length), shape(seq_length)]


def _listed(tensors) -> list:
    return tensors if isinstance(tensors, list) else [tensors]


def _over_shapes(exchange, tensor_shapes, tensors=None) -> list:
    """exchange(tensor, shape) for each stage tensor in order (tensor None for a receive);
    a None shape (the tensor this stage does not pass) gives None and no communication."""
    tensors = [None] * len(tensor_shapes) if tensors is None else _listed(tensors)
    return [
        None if shape is None else exchange(tensor, shape)
        for tensor, shape in zip(tensors, tensor_shapes)
    ]


def recv_forward(tensor_shapes, config, pp_group=None):
    """Receive one tensor per shape from the previous stage (None for a None shape)."""
    return _over_shapes(
        lambda _, shape: p2p_communication.recv_forward(shape, config, pp_group), tensor_shapes
    )


def recv_backward(tensor_shapes, config, pp_group=None):
    """Receive one output gradient per shape from the next stage."""
    return _over_shapes(
        lambda _, shape: p2p_communication.recv_backward(shape, config, pp_group), tensor_shapes
    )


def send_forward(output_tensors, tensor_shapes, config, pp_group=None):
    """Send each output tensor to the next stage."""
    _over_shapes(
        lambda tensor, _: p2p_communication.send_forward(tensor, config, pp_group),
        tensor_shapes,
        output_tensors,
    )


def send_backward(input_tensor_grads, tensor_shapes, config, pp_group=None):
    """Send each input gradient to the previous stage."""
    _over_shapes(
        lambda grad, _: p2p_communication.send_backward(grad, config, pp_group),
        tensor_shapes,
        input_tensor_grads,
    )


def send_forward_recv_backward(output_tensors, tensor_shapes, config, pp_group=None):
    """Send outputs downstream and receive their gradients, tensor by tensor."""
    return _over_shapes(
        lambda tensor, shape: p2p_communication.send_forward_recv_backward(
            tensor, shape, config, pp_group
        ),
        tensor_shapes,
        output_tensors,
    )


def send_backward_recv_forward(input_tensor_grads, tensor_shapes, config, pp_group=None):
    """Send input gradients upstream and receive the next inputs, tensor by tensor."""
    return _over_shapes(
        lambda grad, shape: p2p_communication.send_backward_recv_forward(
            grad, shape, config, pp_group
        ),
        tensor_shapes,
        input_tensor_grads,
    )


def get_num_warmup_microbatches_without_interleaving(
    pipeline_parallel_size: int, pipeline_parallel_rank: int, num_microbatches: int
) -> int:
    """1F1B warm-up forwards on a stage: min(pp - rank - 1, num_microbatches)."""
    return min(pipeline_parallel_size - pipeline_parallel_rank - 1, num_microbatches)


class _GradSync:
    """Asynchronous grad reductions (DDP hooks) held off with `config.no_sync_func` until the
    micro-batch whose backward should launch them."""

    def __init__(self, config):
        self.no_sync_func = config.no_sync_func or contextlib.nullcontext
        self.context = None

    def disable(self):
        if self.context is None:
            self.context = self.no_sync_func()
            self.context.__enter__()

    def enable(self):
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


class _OneFOneB:
    """The state and named steps of the 1F1B schedule on one stage (see
    `forward_backward_pipelining_without_interleaving`)."""

    def __init__(
        self,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        config,
        collect_non_loss_data,
        first_val_step,
        forward_only,
        pp_group,
    ):
        self.forward_step_func = forward_step_func
        self.data_iterator = data_iterator
        self.model = model
        self.num_microbatches = num_microbatches
        self.config = config
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.forward_only = forward_only
        self.pp_group = pp_group
        self.model_type = get_model_type(model)
        self.grad_sync = _GradSync(config)
        if pp_group is None:
            # Megatron's group-less call: the global pipeline rank (which tests may override).
            self.rank = parallel_state.get_pipeline_model_parallel_rank()
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        else:
            self.rank, pp_size = pp_group.rank(), pp_group.size()
        self.num_warmup = get_num_warmup_microbatches_without_interleaving(
            pp_size, self.rank, num_microbatches
        )
        self.num_remaining = num_microbatches - self.num_warmup
        # Checkpoint the activations of partial Transformer layers in a number of micro-batches
        # within the maximum outstanding micro-batch backpropagations.
        self.max_outstanding_backprops = None
        if config.num_microbatches_with_partial_activation_checkpoints is not None:
            self.max_outstanding_backprops = self.num_warmup + 1
        # Input and output tensors are kept for the backward passes only.
        self.input_tensors = [] if not forward_only else None
        self.output_tensors = [] if not forward_only else None
        self.forward_data_store = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=get_current_device())
        self.recv_tensor_shapes = None
        self.send_tensor_shapes = None

    def set_tensor_shapes(self, seq_length, micro_batch_size, decoder_seq_length):
        """Shapes received from the previous stage (rank - 1) and sent to the next (rank)."""
        config, model_type, pp_group, rank = self.config, self.model_type, self.pp_group, self.rank
        recv_tensor_shapes = get_tensor_shapes(
            rank=rank - 1,
            model_type=model_type,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            config=config,
            pp_group=pp_group,
        )
        send_tensor_shapes = get_tensor_shapes(
            rank=rank,
            model_type=model_type,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            config=config,
            pp_group=pp_group,
        )
        self.recv_tensor_shapes, self.send_tensor_shapes = recv_tensor_shapes, send_tensor_shapes

    def _checkpoint_flag(self, microbatch_index):
        if self.max_outstanding_backprops is None:
            return None
        return (
            microbatch_index % self.max_outstanding_backprops
            >= self.config.num_microbatches_with_partial_activation_checkpoints
        )

    def forward(self, microbatch, input_tensor, is_first_step):
        """Forward one micro-batch; counts its tokens and returns its output tensor(s)."""
        output_tensor, num_tokens = forward_step(
            self.forward_step_func,
            self.data_iterator,
            self.model,
            self.num_microbatches,
            input_tensor,
            self.forward_data_store,
            self.config,
            self.collect_non_loss_data,
            self._checkpoint_flag(microbatch),
            check_first_val_step(self.first_val_step, self.forward_only, is_first_step),
            current_microbatch=microbatch,
            pp_group=self.pp_group,
        )
        self.total_num_tokens += torch.as_tensor(num_tokens).to(self.total_num_tokens.device)
        return output_tensor

    def keep_for_backward(self, input_tensor, output_tensor):
        self.input_tensors.append(input_tensor)
        self.output_tensors.append(output_tensor)
        deallocate_output_tensor(output_tensor[0], self.config.deallocate_pipeline_outputs)

    def backward_oldest(self, output_tensor_grad):
        """Backward the oldest kept micro-batch; returns its input gradient."""
        input_tensor = self.input_tensors.pop(0)
        output_tensor = self.output_tensors.pop(0)
        return backward_step(
            input_tensor,
            output_tensor,
            output_tensor_grad,
            self.model_type,
            self.config,
            self.pp_group,
        )

    def _enable_grad_sync_for_last_backward(self):
        # With a custom grad sync function only the first stage launches the reduction here;
        # the other stages reduce during the pipeline bubble.
        if self.config.grad_sync_func is None or self.rank == 0:
            self.grad_sync.enable()

    def warmup(self):
        """Forwards of the first `num_warmup` micro-batches, each sent on at once."""
        config, pp_group = self.config, self.pp_group
        for i in range(self.num_warmup):
            input_tensor = recv_forward(self.recv_tensor_shapes, config, pp_group)
            output_tensor = self.forward(i, input_tensor, i == 0)
            send_forward(output_tensor, self.send_tensor_shapes, config, pp_group)
            if not self.forward_only:
                self.keep_for_backward(input_tensor, output_tensor)

    def steady(self):
        """One forward and one backward per step for the remaining micro-batches."""
        config, pp_group = self.config, self.pp_group
        recv_shapes, send_shapes = self.recv_tensor_shapes, self.send_tensor_shapes
        # With every micro-batch in warm-up / cool-down nothing more is received here.
        input_tensor = None
        if self.num_remaining > 0:
            input_tensor = recv_forward(recv_shapes, config, pp_group)
        for i in range(self.num_remaining):
            last_iteration = i == self.num_remaining - 1
            output_tensor = self.forward(
                i + self.num_warmup, input_tensor, i == 0 and self.num_warmup == 0
            )
            if self.forward_only:
                send_forward(output_tensor, send_shapes, config, pp_group)
                if not last_iteration:
                    input_tensor = recv_forward(recv_shapes, config, pp_group)
                continue
            output_tensor_grad = send_forward_recv_backward(
                output_tensor, send_shapes, config, pp_group
            )
            self.keep_for_backward(input_tensor, output_tensor)
            # The full backward completes here when there is no warm-up: sync on the last one.
            if self.num_warmup == 0 and last_iteration:
                self._enable_grad_sync_for_last_backward()
            input_tensor_grad = self.backward_oldest(output_tensor_grad)
            if last_iteration:
                input_tensor = None
                send_backward(input_tensor_grad, recv_shapes, config, pp_group)
            else:
                input_tensor = send_backward_recv_forward(
                    input_tensor_grad, recv_shapes, config, pp_group
                )

    def cooldown(self):
        """The backwards of the warm-up micro-batches; the last one launches the grad sync."""
        config, pp_group = self.config, self.pp_group
        for i in range(self.num_warmup):
            if i == self.num_warmup - 1:
                self._enable_grad_sync_for_last_backward()
            output_tensor_grad = recv_backward(self.send_tensor_shapes, config, pp_group)
            input_tensor_grad = self.backward_oldest(output_tensor_grad)
            send_backward(input_tensor_grad, self.recv_tensor_shapes, config, pp_group)

    def finish_grad_sync(self):
        """Launch the grad reductions still held off (all of them after forward only)."""
        if self.forward_only:
            self.grad_sync.enable()
            return
        if self.grad_sync.context is not None:
            self.grad_sync.enable()
            if self.config.grad_sync_func is not None:
                self.config.grad_sync_func(self.model.parameters())


def _single_chunk(model, data_iterator):
    """The one model chunk and data iterator of a non-interleaved schedule."""
    if isinstance(model, list):
        assert len(model) == 1, (
            "non-interleaved pipeline parallelism does not support model chunking"
        )
        model = model[0]
    if isinstance(data_iterator, list):
        assert len(data_iterator) == 1, (
            "non-interleaved pipeline parallelism does not support model chunking"
        )
        data_iterator = data_iterator[0]
    return model, data_iterator


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
    pp_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """1F1B pipeline schedule: warm-up forwards, steady one-forward-one-backward, cool-down.

    Stage r runs min(pp - r - 1, num_microbatches) warm-up forwards, then alternates forward and
    backward, then drains the remaining backwards. Gradient sync (no_sync) is enabled only for the
    last micro-batch's backward. The steps are the methods of `_OneFOneB`.

    Args:
        pp_group: the pipeline group the stages communicate over (None: the global pipeline
            group, as in Megatron). The stage index, pipeline size and first / last stage come
            from it; the encoder-decoder split rank still comes from parallel_state.

    Returns:
        The list of loss-reduction dicts on the last stage, [] on the others.
    """
    model, data_iterator = _single_chunk(model, data_iterator)
    config = get_model_config(model)
    if config.overlap_p2p_comm:
        raise ValueError(
            "Non-interleaved pipeline parallelism does not support overlapping p2p communication"
        )
    validate_pipeline_config(config, num_microbatches)
    if get_model_type(model) == ModelType.encoder_and_decoder and decoder_seq_length is None:
        raise ValueError("decoder_seq_length must be given for an encoder_and_decoder model")

    start_timer(config, 'forward-backward')
    schedule = _OneFOneB(
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        config,
        collect_non_loss_data,
        first_val_step,
        forward_only,
        pp_group,
    )
    schedule.grad_sync.disable()
    schedule.set_tensor_shapes(seq_length, micro_batch_size, decoder_seq_length)
    schedule.warmup()
    schedule.steady()
    if not forward_only:
        schedule.cooldown()
    schedule.finish_grad_sync()

    finalize_model_grads_if_training(config, [model], forward_only, schedule.total_num_tokens)
    stop_timer(config, 'forward-backward')
    return schedule.forward_data_store
