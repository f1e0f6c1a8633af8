"""Entry points of text generation: `generate_and_post_process` and `beam_search_and_post_process`.

Global rank 0 (the server) calls them with the request; every other rank calls them with no
arguments after the server broadcast its choice. The settings are broadcast from rank 0 as one
float32 tensor (13 values for sampling, 7 for beam search), the prompts by `tokenize_prompts`.
"""

import torch

from megatron.core import parallel_state as mpu
from megatron.inference.text_generation.communication import broadcast_float_list
from megatron.inference.text_generation.generation import (
    beam_search_and_return_on_first_stage,
    generate_tokens_probs_and_return_on_first_stage,
    score_and_return_on_first_stage,
)
from megatron.inference.text_generation.tokenization import (
    detokenize_generations,
    tokenize_prompts,
)


def generate_and_post_process(
    model,
    prompts=None,
    tokens_to_generate=0,
    return_output_log_probs=False,
    top_k_sampling=0,
    top_p_sampling=0.0,
    top_p_decay=0.0,
    top_p_bound=0.0,
    temperature=1.0,
    add_BOS=False,
    use_eod_token_for_early_termination=True,
    stop_on_double_eol=False,
    stop_on_eol=False,
    prevent_newline_after_colon=False,
    random_seed=-1,
    return_logits=False,
    *,
    step_callback=None,
):
    """Run `generate` and detokenize on the first pipeline stage.

    `step_callback(tokens, context_length)` (rank 0 only, not broadcast) is called on the first
    stage after each generated column, e.g. to stream tokens while they are produced.

    Returns:
        On the first stage: (texts, segments, log probs as lists or None, tokens as lists), plus
        the logits with return_logits (scoring only). None elsewhere.
    """
    # Main inference.
    tokens, lengths, output_log_probs, logits = generate(
        model,
        prompts=prompts,
        tokens_to_generate=tokens_to_generate,
        return_output_log_probs=return_output_log_probs,
        top_k_sampling=top_k_sampling,
        top_p_sampling=top_p_sampling,
        top_p_decay=top_p_decay,
        top_p_bound=top_p_bound,
        temperature=temperature,
        add_BOS=add_BOS,
        use_eod_token_for_early_termination=use_eod_token_for_early_termination,
        stop_on_double_eol=stop_on_double_eol,
        stop_on_eol=stop_on_eol,
        prevent_newline_after_colon=prevent_newline_after_colon,
        random_seed=random_seed,
        step_callback=step_callback,
    )

    # Only post-process on first stage.
    if mpu.is_pipeline_first_stage():
        tokens, prompts_plus_generations, prompts_plus_generations_segments = (
            detokenize_generations(tokens, lengths, True)
        )

        if return_output_log_probs:
            output_log_probs = output_log_probs.cpu().numpy().tolist()
            # Entry k is log P(token k + 1 | tokens 0..k): one fewer than the row's tokens.
            for i, (prob, seg) in enumerate(
                zip(output_log_probs, prompts_plus_generations_segments)
            ):
                output_log_probs[i] = prob[: len(seg) - 1]

        if return_logits:
            assert tokens_to_generate == 0
            assert mpu.get_pipeline_model_parallel_world_size() == 1
            return (
                prompts_plus_generations,
                prompts_plus_generations_segments,
                output_log_probs,
                tokens,
                logits,
            )
        return (
            prompts_plus_generations,
            prompts_plus_generations_segments,
            output_log_probs,
            tokens,
        )

    return None


