"""OpenAI-compatible endpoints of the text generation server: `POST /v1/completions` and
`GET /v1/models`, so that the official `openai` client (or anything speaking that protocol) can
use a Megatron model.

Request fields: `model` (any name is accepted), `prompt` (a string or a list of strings),
`max_tokens` (default 16), `temperature` (default 1; 0 is greedy), `top_p` (default 1), `n` (1
only), `stop` (a string or up to 4), `logprobs` (null or 0..5: the sampled tokens' log
probabilities; `top_logprobs` is not computed and is null), `seed`, `stream` (server-sent
events, one chunk per generated token) with `stream_options.include_usage`. Sampling runs
through Megatron's generation loop, under the same lock and rank-0 broadcast as `PUT /api`.

Generation ends as soon as every choice is finished: its end-of-text token, `max_tokens`, or one
of its `stop` sequences; a streaming client that disconnects ends it at the next token, which
frees the server for the next request. `usage.completion_tokens` counts the tokens of the
returned text only (not those cut by a stop sequence). Errors use OpenAI's
`{"error": {"message", "type", "param", "code"}}` body: 400 for a bad request, 500 for a
generation that failed on some rank (the server goes on serving).
"""

import queue
import threading
import time
import uuid

from flask import Response, jsonify

from megatron.inference.json_io import BadRequest, dumps, read_json_object
from megatron.inference.text_generation import api as generation_api
from megatron.inference.text_generation.request import INT64_MAX, SAMPLING, GenerationSettings
from megatron.inference.text_generation.tokenization import eod_id
from megatron.inference.worker_loop import serve
from megatron.training.global_vars import get_args, get_tokenizer

#: OpenAI's limits on `stop` and `logprobs`.
MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 5


class CompletionError(Exception):
    """An invalid completions request: answered with HTTP 400 in OpenAI's error format."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


def error_response(message, param=None, status=400, kind='invalid_request_error'):
    """(OpenAI's error body, status)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return jsonify(body), status


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


def _parse_sampling(body, limits):
    """max_tokens, temperature, top_p, n, seed."""
    max_tokens = body.get("max_tokens", 16)
    max_tokens = 16 if max_tokens is None else max_tokens
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limits['max_position_embeddings']:
        raise CompletionError(
            f"'max_tokens' must be an integer in [1, {limits['max_position_embeddings']}], "
            f"got {max_tokens!r}",
            "max_tokens",
        )
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
    return max_tokens, temperature, top_p, seed


def _parse_stop(body):
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


def _parse_output_options(body):
    """logprobs, stream, stream_options.include_usage, model; unsupported options refused."""
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise CompletionError(
            f"'logprobs' must be null or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}",
            "logprobs",
        )
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
    unsupported = {
        "echo": (False, None),
        "suffix": (None,),
        "best_of": (None, 1),
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "logit_bias": (None, {}),
    }
    for name, accepted in unsupported.items():
        if name in body and body[name] not in accepted:
            raise CompletionError(f"'{name}' = {body[name]!r} is not supported", name)
    return logprobs, stream, bool(options.get("include_usage", False)), model


def parse_completion_request(body, limits):
    """Validate an OpenAI completions body; returns the generation settings.

    Raises:
        CompletionError: naming the field and the value.
    """
    prompts = _parse_prompts(body, limits)
    max_tokens, temperature, top_p, seed = _parse_sampling(body, limits)
    stops = _parse_stop(body)
    logprobs, stream, include_usage, model = _parse_output_options(body)
    greedy = temperature == 0.0
    return {
        "prompts": prompts,
        "max_tokens": max_tokens,
        # Megatron samples greedily with top_k = 1 (temperature ignored); top_p = 0 means no
        # nucleus filtering.
        "top_k": 1 if greedy else 0,
        "top_p": 0.0 if greedy or top_p >= 1.0 else float(top_p),
        "temperature": 1.0 if greedy else float(temperature),
        "stops": stops,
        "logprobs": logprobs,
        "random_seed": -1 if seed is None else seed,
        "stream": stream,
        "include_usage": include_usage,
        "model": model or limits.get('model_name'),
    }


def settings_for(params):
    """Generation settings of a parsed completions request (rank 0 ends the loop early)."""
    return GenerationSettings(
        mode=SAMPLING,
        tokens_to_generate=params['max_tokens'],
        return_output_log_probs=params['logprobs'] is not None,
        top_k_sampling=params['top_k'],
        top_p_sampling=params['top_p'],
        temperature=params['temperature'],
        add_BOS=False,
        use_eod_token_for_early_termination=True,
        random_seed=params['random_seed'],
        host_stop=True,
    )


class _Row:
    """One prompt's completion, rebuilt from its generated ids (stops, usage, streaming)."""

    def __init__(self, prompt_length, max_tokens, stops, tokenizer):
        self.prompt_length = prompt_length
        self.max_tokens = max_tokens
        self.stops = stops
        self.tokenizer = tokenizer
        self.eod = eod_id(tokenizer)
        self.emitted = 0
        self.finished = False
        # Tokens that can hold the longest stop sequence (a token holds at least one character
        # once its neighbours complete it).
        self.window = max((len(s) for s in stops), default=0) + 4

    def update_finished(self, ids):
        """Whether the row is finished (end of text, max_tokens, or a stop sequence), cheaply:
        only the newest token and the tail that may hold a stop sequence are looked at."""
        if not self.finished:
            generated = ids[self.prompt_length :]
            if len(generated) >= self.max_tokens or (generated and generated[-1] == self.eod):
                self.finished = True
            elif generated and self.stops:
                tail = self.tokenizer.detokenize(generated[-self.window :])
                self.finished = any(s in tail for s in self.stops)
        return self.finished

    def completion(self, ids):
        """(text, the generated ids that make up that text, finish_reason or None)."""
        generated = list(ids[self.prompt_length :])[: self.max_tokens]
        finish = "length" if len(generated) == self.max_tokens else None
        if self.eod in generated:
            generated = generated[: generated.index(self.eod)]
            finish = "stop"
        text = self.tokenizer.detokenize(generated) if generated else ""
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
            finish = "stop"
            generated = generated[: self._tokens_for(generated, cut)]
        return text, generated, finish

    def _tokens_for(self, generated, chars):
        """The fewest leading tokens whose text covers `chars` characters."""
        for k in range(len(generated) + 1):
            if len(self.tokenizer.detokenize(generated[:k])) >= chars:
                return k
        return len(generated)

    def safe_prefix(self, text, finish):
        """How much of `text` can be streamed now: not a trailing partial UTF-8 character, nor
        a tail that may still become a stop sequence."""
        if finish is not None:
            return len(text)
        end = len(text.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:k]):
                    end -= k
                    break
        return max(end, self.emitted)


