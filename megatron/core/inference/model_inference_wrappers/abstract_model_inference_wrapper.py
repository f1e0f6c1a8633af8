"""`AbstractModelInferenceWrapper`: one inference forward of a (tensor / pipeline parallel) model.

The wrapper owns the static KV cache (`InferenceParams`) of the batch being generated and runs
one forward over a window of positions:

- Tensor parallelism: the model's layers communicate themselves; when the model returns logits
  split over the vocabulary ([b, w, v/tp], `parallel_output=True`) they are all-gathered over the
  TP group into [b, w, v] (a model built with `parallel_output=False` already returns them full).
- Pipeline parallelism: a non-first stage receives [w, b, h] from the previous stage (blocking
  recv), runs its layers and sends its output on; logits exist on the last stage only (None
  elsewhere). Above `inference_batch_times_seqlen_threshold` (b * w > threshold, as megatron-core;
  the legacy path uses >=) the batch runs as micro-batches of rows, one after the other, each
  writing its rows of the KV cache (`batch_size_offset`).
- Dynamic batching (`forward_packed`): one packed sequence [1, T] of many requests' tokens, with a
  `DynamicInferenceContext` as the model's inference_params; stages exchange [T, 1, h].
"""

import abc
from collections.abc import Iterable
from typing import List, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.inference.communication_utils import (
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    recv_from_prev_pipeline_rank_,
    send_to_next_pipeline_rank,
)
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
    InferenceWrapperConfig,
)
from megatron.core.inference_params import InferenceParams
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.utils import get_current_device


class AbstractModelInferenceWrapper(abc.ABC):
    """Runs inference forwards of `model` (one pipeline stage of it).

    Args:
        model: the model of this stage (a GPTModel or anything with the same forward and
            `set_input_tensor`); not a list (interleaved pipelines are not supported).
        inference_wrapper_config (InferenceWrapperConfig): sizes and dtypes.
        pg_collection (ProcessGroupCollection, optional): `tp`, `pp` and `ep` (expert
            parallel: MoE models only) groups of the model (None: the global groups).
    """

    def __init__(
        self,
        model,
        inference_wrapper_config: InferenceWrapperConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        assert not isinstance(model, Iterable), (
            'interleaving schedule is not supported for inference'
        )
        config = getattr(model, 'config', None)
        if config is not None and getattr(config, 'sequence_parallel', False):
            raise ValueError(
                "sequence parallelism is not supported for inference: build the model without "
                "--sequence-parallel (the weights are the same)"
            )
        self.model = model
        self.inference_wrapper_config = inference_wrapper_config
        self.pg_collection = resolve_process_groups(pg_collection, ("tp", "pp", "ep"))
        self.pipeline_communication_dtype = (
            torch.float
            if inference_wrapper_config.fp32_residual_connection
            else inference_wrapper_config.params_dtype
        )
        self.model_is_pipeline_parallel = self.pg_collection.pp.size() > 1
        self.inference_params: Optional[InferenceParams] = None
        self.prompts_tokens: Optional[torch.Tensor] = None

    # Pipeline stages of this wrapper's model.
    def is_first_stage(self) -> bool:
        return is_pipeline_first_stage(self.pg_collection.pp)

    def is_last_stage(self) -> bool:
        return is_pipeline_last_stage(self.pg_collection.pp)

    def prep_model_for_inference(self, prompts_tokens: torch.Tensor):
        """Start a static batch: eval mode and a fresh KV cache [S, b] for prompts_tokens [b, S]
        (prompts padded to their final width)."""
        self.model.eval()
        self.prompts_tokens = prompts_tokens
        batch_size, max_sequence_length = prompts_tokens.shape
        self.inference_params = InferenceParams(batch_size, max_sequence_length)

    @abc.abstractmethod
    def get_batch_for_context_window(
        self, context_start_position: int, context_end_position: int
    ) -> List:
        """The model inputs of the window [start, end) of the static batch."""

    def _gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., v/tp] -> [..., v] when the model keeps its logits split over the TP group."""
        if logits.size(-1) != self.inference_wrapper_config.padded_vocab_size:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(
                logits, group=self.pg_collection.tp
            )
        return logits

    def _stage_forward(self, recv_shape, tokens, position_ids, attention_mask, inference_params):
        """Receive this stage's input [w, b, h], run the stage, send its output on."""
        recv_buffer = None
        if not self.is_first_stage():
            recv_buffer = torch.empty(
                recv_shape, dtype=self.pipeline_communication_dtype, device=get_current_device()
            )
            recv_from_prev_pipeline_rank_(recv_buffer, self.pg_collection.pp)
        if self.model_is_pipeline_parallel:
            self.model.set_input_tensor(recv_buffer)
        output = self.model(tokens, position_ids, attention_mask, inference_params=inference_params)
        if not self.is_last_stage():
            send_to_next_pipeline_rank(
                output.to(self.pipeline_communication_dtype), self.pg_collection.pp
            )
            return None
        return self._gather_logits(output)

    def run_one_forward_step(self, inference_input: List) -> Optional[torch.Tensor]:
        """One forward of the static batch over the window `inference_input` (from
        `get_batch_for_context_window`); advances the KV cache by the window's width.

        Returns:
            logits [b, w, v] (fp32 or the model's dtype) on the last stage, None on the others
            (with materialize_only_last_token_logits: [b, 1, v]).
        """
        tokens, position_ids, attention_mask = inference_input
        batch_size, width = tokens.shape
        threshold = self.inference_wrapper_config.inference_batch_times_seqlen_threshold
        if self.model_is_pipeline_parallel and 0 <= threshold < batch_size * width:
            logits = self._forward_in_micro_batches(inference_input, max(1, threshold // width))
        else:
            logits = self._stage_forward(
                (width, batch_size, self.inference_wrapper_config.hidden_size),
                tokens,
                position_ids,
                attention_mask,
                self.inference_params,
            )
        self.inference_params.sequence_len_offset += width
        return logits

    def _forward_in_micro_batches(self, inference_input, micro_batch_size):
        """The rows in micro-batches of `micro_batch_size`, one after the other through the
        pipeline; the last stage assembles the logits."""
        tokens, position_ids, attention_mask = inference_input
        batch_size, width = tokens.shape
        logits = None
        for start in range(0, batch_size, micro_batch_size):
            end = min(start + micro_batch_size, batch_size)
            out = self._stage_forward(
                (width, end - start, self.inference_wrapper_config.hidden_size),
                tokens[start:end],
                position_ids[start:end],
                attention_mask,
                self.inference_params,
            )
            if out is not None:
                if logits is None:
                    logits = torch.empty(
                        (batch_size,) + tuple(out.shape[1:]), dtype=out.dtype, device=out.device
                    )
                logits[start:end] = out
            self.inference_params.batch_size_offset += end - start
        self.inference_params.batch_size_offset = 0
        return logits

    def forward_packed(self, input_ids, position_ids, context) -> Optional[torch.Tensor]:
        """One forward of a packed step of the dynamic engine.

        Args:
            input_ids, position_ids: [1, T] the step's tokens of every scheduled request.
            context (DynamicInferenceContext): the paged KV cache; it tells the attention which
                tokens belong to which request and the output layer which positions need
                logits.

        Returns:
            logits [1, N, v] of the N positions `context` asks for, on the last stage (None on
            the others).
        """
        if self.model.training:
            self.model.eval()
        num_tokens = input_ids.size(1)
        return self._stage_forward(
            (num_tokens, 1, self.inference_wrapper_config.hidden_size),
            input_ids,
            position_ids,
            None,
            context,
        )
