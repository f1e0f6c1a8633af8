"""OpenAI-compatible endpoints of the text generation server: `POST /v1/completions` and
`GET /v1/models`, so that the official `openai` client (or anything speaking that protocol) can
use a Megatron model. (`POST /v1/chat/completions`: `chat_completions.py`.)

Request fields: `model` (any name is accepted), `prompt` (a string or a list of strings),
`max_tokens` (default 16), `temperature` (default 1; 0 is greedy), `top_p` (default 1), `n` (1
only), `stop` (a string or up to 4), `logprobs` (null or 0..5: the sampled tokens' log
probabilities; `top_logprobs` is not computed and is null), `seed`, `ignore_eos` (later
Megatron's: no early stop at the end-of-text token), `stream` (server-sent events, one chunk per
generated token) with `stream_options.include_usage`.

Every prompt is one request of the dynamic-batching engine, batched with whatever else runs
(`generations.EngineGeneration`). A choice ends at its end-of-text token, `max_tokens`, or one of
its `stop` strings (its engine request is then cancelled); a streaming client that disconnects
cancels its requests, whose KV blocks are freed at the next step. `usage.completion_tokens`
counts the tokens of the returned text only (not those cut by a stop string). Errors use
OpenAI's `{"error": {"message", "type", "param", "code"}}` body: 400 for a bad request, 503 when
the server's queue is full, 500 for a generation that failed (the server goes on serving).
"""

import queue
import time
import uuid

from flask import Response, jsonify

from megatron.core.inference.engines.dynamic_engine import QueueFullError
from megatron.core.inference.sampling_params import SamplingParams
from megatron.inference.json_io import BadRequest, dumps, read_json_object
from megatron.inference.text_generation.request import INT64_MAX

#: Seconds without news after which a stream sends a keep-alive comment.
KEEPALIVE_S = 1.0
#: OpenAI's limits on `stop` and `logprobs`.
MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 5


