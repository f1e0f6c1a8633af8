"""Megatron's REST text generation server: `PUT /api` (Flask + Flask-RESTful), plus
OpenAI-compatible `POST /v1/completions`, `POST /v1/chat/completions` and `GET /v1/models`
(`completions.py`, `chat_completions.py`), and `GET /health`.

Global rank 0 serves; its `ServingLoop` thread runs the dynamic-batching engine (and the legacy
generate() loop where the engine cannot serve) and the other ranks follow it in
`run_generation_worker_loop` (see `worker_loop.py`). Concurrent requests are batched: each prompt
is an engine request that joins the next step and leaves when it is done, and its greedy output
is the one it gets alone. A full queue answers 503.

`PUT /api` keeps Megatron's fields, validation messages and statuses (most are error strings
with HTTP 200, and every error body is a JSON-encoded string) and its answers: each text holds
the prompt and the generation, a shorter prompt of a batch generates up to the longest prompt +
tokens_to_generate as in Megatron's padded batch, the end-of-text token stays in the text, and log
probs cover the prompt. Requests with `beam_width`, `top_p_decay` / `top_p_bound` or
`prevent_newline_after_colon` (and every request under `--use-legacy-static-engine`) run
through Megatron's generate() loop, one at a time, between engine steps.

Beyond Megatron, and before any work: bodies over the size limit, bodies that are not a JSON
object (or hold NaN / Infinity), prompts that are not strings, tokens_to_generate above the
model's max_position_embeddings and values the ranks cannot carry get HTTP 400 with a one-line
reason; a generation that fails answers HTTP 500 with its reason, and the server goes on serving.
Responses never hold NaN or Infinity (null instead). Errors under `/v1/` (unknown path, wrong
method, server error) use OpenAI's `{"error": {...}}` body. A vision-language (LLaVA) server
takes `"images"` (base64 PNG / JPEG) with `<image>` markers in the prompts (`vlm_api.py`).
"""

import datetime
import json
import traceback

from flask import Flask, jsonify, request
from flask_restful import Api, Resource
from werkzeug.exceptions import HTTPException, InternalServerError, MethodNotAllowed, NotFound

from megatron.core.inference.engines.dynamic_engine import QueueFullError
from megatron.inference.api_validation import ApiError, validate_api_request
from megatron.inference.chat_completions import register_chat_completions
from megatron.inference.completions import error_response, register_completions
from megatron.inference.json_io import BadRequest, FiniteJSONProvider, read_json_object
from megatron.inference.sampling_from_api import engine_sampling_params
from megatron.inference.serving import Serving, legacy_serving
from megatron.inference.text_generation import api as generation_api
from megatron.inference.text_generation.request import (
    BEAM_SEARCH,
    SAMPLING,
    GenerationSettings,
)
from megatron.inference.text_generation.tokenization import (
    UntokenizablePrompt,
    eod_id,
    token_strings,
    tokenize_batch,
)
from megatron.inference.vlm_api import vision_language_api
from megatron.inference.worker_loop import (  # noqa: F401  (Megatron's names, re-exported)
    BEAM_NUM,
    GENERATE_NUM,
    lock,
    run_generation_worker_loop,
    send_do_beam_search,
    send_do_generate,
)

#: Megatron's limit on the number of prompts of one request.
MAX_PROMPTS = 128
#: Default limit on the request body, in bytes.
MAX_REQUEST_BYTES = 1 << 20


def settings_from_params(params):
    """The legacy generation settings of a validated `PUT /api` request."""
    if params['beam_width'] is not None:
        return GenerationSettings(
            mode=BEAM_SEARCH,
            tokens_to_generate=params['tokens_to_generate'],
            beam_size=params['beam_width'],
            add_BOS=params['add_BOS'],
            stop_token=params['stop_token'],
            num_return_gen=params['beam_width'],  # Returning whole beam
            length_penalty=params['length_penalty'],
            prevent_newline_after_colon=params['prevent_newline_after_colon'],
        )
    return GenerationSettings(
        mode=SAMPLING,
        tokens_to_generate=params['tokens_to_generate'],
        return_output_log_probs=params['logprobs'],
        top_k_sampling=int(params['top_k']),
        top_p_sampling=params['top_p'],
        top_p_decay=params['top_p_decay'],
        top_p_bound=params['top_p_bound'],
        temperature=params['temperature'],
        add_BOS=params['add_BOS'],
        use_eod_token_for_early_termination=True,
        stop_on_double_eol=params['stop_on_double_eol'],
        stop_on_eol=params['stop_on_eol'],
        prevent_newline_after_colon=params['prevent_newline_after_colon'],
        random_seed=params['random_seed'],
    )


