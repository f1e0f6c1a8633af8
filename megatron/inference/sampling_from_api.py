"""The engine's sampling settings of a `PUT /api` request (used by the GPT and the
vision-language paths of the server)."""

from megatron.core.inference.sampling_params import SamplingParams
from megatron.inference.text_generation.generation import DOUBLE_EOL_ID, EOL_ID


def engine_sampling_params(params, prompt_lengths, eod):
    """One SamplingParams per prompt of a `PUT /api` request, reproducing Megatron's padded
    batch: every row runs to the longest prompt + tokens_to_generate (scoring: none generates),
    stops at the end-of-text id (kept in its text) or, with stop_on_eol / stop_on_double_eol, at
    GPT-2's newline ids instead."""
    n = params['tokens_to_generate']
    width = max(prompt_lengths) + n
    stop_ids, termination = None, eod
    if params['stop_on_double_eol']:
        stop_ids, termination = [[DOUBLE_EOL_ID], [EOL_ID, EOL_ID]], -1
    elif params['stop_on_eol']:
        stop_ids, termination = [[DOUBLE_EOL_ID], [EOL_ID]], -1
    seed = params['random_seed']
    return [
        SamplingParams(
            temperature=float(params['temperature']),
            top_k=int(params['top_k']),
            top_p=float(params['top_p']),
            return_log_probs=params['logprobs'],
            num_tokens_to_generate=0 if n == 0 else width - length,
            termination_id=termination,
            stop_token_ids=stop_ids,
            random_seed=None if seed == -1 else seed,
        )
        for length in prompt_lengths
    ]
