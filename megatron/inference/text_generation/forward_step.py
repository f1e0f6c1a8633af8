"""One inference forward of the (possibly pipelined) model, with its KV cache.

`ForwardStep(model, max_batch_size, max_sequence_length)` owns the request's `InferenceParams`.
Each call feeds the columns [sequence_len_offset, sequence_len_offset + width) of the batch: a
non-first stage first receives the previous stage's activations [width, b, h], runs its layers,
and sends its output on; the last stage returns logits [b, width, v] (the full padded vocabulary,
the model being built with parallel_output=False).

With pipeline parallelism and b * width >= --inference-batch-times-seqlen-threshold the batch is
split into micro-batches of max(1, threshold // width) rows that go through the pipeline one after
the other, each writing its own rows of the KV cache (`batch_size_offset`).
"""

from collections.abc import Iterable

import torch

from megatron.core import InferenceParams
from megatron.core import parallel_state as mpu
from megatron.core.utils import get_current_device
from megatron.inference.text_generation.communication import (
    recv_from_prev_pipeline_rank_,
    send_to_next_pipeline_rank,
)
from megatron.training.global_vars import get_args


class ForwardStep:
    """Forward step function with all the communications.

    Args:
        model: the model of this pipeline stage (not a list: interleaving is not supported).
        max_batch_size (int): rows of the KV cache.
        max_sequence_length (int): positions of the KV cache.
    """

    def __init__(self, model, max_batch_size, max_sequence_length):
        assert not isinstance(model, Iterable), (
            'interleaving schedule is not supported for inference'
        )
        model.eval()
        self.model = model
        # A fresh cache per request.
        self.inference_params = InferenceParams(max_batch_size, max_sequence_length)
        args = get_args()
        self.pipeline_size_larger_than_one = args.pipeline_model_parallel_size > 1
        # Threshold of pipelining.
        self.pipelining_batch_x_seqlen = args.inference_batch_times_seqlen_threshold

    def __call__(self, tokens, position_ids, attention_mask):
        """tokens, position_ids [b, width] -> logits [b, width, v] on the last stage, else None."""
        if self.pipeline_size_larger_than_one:
            current_batch_x_seqlen = tokens.size(0) * tokens.size(1)
            if current_batch_x_seqlen >= self.pipelining_batch_x_seqlen:
                micro_batch_size = max(1, self.pipelining_batch_x_seqlen // tokens.size(1))
                return self._with_pipelining_forward_step(
                    tokens, position_ids, attention_mask, micro_batch_size
                )
        return self._no_pipelining_forward_step(tokens, position_ids, attention_mask)

    def _forward(self, tokens, position_ids, attention_mask):
        return self.model(
            tokens, position_ids, attention_mask, inference_params=self.inference_params
        )

    def _forward_step_helper(self, tokens, position_ids, attention_mask, recv_buffer=None):
        """Receive this stage's input, run it, send its output on."""
        batch_size = tokens.size(0)
        sequence_length = tokens.size(1)
        if recv_buffer is None:
            recv_buffer = _allocate_recv_buffer(batch_size, sequence_length)

        recv_from_prev_pipeline_rank_(recv_buffer)
        self.model.set_input_tensor(recv_buffer)
        output_tensor = self._forward(tokens, position_ids, attention_mask)
        send_to_next_pipeline_rank(output_tensor)
        return output_tensor

    def _no_pipelining_forward_step(self, tokens, position_ids, attention_mask, recv_buffer=None):
        """The whole batch in one pass through the pipeline."""
        output_tensor = self._forward_step_helper(
            tokens, position_ids, attention_mask, recv_buffer=recv_buffer
        )
        # Advance the cache position.
        self.inference_params.sequence_len_offset += tokens.size(1)

        logits = None
        if mpu.is_pipeline_last_stage():
            logits = output_tensor
        return logits

    def _with_pipelining_forward_step(self, tokens, position_ids, attention_mask, micro_batch_size):
        """The batch in micro-batches of `micro_batch_size` rows, one after the other."""
        sequence_length = tokens.size(1)
        batch_size = tokens.size(0)

        num_micro_batches, last_chunk = divmod(batch_size, micro_batch_size)
        if last_chunk > 0:
            num_micro_batches += 1

        logits = None
        if mpu.is_pipeline_last_stage():
            args = get_args()
            logits_length = (
                1 if self.inference_params.materialize_only_last_token_logits else sequence_length
            )
            logits = torch.empty(
                (batch_size, logits_length, args.padded_vocab_size),
                dtype=torch.float32,
                device=get_current_device(),
            )

        # One receive buffer for all micro-batches when they all have the same size.
        recv_buffer = None
        if last_chunk == 0:
            recv_buffer = _allocate_recv_buffer(micro_batch_size, sequence_length)

        for micro_batch_index in range(num_micro_batches):
            start = micro_batch_index * micro_batch_size
            end = min(start + micro_batch_size, batch_size)
            this_micro_batch_size = end - start
            tokens2use = tokens[start:end, ...]
            position_ids2use = position_ids[start:end, ...]

            if this_micro_batch_size != micro_batch_size:
                recv_buffer = None
            output = self._forward_step_helper(
                tokens2use, position_ids2use, attention_mask, recv_buffer=recv_buffer
            )

            # Next micro-batch writes the next rows of the cache.
            self.inference_params.batch_size_offset += this_micro_batch_size

            if mpu.is_pipeline_last_stage():
                logits[start:end, ...] = output

        # Once all micro-batches are done, advance the cache position and rewind the rows.
        self.inference_params.sequence_len_offset += sequence_length
        self.inference_params.batch_size_offset = 0
        return logits


def _get_recv_buffer_dtype(args):
    """Activations travel in params_dtype, or fp32 with --fp32-residual-connection."""
    if args.fp32_residual_connection:
        return torch.float
    return args.params_dtype


def _allocate_recv_buffer(batch_size, sequence_length):
    """Receive buffer [width, b, h] of a non-first stage (None on the first stage)."""
    if mpu.is_pipeline_first_stage():
        return None
    args = get_args()
    recv_size = (sequence_length, batch_size, args.hidden_size)
    return torch.empty(recv_size, dtype=_get_recv_buffer_dtype(args), device=get_current_device())
