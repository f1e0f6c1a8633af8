"""`MCoreEngine`: static batching (core_r0.8.0's engine).

Requests are grouped into consecutive FIFO batches of at most `max_batch_size`; each batch runs to
completion before the next starts (nothing joins mid-flight). For continuous batching use
`DynamicInferenceEngine`.

Unlike core_r0.8.0, `generate()` returns only the requests of that call (r0.8 kept every earlier
call's results in its completed pool and returned them again), and each request may have its own
sampling settings.
"""

from typing import List, Optional, Union

import torch

from megatron.core.inference.engines.abstract_engine import AbstractEngine
from megatron.core.inference.inference_request import InferenceRequest
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.scheduler import Scheduler


class MCoreEngine(AbstractEngine):
    """Static-batching engine.

    Args:
        text_generation_controller (TextGenerationController): tokenizes, runs and samples.
        max_batch_size (int): most requests generated together.
        random_seed (int, optional): if given, `torch.manual_seed(random_seed)` at each
            generate() (sampling then repeats from call to call).
    """

    def __init__(self, text_generation_controller, max_batch_size: int, random_seed=None):
        # The scheduler holds at most max_batch_size active requests; the rest wait.
        self.scheduler = Scheduler(max_batch_size=max_batch_size)
        self.text_generation_controller = text_generation_controller
        self.random_seed = random_seed

    def generate(
        self,
        prompts: List[str],
        common_inference_params: Optional[Union[SamplingParams, List[SamplingParams]]] = None,
        add_BOS: bool = False,
    ) -> List[InferenceRequest]:
        """Generate for `prompts` (every rank of the model replica calls it with the same
        arguments).

        Args:
            prompts: the prompt texts.
            common_inference_params: one SamplingParams for all prompts, or one per prompt
                (default: SamplingParams()).
            add_BOS: prepend the end-of-document id to every prompt.

        Returns:
            The requests of these prompts, in prompt order, COMPLETED.
        """
        controller = self.text_generation_controller
        if common_inference_params is None:
            common_inference_params = SamplingParams()
        if isinstance(common_inference_params, (list, tuple)):
            if len(common_inference_params) != len(prompts):
                raise ValueError(
                    f"got {len(common_inference_params)} sampling params for {len(prompts)} prompts"
                )
            params = list(common_inference_params)
        else:
            params = [common_inference_params] * len(prompts)
        vocab_size = controller.tokenizer.vocab_size
        for p in params:
            p.validate(vocab_size)
            if p.num_tokens_to_generate is None:
                raise ValueError("the static engine needs num_tokens_to_generate (got None)")
        tokenized = [controller.tokenize_prompt(prompt, add_BOS) for prompt in prompts]
        for i, tokens in enumerate(tokenized):
            if len(tokens) == 0:
                raise ValueError(f"prompt {i} is empty: pass add_BOS=True to start from the EOD id")

        if self.random_seed:
            torch.random.manual_seed(self.random_seed)
        ids = [
            self.scheduler.add_request(prompt=prompt, prompt_tokens=tokens, inference_parameters=p)
            for prompt, tokens, p in zip(prompts, tokenized, params)
        ]
        self.run_engine()
        return [self.scheduler.completed_request_pool.pop(request_id) for request_id in ids]

    def run_engine(self):
        """Run static batches until no request is active or waiting."""
        while self.scheduler.have_requests_pending():
            batch = self.scheduler.active_request_pool.copy()
            result = self.text_generation_controller.generate_all_output_tokens_static_batch(batch)
            self.scheduler.update_requests_pools(result_dict=result)
