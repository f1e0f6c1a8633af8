"""`GPTInferenceWrapper`: static-batch inputs of a GPT model (left-to-right mask and positions)."""

from typing import List

import torch

from megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper import (
    AbstractModelInferenceWrapper,
)


class GPTInferenceWrapper(AbstractModelInferenceWrapper):
    """Inference wrapper of a GPTModel (see `AbstractModelInferenceWrapper`)."""

    def prep_model_for_inference(self, prompts_tokens: torch.Tensor):
        """Fresh KV cache, plus the causal mask [1, 1, S, S] (True = masked out: above the
        diagonal) and positions [b, S] (0..S-1 in every row) of the padded batch."""
        super().prep_model_for_inference(prompts_tokens)
        batch_size, seq_length = prompts_tokens.shape
        device = prompts_tokens.device
        self.attention_mask = torch.ones(
            (1, 1, seq_length, seq_length), dtype=torch.bool, device=device
        ).triu(diagonal=1)
        self.position_ids = (
            torch.arange(seq_length, dtype=torch.long, device=device)
            .unsqueeze(0)
            .expand(batch_size, -1)
        )

    def get_batch_for_context_window(
        self, context_start_position: int, context_end_position: int
    ) -> List:
        """[tokens [b, w], positions [b, w], mask [1, 1, w, end]] of the window [start, end)."""
        start, end = context_start_position, context_end_position
        return [
            self.prompts_tokens[:, start:end],
            self.position_ids[:, start:end],
            self.attention_mask[..., start:end, :end],
        ]