def needs_legacy_path(params) -> bool:
    """Whether a validated `PUT /api` request needs Megatron's generate() loop: beam search, and
    the per-batch rules the engine's per-request sampling does not have (top_p decaying with the
    batch's steps, the colon rule rewriting logits)."""
    return (
        params['beam_width'] is not None
        or params['top_p_decay'] > 0.0
        or params['top_p_bound'] > 0.0
        or params['prevent_newline_after_colon']
    )


class MegatronGenerate(Resource):
    """`PUT /api`: Megatron's generation resource."""

    def __init__(self, serving, limits):
        self.serving = serving
        self.limits = limits

    @staticmethod
    def send_do_generate():
        send_do_generate()

    @staticmethod
    def send_do_beam_search():
        send_do_beam_search()

    def put(self):
        """Validate the request (Megatron's order and messages), then generate on the engine
        (or the legacy loop)."""
        if not request.is_json:
            # Megatron reads the body with Flask's get_json(), which refuses a non-JSON content
            # type with 415 and its own message: keep that answer.
            request.get_json()
        try:
            body = read_json_object(self.limits['max_request_bytes'])
            params = validate_api_request(body, self.limits)
        except BadRequest as exc:
            return str(exc), 400
        except ApiError as exc:
            return exc.message, exc.status

        if not params['no_log']:
            print("request IP: " + str(request.remote_addr))
            print(json.dumps(body), flush=True)
            print("start time: ", datetime.datetime.now())
        if self.serving.takes_images or "images" in body:
            return vision_language_api(self.serving, params, body)
        if self.serving.legacy or needs_legacy_path(params):
            return self._legacy(params)
        return self._engine(params)

    def _legacy(self, params):
        settings = settings_from_params(params)
        try:
            # Megatron's generation-time ValueErrors (lengths) answer 200 with their message.
            prepared = generation_api.prepare(params['prompts'], settings)
        except UntokenizablePrompt as exc:  # e.g. a lone surrogate: a bad request
            return str(exc), 400
        except ValueError as ve:
            return str(ve)
        try:
            result = self.serving.loop.run_legacy(prepared)
        except (generation_api.GenerationFailed, RuntimeError) as exc:
            return str(exc), 500
        if settings.mode == BEAM_SEARCH:
            response, response_seg, response_scores = result
            return jsonify({"text": response, "segments": response_seg, "scores": response_scores})
        response, response_seg, response_logprobs, _ = result
        return jsonify({"text": response, "segments": response_seg, "logprobs": response_logprobs})

    def _engine(self, params):
        tokenizer = self.serving.tokenizer
        try:
            rows, lengths = tokenize_batch(tokenizer, params['prompts'], 0, params['add_BOS'])
        except UntokenizablePrompt as exc:
            return str(exc), 400
        except ValueError as ve:
            return str(ve)
        rows = [row[:length] for row, length in zip(rows, lengths)]  # no padding
        if max(lengths) + params['tokens_to_generate'] > self.serving.max_sequence_length:
            return 'Length of prompt + tokens_to_generate longer than allowed'
        choice_params = engine_sampling_params(params, lengths, eod_id(tokenizer))
        try:
            generation = self.serving.generation(rows, choice_params)
        except QueueFullError as exc:
            return self.serving.busy_message(exc), 503
        except ValueError as exc:
            return str(exc), 400
        generation.wait()
        if generation.error is not None:
            return f"generation failed: {generation.error}", 500
        texts, segments, logprobs = [], [], []
        for choice in generation.choices:
            ids = choice.prompt_ids + choice.generated
            texts.append(tokenizer.detokenize(ids))
            segments.append(token_strings(tokenizer, ids))
            if params['logprobs']:
                # Entry k is log P(token k + 1 | tokens 0..k), prompt tokens included.
                row = (choice.prompt_log_probs or []) + (choice.log_probs or [])
                logprobs.append(row[: len(ids) - 1])
        return jsonify(
            {"text": texts, "segments": segments, "logprobs": logprobs if logprobs else None}
        )