def _logprobs_block(row, generated, logprobs):
    """OpenAI's logprobs object of one choice (the returned tokens only)."""
    tokens, token_logprobs, offsets = [], [], []
    offset = 0
    for k, token_id in enumerate(generated):
        piece = row.tokenizer.detokenize([token_id])
        tokens.append(piece)
        # Megatron's entry j is log P(token j + 1 | tokens 0..j).
        token_logprobs.append(logprobs[row.prompt_length + k - 1])
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _check_lengths(prompt_lengths, max_tokens):
    """Megatron's generation limits, checked before any work so they answer 400."""
    args = get_args()
    width = max(prompt_lengths) + max_tokens
    if width > args.max_position_embeddings:
        raise CompletionError(
            f"Length of prompt + tokens_to_generate longer than allowed: {max(prompt_lengths)} "
            f"prompt tokens + {max_tokens} > {args.max_position_embeddings}",
            "max_tokens",
        )
    if width * len(prompt_lengths) > args.max_tokens_to_oom:
        raise CompletionError(
            f"Too many tokens.  {width * len(prompt_lengths)} is greater than "
            f"{args.max_tokens_to_oom}",
            "prompt",
        )


def _usage(prompt_lengths, completion_tokens):
    prompt_tokens = sum(prompt_lengths)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class StopCheck:
    """The generation's step callback (rank 0): True once every choice is finished or the
    client is gone, which ends the loop on every rank. `steps` and `reason` tell how it ended."""

    def __init__(self, rows, cancelled=None, on_step=None):
        self.rows, self.cancelled, self.on_step = rows, cancelled, on_step
        self.steps, self.reason = 0, 'max_tokens'

    def __call__(self, tokens, context_length):
        self.steps += 1
        ids = tokens[:, : context_length + 1].tolist()
        if self.on_step is not None:
            self.on_step(ids)
        if self.cancelled is not None and self.cancelled.is_set():
            self.reason = 'the client went away'
            return True
        if all([row.update_finished(row_ids) for row, row_ids in zip(self.rows, ids)]):
            self.reason = 'every choice finished'
            return True
        return False

    def log(self, request_id, max_tokens):
        print(
            f'{request_id}: generation ended after {self.steps} step(s) of at most {max_tokens} '
            f'({self.reason})',
            flush=True,
        )


