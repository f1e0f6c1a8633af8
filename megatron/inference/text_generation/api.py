"""Entry points of text generation: `generate_and_post_process` and `beam_search_and_post_process`
(Megatron's names), both thin wrappers of one request path, `run_request`.

Global rank 0 (the server) calls them with the request; every other rank calls them with no
arguments (after the server broadcast its choice). One request runs as:

1. rank 0 prepares it (`request.prepare_request`: settings checked, prompts tokenized, sizes
   checked): nothing of a request can fail after this point because of its values;
2. rank 0 broadcasts a header (whether the request was accepted, then the settings as one int64
   and one float64 tensor, so seeds and temperatures arrive exactly), then the padded batch;
   a refused request is raised as `RequestRefused` on every rank, so all of them stay in step;
3. every rank runs the loop of the request's mode (sampling, scoring or beam search);
4. every rank reports whether its loop raised (`failed_ranks`, one all-reduce), and if any did,
   every rank raises `GenerationFailed`: the ranks leave the request together and the next one
   starts from a clean state;
5. the first pipeline stage detokenizes.
"""

import torch

from megatron.core import parallel_state as mpu
from megatron.inference.text_generation.communication import (
    broadcast_float64_list,
    broadcast_int64_list,
    failed_ranks,
)
from megatron.inference.text_generation.generation import (
    beam_search_and_return_on_first_stage,
    generate_tokens_probs_and_return_on_first_stage,
    score_and_return_on_first_stage,
)
from megatron.inference.text_generation.request import (
    BEAM_SEARCH,
    SAMPLING,
    GenerationSettings,
    PreparedRequest,
    prepare_request,
)
from megatron.inference.text_generation.tokenization import broadcast_batch, detokenize_generations
from megatron.training.global_vars import get_args, get_tokenizer


class RequestRefused(ValueError):
    """The request's values were refused on rank 0 before any generation (every rank raises it;
    the message is rank 0's, the other ranks get a pointer to it)."""


class GenerationFailed(RuntimeError):
    """A generation loop raised on some rank; every rank raises this after the ranks agreed on
    it, so they stay in step. `ranks` are the global ranks whose loop failed."""

    def __init__(self, message, ranks):
        super().__init__(message)
        self.ranks = ranks


def _is_rank_0():
    return torch.distributed.get_rank() == 0


def prepare(prompts, settings: GenerationSettings) -> PreparedRequest:
    """`prepare_request` with this run's tokenizer and limits (rank 0, no collectives)."""
    args = get_args()
    return prepare_request(
        prompts,
        settings,
        get_tokenizer(),
        max_position_embeddings=args.max_position_embeddings,
        max_tokens_to_oom=args.max_tokens_to_oom,
    )


def _broadcast_header(prepared, refusal):
    """Rank 0 -> all: (accepted, settings). `prepared` / `refusal` are rank 0's."""
    n_ints = 1 + len(GenerationSettings.int_fields())
    n_floats = len(GenerationSettings.float_fields())
    ints = floats = None
    if _is_rank_0():
        settings = prepared.settings if prepared is not None else GenerationSettings()
        packed_ints, floats = settings.pack()
        ints = [int(refusal is None)] + packed_ints
    ints = broadcast_int64_list(n_ints, int_list=ints)
    floats = broadcast_float64_list(n_floats, float_list=floats)
    return bool(ints[0]), GenerationSettings.unpack(ints[1:], floats)


def _run_loop(model, settings, tokens, lengths, step_callback):
    """The loop of the request's mode on this rank; its raw outputs."""
    if settings.mode == BEAM_SEARCH:
        return beam_search_and_return_on_first_stage(
            model,
            tokens,
            lengths,
            settings.beam_size,
            stop_token=settings.stop_token,
            num_return_gen=settings.num_return_gen,
            length_penalty=settings.length_penalty,
            prevent_newline_after_colon=settings.prevent_newline_after_colon,
        )
    if settings.random_seed != -1:
        # Every rank, so the tensor-parallel ranks keep sampling the same tokens; it persists
        # for later requests (as in Megatron).
        torch.random.manual_seed(settings.random_seed)
    if settings.tokens_to_generate == 0:
        return score_and_return_on_first_stage(model, tokens, lengths)
    return generate_tokens_probs_and_return_on_first_stage(
        model,
        tokens,
        lengths,
        return_output_log_probs=settings.return_output_log_probs,
        top_k=settings.top_k_sampling,
        top_p=settings.top_p_sampling,
        top_p_decay=settings.top_p_decay,
        top_p_bound=settings.top_p_bound,
        temperature=settings.temperature,
        use_eod_token_for_early_termination=settings.use_eod_token_for_early_termination,
        stop_on_double_eol=settings.stop_on_double_eol,
        stop_on_eol=settings.stop_on_eol,
        prevent_newline_after_colon=settings.prevent_newline_after_colon,
        step_callback=step_callback,
        host_stop=settings.host_stop,
    )


def execute(model, prepared=None, refusal=None, step_callback=None):
    """Steps 2-4 of a request, on every rank (rank 0 passes `prepared`, or the `refusal` message
    of a request it refused; the other ranks pass nothing).

    Returns:
        (settings, raw outputs of the loop): sampling (tokens, lengths, log probs, logits), beam
        search (tokens, scores), valid on the first pipeline stage.

    Raises:
        RequestRefused: rank 0 refused the request (on every rank).
        GenerationFailed: a loop raised on some rank (on every rank).
    """
    accepted, settings = _broadcast_header(prepared, refusal)
    if not accepted:
        raise RequestRefused(refusal if _is_rank_0() else 'the request was refused on rank 0')
    tokens, lengths = broadcast_batch(
        prepared.tokens if prepared is not None else None,
        prepared.lengths if prepared is not None else None,
    )
    error = None
    try:
        outputs = _run_loop(model, settings, tokens, lengths, step_callback)
    except Exception as exc:  # reported on every rank below, so that the ranks stay in step
        error = exc
        outputs = None
        print(
            f'rank {torch.distributed.get_rank()}: generation failed: {type(exc).__name__}: {exc}',
            flush=True,
        )
    ranks = failed_ranks(error is not None)
    if ranks:
        if error is not None:
            message = f'generation failed: {type(error).__name__}: {error}'
        else:
            message = f'generation failed on rank(s) {ranks} (see their log)'
        raise GenerationFailed(message, ranks) from error
    return settings, outputs


