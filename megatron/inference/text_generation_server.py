"""Megatron's REST text generation server: `PUT /api` (Flask + Flask-RESTful), plus an
OpenAI-compatible `POST /v1/completions` and `GET /v1/models` (see `completions.py`).

Global rank 0 serves; the other ranks wait in `run_generation_worker_loop` (see
`worker_loop.py` for how the ranks run a request together and stay in step when one fails).
Requests are validated and tokenized before anything is broadcast, and generation runs under
one lock, so concurrent requests are served one at a time.

Megatron's validation messages and statuses are kept (most are error strings with HTTP 200, and
every error body is a JSON-encoded string). Beyond Megatron, and before any work: bodies over the
size limit, bodies that are not a JSON object (or hold NaN / Infinity), prompts that are not
strings, tokens_to_generate above the model's max_position_embeddings and values the ranks
cannot carry get HTTP 400 with a one-line reason; a generation that fails on any rank answers
HTTP 500 with its reason, and the server goes on serving. Responses never hold NaN or Infinity
(null instead). Errors under `/v1/` (unknown path, wrong method, server error) use OpenAI's
`{"error": {...}}` body.
"""

import datetime
import json
import traceback

from flask import Flask, jsonify, request
from flask_restful import Api, Resource
from werkzeug.exceptions import HTTPException, InternalServerError

from megatron.inference.api_validation import ApiError, validate_api_request
from megatron.inference.completions import error_response, register_completions
from megatron.inference.json_io import BadRequest, FiniteJSONProvider, read_json_object
from megatron.inference.text_generation import api as generation_api
from megatron.inference.text_generation.request import (
    BEAM_SEARCH,
    SAMPLING,
    GenerationSettings,
)
from megatron.inference.worker_loop import (  # noqa: F401  (Megatron's names, re-exported)
    BEAM_NUM,
    GENERATE_NUM,
    lock,
    run_generation_worker_loop,
    send_do_beam_search,
    send_do_generate,
    serve,
)

#: Megatron's limit on the number of prompts of one request.
MAX_PROMPTS = 128
#: Default limit on the request body, in bytes.
MAX_REQUEST_BYTES = 1 << 20


def settings_from_params(params):
    """The generation settings of a validated `PUT /api` request."""
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


class MegatronGenerate(Resource):
    """`PUT /api`: Megatron's generation resource."""

    def __init__(self, model, limits):
        self.model = model
        self.limits = limits

    @staticmethod
    def send_do_generate():
        send_do_generate()

    @staticmethod
    def send_do_beam_search():
        send_do_beam_search()

    def put(self):
        """Validate the request (Megatron's order and messages), prepare it, then generate under
        the lock."""
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

        settings = settings_from_params(params)
        try:
            # Megatron's generation-time ValueErrors (lengths) answer 200 with their message.
            prepared = generation_api.prepare(params['prompts'], settings)
        except ValueError as ve:
            return str(ve)
        try:
            result = serve(self.model, prepared)
        except generation_api.GenerationFailed as exc:
            return str(exc), 500
        if settings.mode == BEAM_SEARCH:
            response, response_seg, response_scores = result
            return jsonify({"text": response, "segments": response_seg, "scores": response_scores})
        response, response_seg, response_logprobs, _ = result
        return jsonify({"text": response, "segments": response_seg, "logprobs": response_logprobs})


def _openai_errors_under_v1(app):
    """Errors of `/v1/...` paths (unknown path, wrong method, uncaught exception) in OpenAI's
    error body; other paths keep Flask's answers."""

    def handle(exc):
        if not isinstance(exc, HTTPException):
            traceback.print_exc()
        http = exc if isinstance(exc, HTTPException) else InternalServerError()
        if not request.path.startswith('/v1/'):
            return http
        if http.code == 404:
            message = f'Invalid URL ({request.method} {request.path})'
        elif http.code == 405:
            message = f'{request.method} is not allowed on {request.path}'
        elif http.code >= 500:
            message = f'internal server error: {type(exc).__name__}: {exc}'
        else:
            message = http.description
        kind = 'server_error' if http.code >= 500 else 'invalid_request_error'
        return error_response(message, status=http.code, kind=kind)

    app.register_error_handler(HTTPException, handle)
    app.register_error_handler(Exception, handle)


class MegatronServer:
    """The Flask app of rank 0.

    Args:
        model: the model of this rank (first pipeline stage, tensor-parallel rank 0).
        max_position_embeddings (int): the model's limit (tokens_to_generate above it: 400).
        max_prompts (int): prompts per request (Megatron: 128).
        max_request_bytes (int): request body limit.
        model_name (str): the name `/v1/models` reports.
        vocab_size (int): the tokenizer's vocabulary (bounds top_k and beam_width).
    """

    def __init__(
        self,
        model,
        max_position_embeddings=None,
        max_prompts=MAX_PROMPTS,
        max_request_bytes=MAX_REQUEST_BYTES,
        model_name='megatron-gpt',
        vocab_size=None,
    ):
        if max_position_embeddings is None or vocab_size is None:
            from megatron.training.global_vars import get_args, get_tokenizer

            if max_position_embeddings is None:
                max_position_embeddings = get_args().max_position_embeddings
            if vocab_size is None:
                vocab_size = get_tokenizer().vocab_size
        limits = {
            "max_position_embeddings": max_position_embeddings,
            "max_prompts": max_prompts,
            "max_request_bytes": max_request_bytes,
            "vocab_size": vocab_size,
        }
        self.app = Flask(__name__, static_url_path='')
        self.app.json = FiniteJSONProvider(self.app)
        # Bodies are read up to the limit only; a larger declared length is refused by Flask.
        self.app.config['MAX_CONTENT_LENGTH'] = max_request_bytes + 1
        api = Api(self.app)
        api.add_resource(MegatronGenerate, '/api', resource_class_args=[model, limits])
        register_completions(self.app, model, limits, model_name)
        _openai_errors_under_v1(self.app)

    def run(self, url, port):
        """Serve forever on url:port, one thread per request (generation itself is serialised)."""
        self.app.run(url, threaded=True, debug=False, port=port)