def _methods_of(app, path):
    """The methods the app's own routes (not the static files) answer on `path`."""
    methods = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint != 'static' and rule.rule.rstrip('/') == path.rstrip('/'):
            methods |= set(rule.methods or ()) - {'HEAD', 'OPTIONS'}
    return methods


def _openai_errors_under_v1(app):
    """Errors of `/v1/...` paths (unknown path, wrong method, uncaught exception) in OpenAI's
    error body; other paths keep Flask's answers."""

    def handle(exc):
        if not isinstance(exc, HTTPException):
            traceback.print_exc()
        http = exc if isinstance(exc, HTTPException) else InternalServerError()
        if not request.path.startswith('/v1/'):
            return http
        allow = None
        if http.code in (404, 405):
            # The static-file rule (GET on any path) must not decide: an unknown /v1 path is 404
            # whatever the method, a known one with another method 405.
            allow = _methods_of(app, request.path)
            http = MethodNotAllowed(sorted(allow)) if allow else NotFound()
        if http.code == 404:
            message = f'Invalid URL ({request.method} {request.path})'
        elif http.code == 405:
            message = f'{request.method} is not allowed on {request.path}'
        elif http.code >= 500:
            message = f'internal server error: {type(exc).__name__}: {exc}'
        else:
            message = http.description
        kind = 'server_error' if http.code >= 500 else 'invalid_request_error'
        body, status = error_response(message, status=http.code, kind=kind)
        if allow:
            body.headers['Allow'] = ', '.join(sorted(allow))
        return body, status

    app.register_error_handler(HTTPException, handle)
    app.register_error_handler(Exception, handle)


class MegatronServer:
    """The Flask app of rank 0.

    Args:
        serving (serving.Serving): the serving loop, tokenizer and limits. A model instead
            (Megatron's `MegatronServer(model)`) serves every request through the legacy
            generate() loop, one at a time, as Megatron's server does (its other ranks may run
            Megatron's own worker loop).
        max_position_embeddings (int): the model's limit (tokens_to_generate above it: 400;
            default --max-position-embeddings).
        max_prompts (int): prompts per request (Megatron: 128).
        max_request_bytes (int): request body limit.
        model_name (str): the name `/v1/models` reports.
        vocab_size (int): the tokenizer's vocabulary (bounds top_k and beam_width; default the
            serving tokenizer's).
    """

    def __init__(
        self,
        serving,
        max_position_embeddings=None,
        max_prompts=MAX_PROMPTS,
        max_request_bytes=MAX_REQUEST_BYTES,
        model_name='megatron-gpt',
        vocab_size=None,
    ):
        if not isinstance(serving, Serving):
            serving = legacy_serving(serving)
        if max_position_embeddings is None:
            from megatron.training.global_vars import get_args

            max_position_embeddings = get_args().max_position_embeddings
        self.serving = serving
        limits = {
            "max_position_embeddings": max_position_embeddings,
            "max_sequence_length": serving.max_sequence_length,
            "max_prompts": max_prompts,
            "max_request_bytes": max_request_bytes,
            "vocab_size": vocab_size if vocab_size is not None else serving.tokenizer.vocab_size,
        }
        self.app = Flask(__name__, static_url_path='')
        self.app.json = FiniteJSONProvider(self.app)
        # Bodies are read up to the limit only; a larger declared length is refused by Flask.
        self.app.config['MAX_CONTENT_LENGTH'] = max_request_bytes + 1
        api = Api(self.app)
        api.add_resource(MegatronGenerate, '/api', resource_class_args=[serving, limits])
        register_completions(self.app, serving, limits, model_name)
        register_chat_completions(self.app, serving, limits, model_name)

        def health():
            body, status = serving.health()
            return jsonify(body), status

        self.app.add_url_rule('/health', 'health', health, methods=['GET'])
        self.app.add_url_rule('/v1/health', 'v1_health', health, methods=['GET'])
        _openai_errors_under_v1(self.app)

    def run(self, url, port):
        """Serve forever on url:port, one thread per request (the serving loop batches them)."""
        self.app.run(url, threaded=True, debug=False, port=port)