class CompletionError(Exception):
    """An invalid completions request: answered in OpenAI's error format (400 by default)."""

    def __init__(self, message, param=None, status=400, kind='invalid_request_error', code=None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code


def error_response(message, param=None, status=400, kind='invalid_request_error', code=None):
    """(OpenAI's error body, status)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return jsonify(body), status


def error_of(exc: CompletionError):
    return error_response(str(exc), exc.param, exc.status, exc.kind, exc.code)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_prompts(body, limits):
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    else:
        raise CompletionError("'prompt' must be a string or a non-empty list of strings", "prompt")
    if len(prompts) > limits['max_prompts']:
        raise CompletionError(
            f"'prompt' has {len(prompts)} prompts, more than the limit of {limits['max_prompts']}",
            "prompt",
        )
    if any(len(p) == 0 for p in prompts):
        raise CompletionError("'prompt' must not contain empty strings", "prompt")
    return prompts


def parse_max_tokens(body, limits, name="max_tokens", default=16):
    max_tokens = body.get(name, default)
    max_tokens = default if max_tokens is None else max_tokens
    if max_tokens is None:
        return None
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limits['max_sequence_length']:
        raise CompletionError(
            f"'{name}' must be an integer in [1, {limits['max_sequence_length']}], "
            f"got {max_tokens!r}",
            name,
        )
    return max_tokens


def parse_sampling(body):
    """temperature, top_p, n, seed, ignore_eos."""
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if not _is_number(temperature) or not 0.0 <= temperature <= 2.0:
        raise CompletionError(
            f"'temperature' must be a number in [0, 2], got {temperature!r}", "temperature"
        )
    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise CompletionError(f"'top_p' must be a number in (0, 1], got {top_p!r}", "top_p")
    n = body.get("n", 1)
    if n not in (None, 1) or isinstance(n, bool):
        raise CompletionError(f"'n' must be 1 (only one completion per prompt), got {n!r}", "n")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= INT64_MAX):
        raise CompletionError(f"'seed' must be an integer in [0, 2**63 - 1], got {seed!r}", "seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise CompletionError(f"'ignore_eos' must be a boolean, got {ignore_eos!r}", "ignore_eos")
    greedy = temperature == 0.0
    return {
        # Megatron samples greedily with top_k = 1 (temperature ignored); top_p = 0 means no
        # nucleus filtering.
        "top_k": 1 if greedy else 0,
        "top_p": 0.0 if greedy or top_p >= 1.0 else float(top_p),
        "temperature": 1.0 if greedy else float(temperature),
        "random_seed": seed,
        "ignore_eos": ignore_eos,
    }


def parse_stop(body):
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise CompletionError("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise CompletionError(
            f"'stop' has {len(stops)} sequences, more than {MAX_STOP_SEQUENCES}", "stop"
        )
    return [s for s in stops if s]


def parse_stream_options(body):
    """stream, stream_options.include_usage, model."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise CompletionError(f"'stream' must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise CompletionError(
            "'stream_options' must be an object with a boolean 'include_usage'", "stream_options"
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise CompletionError(f"'model' must be a string, got {model!r}", "model")
    return stream, bool(options.get("include_usage", False)), model


def refuse_unsupported(body, unsupported):
    """CompletionError for the first field set to a value the server does not implement."""
    for name, accepted in unsupported.items():
        if name in body and body[name] not in accepted:
            raise CompletionError(f"'{name}' = {body[name]!r} is not supported", name)


UNSUPPORTED = {
    "echo": (False, None),
    "suffix": (None,),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


def parse_completion_request(body, limits):
    """Validate an OpenAI completions body.

    Raises:
        CompletionError: naming the field and the value.
    """
    params = {"prompts": _parse_prompts(body, limits)}
    params["max_tokens"] = parse_max_tokens(body, limits)
    params.update(parse_sampling(body))
    params["stops"] = parse_stop(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise CompletionError(
            f"'logprobs' must be null or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}",
            "logprobs",
        )
    params["logprobs"] = logprobs is not None
    params["stream"], params["include_usage"], model = parse_stream_options(body)
    refuse_unsupported(body, UNSUPPORTED)
    params["model"] = model or limits.get('model_name')
    return params


def sampling_params(params, max_tokens):
    """The engine's settings of one choice of a parsed request."""
    return SamplingParams(
        temperature=params['temperature'],
        top_k=params['top_k'],
        top_p=params['top_p'],
        return_log_probs=params['logprobs'],
        num_tokens_to_generate=max_tokens,
        skip_prompt_log_probs=True,
        termination_id=-1 if params['ignore_eos'] else None,
        random_seed=params['random_seed'],
    )


def check_length(prompt_length, max_tokens, limits):
    """The engine's limit on prompt + generated tokens (Megatron's message), as a 400."""
    if prompt_length + max_tokens > limits['max_sequence_length']:
        raise CompletionError(
            f"Length of prompt + tokens_to_generate longer than allowed: {prompt_length} "
            f"prompt tokens + {max_tokens} > {limits['max_sequence_length']}",
            "max_tokens",
        )


def tokenize_prompts(tokenizer, prompts):
    """Token ids of each prompt (CompletionError for a prompt the tokenizer refuses)."""
    rows = []
    for i, prompt in enumerate(prompts):
        try:
            ids = list(tokenizer.tokenize(prompt))
        except Exception as exc:  # the request's text, not the server's fault
            raise CompletionError(
                f"prompt[{i}] cannot be tokenized: {type(exc).__name__}: {exc}", "prompt"
            ) from None
        if not ids:
            raise CompletionError(f"prompt[{i}] has no tokens", "prompt")
        rows.append(ids)
    return rows


def start_generation(serving, prompts_ids, params_list, stops, images=None):
    """The generation of a request on the serving loop; CompletionError for what the engine
    refuses (400) or a full queue (503). `images`: one [n, 3, H, W] tensor per prompt (a
    vision-language server only)."""
    try:
        return serving.generation(prompts_ids, params_list, stops, images=images)
    except QueueFullError as exc:
        raise CompletionError(
            serving.busy_message(exc), status=503, kind='server_error', code='queue_full'
        ) from None
    except ValueError as exc:
        raise CompletionError(str(exc)) from None


def usage(prompt_lengths, completion_tokens):
    prompt_tokens = sum(prompt_lengths)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _logprobs_block(choice, generated):
    """OpenAI's logprobs object of one choice (the returned tokens only)."""
    tokens, offsets = [], []
    offset = 0
    for token_id in generated:
        piece = choice.tokenizer.detokenize([token_id])
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": list((choice.log_probs or [])[: len(generated)]),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _choice_body(index, choice, params):
    text, generated, finish = choice.completion()
    block = _logprobs_block(choice, generated) if params['logprobs'] else None
    return {"text": text, "index": index, "logprobs": block, "finish_reason": finish}, generated


def stream_events(generation, meta, params, prompt_lengths, chunk_of, usage_object):
    """Server-sent events of a generation: `chunk_of(index, text, finish, choice)` gives the
    body of one chunk (None: nothing to send); a last usage chunk with include_usage, then
    `data: [DONE]`; a `: keep-alive` comment after KEEPALIVE_S without news. A client that goes
    away (the response is closed, found at the next write) cancels the generation."""

    def events():
        completion_tokens = 0
        try:
            while True:
                try:
                    i = generation.next_update(timeout=KEEPALIVE_S)
                except queue.Empty:
                    # An SSE comment (clients skip it): writing it finds a client that went
                    # away while its requests wait, so they leave the queue.
                    yield ": keep-alive\n\n"
                    continue
                if i is None:
                    break
                choice = generation.choices[i]
                if choice.finished and choice.end == "error":
                    error = {"error": {"message": choice.error, "type": "server_error"}}
                    yield "data: " + dumps(error) + "\n\n"
                    generation.cancel()
                    break
                text, generated, finish = choice.completion()
                end = choice.safe_prefix(text, finish)
                if choice.finished:
                    completion_tokens += len(generated)
                    body = chunk_of(i, text[choice.emitted :], finish, choice)
                elif end > choice.emitted:
                    body = chunk_of(i, text[choice.emitted : end], None, choice)
                else:
                    continue
                choice.emitted = end
                if body is not None:
                    yield "data: " + dumps(dict(meta, **body)) + "\n\n"
            if generation.error is None and params['include_usage']:
                body = dict(meta, object=usage_object, choices=[])
                body["usage"] = usage(prompt_lengths, completion_tokens)
                yield "data: " + dumps(body) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            # Closed early (the client went away) or done: nothing more is wanted.
            if not generation.finished:
                generation.cancel(client_gone=True)
            generation.log(meta["id"], params['max_tokens'])

    return Response(events(), mimetype="text/event-stream")


def _completions(serving, limits, body):
    params = parse_completion_request(body, limits)
    tokenizer = serving.tokenizer
    prompts_ids = tokenize_prompts(tokenizer, params['prompts'])
    for ids in prompts_ids:
        check_length(len(ids), params['max_tokens'], limits)
    choice_params = [sampling_params(params, params['max_tokens']) for _ in prompts_ids]
    generation = start_generation(serving, prompts_ids, choice_params, params['stops'])
    meta = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time())}
    meta["model"] = params['model']
    prompt_lengths = [len(ids) for ids in prompts_ids]
    if params['stream']:

        def chunk_of(index, text, finish, choice):
            block = None
            if finish is not None and params['logprobs']:
                block = _logprobs_block(choice, choice.completion()[1])
            out = {"text": text, "index": index, "logprobs": block, "finish_reason": finish}
            return {"object": "text_completion", "choices": [out]}

        return stream_events(generation, meta, params, prompt_lengths, chunk_of, "text_completion")
    generation.wait()
    generation.log(meta["id"], params['max_tokens'])
    if generation.error is not None:
        raise CompletionError(generation.error, status=500, kind='server_error')
    choices, completion_tokens = [], 0
    for i, choice in enumerate(generation.choices):
        out, generated = _choice_body(i, choice, params)
        choices.append(out)
        completion_tokens += len(generated)
    return jsonify(
        dict(
            meta,
            object="text_completion",
            choices=choices,
            usage=usage(prompt_lengths, completion_tokens),
        )
    )


def register_completions(app, serving, limits, model_name):
    """Add `POST /v1/completions` and `GET /v1/models` to the Flask app."""
    limits = dict(limits, model_name=model_name)
    created = int(time.time())

    @app.route('/v1/models', methods=['GET'])
    def list_models():
        model_card = {"id": model_name, "object": "model", "created": created}
        return jsonify({"object": "list", "data": [dict(model_card, owned_by="megatron")]})

    @app.route('/v1/completions', methods=['POST'])
    def completions():
        try:
            return _completions(serving, limits, read_json_object(limits['max_request_bytes']))
        except BadRequest as exc:
            return error_response(str(exc))
        except CompletionError as exc:
            return error_of(exc)
