"""OpenAI-compatible endpoints of the text generation server: `POST /v1/completions` and
`GET /v1/models`, so that the official `openai` client (or anything speaking that protocol) can
use a Megatron model.

Request fields: `model` (any name is accepted), `prompt` (a string or a list of strings),
`max_tokens` (default 16), `temperature` (default 1; 0 is greedy), `top_p` (default 1), `n` (1
only), `stop` (a string or up to 4), `logprobs` (null or 0..5: the sampled tokens' log
probabilities; `top_logprobs` is not computed and is null), `seed`, `stream` (server-sent
events, one chunk per generated token). Sampling runs through Megatron's
`generate_and_post_process`, under the same lock and rank-0 broadcast as `PUT /api`.
Errors are HTTP 400 with OpenAI's `{"error": {"message", "type", "param", "code"}}` body.
"""

import json
import queue
import threading
import time
import uuid

from flask import Response, jsonify

from megatron.inference.text_generation import generate_and_post_process
from megatron.inference.text_generation.tokenization import eod_id
from megatron.training.global_vars import get_args, get_tokenizer

#: OpenAI's limits on `stop` and `logprobs`.
MAX_STOP_SEQUENCES = 4
MAX_LOGPROBS = 5


class CompletionError(Exception):
    """An invalid completions request: answered with HTTP 400 in OpenAI's error format."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


def _error_response(message, param=None, status=400):
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }
    return jsonify(body), status


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_completion_request(body, limits):
    """Validate an OpenAI completions body; returns the generation settings.

    Raises:
        CompletionError: naming the field and the value.
    """
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

    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
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
    stops = [s for s in stops if s]

    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise CompletionError(
            f"'logprobs' must be null or an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}",
            "logprobs",
        )
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise CompletionError(f"'seed' must be a non-negative integer, got {seed!r}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise CompletionError(f"'stream' must be a boolean, got {stream!r}", "stream")

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
        "model": body.get("model") or limits.get('model_name'),
    }


class _Row:
    """Text of one prompt's completion, rebuilt from its generated ids (stop handling)."""

    def __init__(self, prompt_length, max_tokens, stops, tokenizer):
        self.prompt_length = prompt_length
        self.max_tokens = max_tokens
        self.stops = stops
        self.tokenizer = tokenizer
        self.eod = eod_id(tokenizer)
        self.emitted = 0

    def completion(self, ids):
        """(text, generated ids kept, finish_reason or None) from the row's ids so far."""
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
        return text, generated, finish

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


def _logprobs_block(row, ids, generated, logprobs, text):
    """OpenAI's logprobs object of one choice (the sampled tokens only)."""
    tokens, token_logprobs, offsets = [], [], []
    offset = 0
    for k, token_id in enumerate(generated):
        if offset >= len(text) and k > 0:
            break
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


def register_completions(app, model, limits, model_name):
    """Add `POST /v1/completions` and `GET /v1/models` to the Flask app."""
    from megatron.inference.text_generation_server import (
        BadRequest,
        lock,
        read_json_object,
        send_do_generate,
    )

    limits = dict(limits, model_name=model_name)
    created = int(time.time())

    @app.route('/v1/models', methods=['GET'])
    def list_models():
        return jsonify(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "megatron",
                    }
                ],
            }
        )

    def run_generation(params, step_callback=None):
        send_do_generate()
        return generate_and_post_process(
            model,
            prompts=params['prompts'],
            tokens_to_generate=params['max_tokens'],
            return_output_log_probs=params['logprobs'] is not None,
            top_k_sampling=params['top_k'],
            top_p_sampling=params['top_p'],
            temperature=params['temperature'],
            add_BOS=False,
            use_eod_token_for_early_termination=True,
            random_seed=params['random_seed'],
            step_callback=step_callback,
        )

    @app.route('/v1/completions', methods=['POST'])
    def completions():
        try:
            body = read_json_object(limits['max_request_bytes'])
            params = parse_completion_request(body, limits)
            tokenizer = get_tokenizer()
            prompt_lengths = [len(tokenizer.tokenize(p)) for p in params['prompts']]
            _check_lengths(prompt_lengths, params['max_tokens'])
        except BadRequest as exc:
            return _error_response(str(exc))
        except CompletionError as exc:
            return _error_response(str(exc), exc.param)

        rows = [_Row(n, params['max_tokens'], params['stops'], tokenizer) for n in prompt_lengths]
        meta = {
            "id": "cmpl-" + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": params['model'],
        }
        if params['stream']:
            return _stream(run_generation, params, rows, meta)

        with lock:
            _, _, logprobs, tokens = run_generation(params)
        choices = []
        completion_tokens = 0
        for i, (row, ids) in enumerate(zip(rows, tokens)):
            text, generated, finish = row.completion(ids)
            completion_tokens += len(generated)
            choice = {
                "text": text,
                "index": i,
                "logprobs": None,
                "finish_reason": finish or "length",
            }
            if params['logprobs'] is not None:
                choice["logprobs"] = _logprobs_block(row, ids, generated, logprobs[i], text)
            choices.append(choice)
        prompt_tokens = sum(prompt_lengths)
        return jsonify(
            dict(
                meta,
                object="text_completion",
                choices=choices,
                usage={
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            )
        )

    def _stream(run, params, rows, meta):
        """Server-sent events: generation runs in a thread that holds the lock and reports each
        new column; the response emits the new text of every row as it comes."""
        events = queue.Queue()

        def on_step(tokens, context_length):
            events.put(("step", tokens[:, : context_length + 1].tolist()))

        def worker():
            try:
                with lock:
                    result = run(params, step_callback=on_step)
                events.put(("done", result))
            except Exception as exc:  # reported to the client, then re-raised in the log
                events.put(("error", f"{type(exc).__name__}: {exc}"))
                raise

        def chunk(index, text, finish, logprobs=None):
            choice = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
            payload = dict(meta, object="text_completion", choices=[choice])
            return "data: " + json.dumps(payload) + "\n\n"

        def generate_events():
            threading.Thread(target=worker, daemon=True).start()
            while True:
                kind, payload = events.get()
                if kind == "error":
                    yield "data: " + json.dumps({"error": {"message": payload}}) + "\n\n"
                    break
                if kind == "step":
                    for i, (row, ids) in enumerate(zip(rows, payload)):
                        text, _, finish = row.completion(ids)
                        end = row.safe_prefix(text, finish)
                        if end > row.emitted:
                            yield chunk(i, text[row.emitted : end], None)
                            row.emitted = end
                    continue
                # The last chunk of each choice carries its finish reason (and log probs).
                _, _, logprobs, tokens = payload
                for i, (row, ids) in enumerate(zip(rows, tokens)):
                    text, generated, finish = row.completion(ids)
                    block = None
                    if params['logprobs'] is not None:
                        block = _logprobs_block(row, ids, generated, logprobs[i], text)
                    yield chunk(i, text[row.emitted :], finish or "length", block)
                break
            yield "data: [DONE]\n\n"

        return Response(generate_events(), mimetype="text/event-stream")