def generate(
    model,
    prompts=None,
    tokens_to_generate=0,
    return_output_log_probs=False,
    top_k_sampling=0,
    top_p_sampling=0.0,
    top_p_decay=0.0,
    top_p_bound=0.0,
    temperature=1.0,
    add_BOS=False,
    use_eod_token_for_early_termination=True,
    stop_on_double_eol=False,
    stop_on_eol=False,
    prevent_newline_after_colon=False,
    random_seed=-1,
    *,
    step_callback=None,
):
    """Broadcast the request from rank 0, tokenize, and generate (or score, with
    tokens_to_generate == 0). `step_callback`: see `generate_and_post_process`.

    Returns:
        (tokens [b, s'], lengths [b], log probs or None, logits or None); the tokens hold the
        prompt and the generation, and each length counts both (a finished row's stop token
        included).
    """
    # Make sure input params are available to all ranks.
    values = [
        tokens_to_generate,
        return_output_log_probs,
        top_k_sampling,
        top_p_sampling,
        top_p_decay,
        top_p_bound,
        temperature,
        add_BOS,
        use_eod_token_for_early_termination,
        stop_on_double_eol,
        stop_on_eol,
        prevent_newline_after_colon,
        random_seed,
    ]
    values_float_tensor = broadcast_float_list(len(values), float_list=values)
    tokens_to_generate = int(values_float_tensor[0].item())
    return_output_log_probs = bool(values_float_tensor[1].item())
    top_k_sampling = int(values_float_tensor[2].item())
    top_p_sampling = values_float_tensor[3].item()
    top_p_decay = values_float_tensor[4].item()
    top_p_bound = values_float_tensor[5].item()
    temperature = values_float_tensor[6].item()
    add_BOS = bool(values_float_tensor[7].item())
    use_eod_token_for_early_termination = bool(values_float_tensor[8].item())
    stop_on_double_eol = bool(values_float_tensor[9].item())
    stop_on_eol = bool(values_float_tensor[10].item())
    prevent_newline_after_colon = bool(values_float_tensor[11].item())
    random_seed = int(values_float_tensor[12].item())

    if random_seed != -1:
        # Every rank, so the tensor-parallel ranks keep sampling the same tokens; it persists
        # for later requests.
        torch.random.manual_seed(random_seed)

    # Tokenize prompts and get the batch. Note that these tensors are broadcasted to all ranks.
    if torch.distributed.get_rank() == 0:
        assert prompts is not None

    context_tokens_tensor, context_length_tensor = tokenize_prompts(
        prompts=prompts, tokens_to_generate=tokens_to_generate, add_BOS=add_BOS
    )

    if tokens_to_generate == 0:
        return score_and_return_on_first_stage(model, context_tokens_tensor, context_length_tensor)

    # Main inference function.
    # Note that the outputs are available on the first stage.
    return generate_tokens_probs_and_return_on_first_stage(
        model,
        context_tokens_tensor,
        context_length_tensor,
        return_output_log_probs=return_output_log_probs,
        top_k=top_k_sampling,
        top_p=top_p_sampling,
        top_p_decay=top_p_decay,
        top_p_bound=top_p_bound,
        temperature=temperature,
        use_eod_token_for_early_termination=use_eod_token_for_early_termination,
        stop_on_double_eol=stop_on_double_eol,
        stop_on_eol=stop_on_eol,
        prevent_newline_after_colon=prevent_newline_after_colon,
        step_callback=step_callback,
    )


def beam_search_and_post_process(
    model,
    prompts=None,
    tokens_to_generate=0,
    beam_size=0,
    add_BOS=False,
    stop_token=50256,
    num_return_gen=1,
    length_penalty=1,
    prevent_newline_after_colon=False,
):
    """Run `beam_search` and detokenize on the first pipeline stage.

    Returns:
        On the first stage: (texts, segments, scores as a list); every row is detokenized in full,
        so finished hypotheses keep their trailing padding. None elsewhere.
    """
    # Main inference.
    tokens, scores = beam_search(
        model,
        prompts=prompts,
        tokens_to_generate=tokens_to_generate,
        beam_size=beam_size,
        add_BOS=add_BOS,
        stop_token=stop_token,
        num_return_gen=num_return_gen,
        length_penalty=length_penalty,
        prevent_newline_after_colon=prevent_newline_after_colon,
    )
    # Only post-process on first stage.
    if mpu.is_pipeline_first_stage():
        lengths = tokens.size(1) * torch.ones(beam_size, dtype=torch.int64, device=tokens.device)
        tokens, prompts_plus_generations, prompts_plus_generations_segments = (
            detokenize_generations(tokens, lengths, True)
        )
        scores = scores.cpu().numpy().tolist()
        return prompts_plus_generations, prompts_plus_generations_segments, scores

    return None


def beam_search(
    model,
    prompts=None,
    tokens_to_generate=0,
    beam_size=0,
    add_BOS=False,
    stop_token=50256,
    num_return_gen=1,
    length_penalty=1,
    prevent_newline_after_colon=False,
):
    """Broadcast the beam-search request from rank 0, tokenize, and search.

    Returns:
        (tokens [num_return_gen, s'], scores [num_return_gen]) on the first stage.
    """
    # Make sure input params are available to all ranks.
    values = [
        tokens_to_generate,
        beam_size,
        add_BOS,
        stop_token,
        num_return_gen,
        length_penalty,
        prevent_newline_after_colon,
    ]
    values_float_tensor = broadcast_float_list(len(values), float_list=values)
    tokens_to_generate = int(values_float_tensor[0].item())
    beam_size = int(values_float_tensor[1].item())
    add_BOS = bool(values_float_tensor[2].item())
    stop_token = int(values_float_tensor[3].item())
    num_return_gen = int(values_float_tensor[4].item())
    length_penalty = values_float_tensor[5].item()
    prevent_newline_after_colon = values_float_tensor[6].item()

    context_tokens_tensor, context_length_tensor = tokenize_prompts(
        prompts=prompts, tokens_to_generate=tokens_to_generate, add_BOS=add_BOS
    )

    return beam_search_and_return_on_first_stage(
        model,
        context_tokens_tensor,
        context_length_tensor,
        beam_size,
        stop_token=stop_token,
        num_return_gen=num_return_gen,
        length_penalty=length_penalty,
        prevent_newline_after_colon=prevent_newline_after_colon,
    )