def post_process(settings, outputs, return_logits=False):
    """Step 5 on the first pipeline stage.

    Returns:
        sampling: (texts, segments, log probs as lists or None, tokens as lists), plus the logits
        with return_logits; beam search: (texts, segments, scores as a list).
    """
    if settings.mode == BEAM_SEARCH:
        tokens, scores = outputs
        # Every row is detokenized in full: finished hypotheses keep their trailing padding.
        lengths = tokens.size(1) * torch.ones(tokens.size(0), dtype=torch.int64)
        _, texts, segments = detokenize_generations(tokens, lengths, True)
        return texts, segments, scores.cpu().numpy().tolist()
    tokens, lengths, output_log_probs, logits = outputs
    tokens, texts, segments = detokenize_generations(tokens, lengths, True)
    if settings.return_output_log_probs:
        output_log_probs = output_log_probs.cpu().numpy().tolist()
        # Entry k is log P(token k + 1 | tokens 0..k): one fewer than the row's tokens.
        for i, (prob, seg) in enumerate(zip(output_log_probs, segments)):
            output_log_probs[i] = prob[: len(seg) - 1]
    if return_logits:
        assert settings.tokens_to_generate == 0
        assert mpu.get_pipeline_model_parallel_world_size() == 1
        return texts, segments, output_log_probs, tokens, logits
    return texts, segments, output_log_probs, tokens


def run_prepared(model, prepared=None, step_callback=None, return_logits=False):
    """Steps 2-5 of an accepted request (rank 0 passes it, the other ranks nothing): the
    post-processed result on the first pipeline stage, None elsewhere."""
    settings, outputs = execute(model, prepared, step_callback=step_callback)
    if mpu.is_pipeline_first_stage():
        return post_process(settings, outputs, return_logits)
    return None


def _prepare_on_rank_0(prompts, settings):
    """(prepared request, None) or (None, refusal message) on rank 0; (None, None) elsewhere."""
    if not _is_rank_0():
        return None, None
    assert prompts is not None, 'rank 0 passes the prompts'
    try:
        return prepare(prompts, settings), None
    except ValueError as exc:
        return None, str(exc)


def run_request(model, prompts=None, settings=None, step_callback=None, return_logits=False):
    """A whole request, on every rank: rank 0 passes the prompts and settings (a refusal is
    raised as `RequestRefused` on every rank), the other ranks nothing."""
    prepared, refusal = _prepare_on_rank_0(prompts, settings)
    settings, outputs = execute(model, prepared, refusal, step_callback)
    if mpu.is_pipeline_first_stage():
        return post_process(settings, outputs, return_logits)
    return None


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
    """Sample (or score, with tokens_to_generate == 0) and detokenize on the first stage.

    `step_callback(tokens, context_length)` (rank 0 only) is called on the first stage after
    each generated column, e.g. to stream tokens while they are produced; a truthy return ends
    the generation on every rank (see `GenerationSettings.host_stop`).

    Returns:
        On the first stage: (texts, segments, log probs as lists or None, tokens as lists), plus
        the logits with return_logits (scoring only). None elsewhere.
    """
    settings = GenerationSettings(
        mode=SAMPLING,
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
        host_stop=step_callback is not None,
    )
    return run_request(model, prompts, settings, step_callback, return_logits)


def generate(model, prompts=None, tokens_to_generate=0, **kwargs):
    """Megatron's `generate`: like `generate_and_post_process` without the post-processing.

    Returns:
        (tokens [b, s'], lengths [b], log probs or None, logits or None) on the first stage; the
        tokens hold the prompt and the generation, and each length counts both.
    """
    step_callback = kwargs.pop('step_callback', None)
    settings = GenerationSettings(
        mode=SAMPLING,
        tokens_to_generate=tokens_to_generate,
        host_stop=step_callback is not None,
        **kwargs,
    )
    prepared, refusal = _prepare_on_rank_0(prompts, settings)
    return execute(model, prepared, refusal, step_callback)[1]


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
    """Beam search for one prompt and detokenize on the first stage.

    Returns:
        On the first stage: (texts, segments, scores as a list); every row is detokenized in full,
        so finished hypotheses keep their trailing padding. None elsewhere.
    """
    settings = GenerationSettings(
        mode=BEAM_SEARCH,
        tokens_to_generate=tokens_to_generate,
        beam_size=beam_size,
        add_BOS=add_BOS,
        stop_token=stop_token,
        num_return_gen=num_return_gen,
        length_penalty=length_penalty,
        prevent_newline_after_colon=prevent_newline_after_colon,
    )
    return run_request(model, prompts, settings)


def beam_search(model, prompts=None, tokens_to_generate=0, beam_size=0, **kwargs):
    """Megatron's `beam_search` without the post-processing.

    Returns:
        (tokens [num_return_gen, s'], scores [num_return_gen]) on the first stage.
    """
    settings = GenerationSettings(
        mode=BEAM_SEARCH, tokens_to_generate=tokens_to_generate, beam_size=beam_size, **kwargs
    )
    return execute(model, *_prepare_on_rank_0(prompts, settings))[1]