def _choices(rows, params, tokens, logprobs):
    """(choices, completion tokens) of a finished generation."""
    choices, completion_tokens = [], 0
    for i, (row, ids) in enumerate(zip(rows, tokens)):
        text, generated, finish = row.completion(ids)
        completion_tokens += len(generated)
        block = None
        if params['logprobs'] is not None:
            block = _logprobs_block(row, generated, logprobs[i])
        finish = finish or "length"
        choices.append({"text": text, "index": i, "logprobs": block, "finish_reason": finish})
    return choices, completion_tokens


def _prepare(params, limits):
    """(prepared request, prompt lengths) or CompletionError: all checks before any work."""
    tokenizer = get_tokenizer()
    prompt_lengths = [len(tokenizer.tokenize(p)) for p in params['prompts']]
    _check_lengths(prompt_lengths, params['max_tokens'])
    try:
        prepared = generation_api.prepare(params['prompts'], settings_for(params))
    except ValueError as exc:
        raise CompletionError(str(exc)) from None
    return prepared, prompt_lengths


def _stream(model, prepared, params, rows, meta, prompt_lengths):
    """Server-sent events: generation runs in a thread that holds the lock and reports each
    new column; the response emits the new text of every row as it comes. A client that goes
    away (the response is closed) ends the generation at its next step."""
    events = queue.Queue()
    cancelled = threading.Event()

    def worker():
        try:
            step = StopCheck(rows, cancelled, on_step=lambda ids: events.put(("step", ids)))
            result = serve(model, prepared, step_callback=step)
            step.log(meta["id"], params['max_tokens'])
            events.put(("done", result))
        except Exception as exc:  # reported to the client (and in this log)
            print(f'streaming request failed: {type(exc).__name__}: {exc}', flush=True)
            events.put(("error", f"{type(exc).__name__}: {exc}"))

    def chunk(index, text, finish, logprobs=None):
        choice = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
        return "data: " + dumps(dict(meta, object="text_completion", choices=[choice])) + "\n\n"

    def step_chunks(payload):
        for i, (row, ids) in enumerate(zip(rows, payload)):
            text, _, finish = row.completion(ids)
            end = row.safe_prefix(text, finish)
            if end > row.emitted:
                yield chunk(i, text[row.emitted : end], None)
                row.emitted = end

    def final_chunks(payload):
        # The last chunk of each choice carries its finish reason (and log probs).
        _, _, logprobs, tokens = payload
        completion_tokens = 0
        for i, (row, ids) in enumerate(zip(rows, tokens)):
            text, generated, finish = row.completion(ids)
            completion_tokens += len(generated)
            block = None
            if params['logprobs'] is not None:
                block = _logprobs_block(row, generated, logprobs[i])
            yield chunk(i, text[row.emitted :], finish or "length", block)
        if params['include_usage']:
            usage = dict(meta, object="text_completion", choices=[])
            usage["usage"] = _usage(prompt_lengths, completion_tokens)
            yield "data: " + dumps(usage) + "\n\n"

    def generate_events():
        threading.Thread(target=worker, daemon=True).start()
        try:
            while True:
                kind, payload = events.get()
                if kind == "step":
                    yield from step_chunks(payload)
                    continue
                if kind == "error":
                    error = {"error": {"message": payload, "type": "server_error"}}
                    yield "data: " + dumps(error) + "\n\n"
                else:
                    yield from final_chunks(payload)
                break
            yield "data: [DONE]\n\n"
        finally:
            # Closed early (the client went away) or done: either way nothing more is wanted.
            cancelled.set()

    return Response(generate_events(), mimetype="text/event-stream")


def register_completions(app, model, limits, model_name):
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
            params = parse_completion_request(read_json_object(limits['max_request_bytes']), limits)
            prepared, prompt_lengths = _prepare(params, limits)
        except BadRequest as exc:
            return error_response(str(exc))
        except CompletionError as exc:
            return error_response(str(exc), exc.param)

        tokenizer = get_tokenizer()
        rows = [_Row(n, params['max_tokens'], params['stops'], tokenizer) for n in prompt_lengths]
        meta = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time())}
        meta["model"] = params['model']
        if params['stream']:
            return _stream(model, prepared, params, rows, meta, prompt_lengths)
        step = StopCheck(rows)
        try:
            _, _, logprobs, tokens = serve(model, prepared, step_callback=step)
        except generation_api.GenerationFailed as exc:
            return error_response(str(exc), status=500, kind='server_error')
        step.log(meta["id"], params['max_tokens'])
        choices, completion_tokens = _choices(rows, params, tokens, logprobs)
        usage = _usage(prompt_lengths, completion_tokens)
        return jsonify(dict(meta, object="text_completion", choices=choices, usage=usage))
