"""Megatron's REST text generation server: `PUT /api` (Flask + Flask-RESTful), plus an
OpenAI-compatible `POST /v1/completions` and `GET /v1/models` (see `completions.py`).

Global rank 0 serves. Before each generation it broadcasts a choice over the default group
(`GENERATE_NUM` = 0 for sampling, `BEAM_NUM` = 1 for beam search); every other rank waits in
`run_generation_worker_loop` for that broadcast and then joins the same collective generation.
Requests are validated before anything is broadcast, and generation runs under one lock, so
concurrent requests are served one at a time.

Megatron's validation messages and statuses are kept (most are error strings with HTTP 200, and
every error body is a JSON-encoded string). Beyond Megatron, and before any work: bodies over the
size limit, bodies that are not a JSON object, prompts that are not strings and tokens_to_generate
above the model's max_position_embeddings get HTTP 400 with a one-line reason.
"""

import datetime
import json
import threading

import torch
from flask import Flask, jsonify, request
from flask_restful import Api, Resource

from megatron.core.utils import get_current_device
from megatron.inference.text_generation import (
    beam_search_and_post_process,
    generate_and_post_process,
)

GENERATE_NUM = 0
BEAM_NUM = 1
lock = threading.Lock()

#: Megatron's limit on the number of prompts of one request.
MAX_PROMPTS = 128
#: Default limit on the request body, in bytes.
MAX_REQUEST_BYTES = 1 << 20


def send_do_generate():
    """Tell the waiting ranks to join a sampling generation."""
    choice = torch.tensor([GENERATE_NUM], dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(choice, 0)


def send_do_beam_search():
    """Tell the waiting ranks to join a beam search."""
    choice = torch.tensor([BEAM_NUM], dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(choice, 0)


def run_generation_worker_loop(model):
    """Loop of every rank but the server's: wait for a choice, then join that generation.

    A ValueError (e.g. prompt too long) is raised on every rank at the same point, so it is
    dropped here; the server returns its message.
    """
    while True:
        choice = torch.tensor([-1], dtype=torch.long, device=get_current_device())
        torch.distributed.broadcast(choice, 0)
        if choice.item() == GENERATE_NUM:
            try:
                generate_and_post_process(model)
            except ValueError:
                pass
        elif choice.item() == BEAM_NUM:
            try:
                beam_search_and_post_process(model)
            except ValueError:
                pass


class BadRequest(Exception):
    """A request the server rejects with HTTP 400 before any work (beyond Megatron's checks)."""


def read_json_object(max_request_bytes):
    """The request body as a dict, or BadRequest with a one-line reason."""
    length = request.content_length
    if length is not None and length > max_request_bytes:
        raise BadRequest(
            f"request body is {length} bytes, more than the limit of {max_request_bytes} "
            f"(--max-request-bytes)"
        )
    raw = request.get_data(cache=True)
    if len(raw) > max_request_bytes:
        raise BadRequest(
            f"request body is {len(raw)} bytes, more than the limit of {max_request_bytes} "
            f"(--max-request-bytes)"
        )
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0]
        raise BadRequest(f"request body is not valid JSON: {reason}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


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
        """Validate the request (Megatron's order and messages), then generate under the lock."""
        if not request.is_json:
            # Megatron reads the body with Flask's get_json(), which refuses a non-JSON content
            # type with 415 and its own message: keep that answer.
            request.get_json()
        try:
            body = read_json_object(self.limits['max_request_bytes'])
        except BadRequest as exc:
            return str(exc), 400
        result = validate_api_request(body, self.limits)
        if not isinstance(result, dict):
            return result
        params = result

        if not params['no_log']:
            print("request IP: " + str(request.remote_addr))
            print(json.dumps(body), flush=True)
            print("start time: ", datetime.datetime.now())

        with lock:  # Need to get lock to keep multiple threads from hitting code
            try:
                if params['beam_width'] is not None:
                    # Tell other ranks we're doing beam_search
                    MegatronGenerate.send_do_beam_search()
                    response, response_seg, response_scores = beam_search_and_post_process(
                        self.model,
                        prompts=params['prompts'],
                        tokens_to_generate=params['tokens_to_generate'],
                        beam_size=params['beam_width'],
                        add_BOS=params['add_BOS'],
                        stop_token=params['stop_token'],
                        num_return_gen=params['beam_width'],  # Returning whole beam
                        length_penalty=params['length_penalty'],
                        prevent_newline_after_colon=params['prevent_newline_after_colon'],
                    )
                    return jsonify(
                        {"text": response, "segments": response_seg, "scores": response_scores}
                    )

                MegatronGenerate.send_do_generate()  # Tell other ranks we're doing generate
                response, response_seg, response_logprobs, _ = generate_and_post_process(
                    self.model,
                    prompts=params['prompts'],
                    tokens_to_generate=params['tokens_to_generate'],
                    return_output_log_probs=params['logprobs'],
                    top_k_sampling=params['top_k'],
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
                return jsonify(
                    {"text": response, "segments": response_seg, "logprobs": response_logprobs}
                )
            except ValueError as ve:
                return ve.args[0]


def validate_api_request(body, limits):
    """Check a `PUT /api` body.

    Returns:
        A dict of the request's settings (defaults filled in), or the error to return: a string
        (HTTP 200, as in Megatron) or a (string, 400) pair.
    """
    if "prompts" not in body:
        return "prompts argument required", 400
    if "max_len" in body:
        return "max_len is no longer used.  Replace with tokens_to_generate", 400
    if "sentences" in body:
        return "sentences is no longer used.  Replace with prompts", 400

    prompts = body["prompts"]
    if not isinstance(prompts, list):
        return "prompts is not a list of strings", 400
    if len(prompts) == 0:
        return "prompts is empty", 400
    if len(prompts) > limits['max_prompts']:
        return f"Maximum number of prompts is {limits['max_prompts']}", 400
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        return (
            f"prompts is not a list of strings: prompts[{bad[0]}] is a "
            f"{type(prompts[bad[0]]).__name__}"
        ), 400

    tokens_to_generate = 64  # Choosing hopefully sane default.  Full sequence is slow
    if "tokens_to_generate" in body:
        tokens_to_generate = body["tokens_to_generate"]
        if not isinstance(tokens_to_generate, int):
            return "tokens_to_generate must be an integer greater than 0"
        if tokens_to_generate < 0:
            return "tokens_to_generate must be an integer greater than or equal to 0"
        if tokens_to_generate > limits['max_position_embeddings']:
            return (
                f"tokens_to_generate ({tokens_to_generate}) is more than the model's "
                f"max_position_embeddings ({limits['max_position_embeddings']})"
            ), 400

    logprobs = False
    if "logprobs" in body:
        logprobs = body["logprobs"]
        if not isinstance(logprobs, bool):
            return "logprobs must be a boolean value"
    if tokens_to_generate == 0 and not logprobs:
        return "tokens_to_generate=0 implies logprobs should be True"

    temperature = 1.0
    if "temperature" in body:
        temperature = body["temperature"]
        if not (type(temperature) is int or type(temperature) is float):
            return "temperature must be a positive number less than or equal to 100.0"
        if not (0.0 < temperature <= 100.0):
            return "temperature must be a positive number less than or equal to 100.0"

    top_k = 0.0
    if "top_k" in body:
        top_k = body["top_k"]
        if type(top_k) is not int:
            return (
                "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"
            )
        if not (0 <= top_k <= 1000):
            return "top_k must be equal to or greater than 0 and less than or equal to 1000"

    top_p = 0.0
    if "top_p" in body:
        top_p = body["top_p"]
        if type(top_p) is not float:
            return "top_p must be a positive float less than or equal to 1.0"
        if top_p > 0.0 and top_k > 0.0:
            return "cannot set both top-k and top-p samplings."
        if not (0 <= top_p <= 1.0):
            return "top_p must be less than or equal to 1.0"

    top_p_decay = 0.0
    if "top_p_decay" in body:
        top_p_decay = body["top_p_decay"]
        if type(top_p_decay) is not float:
            return "top_p_decay must be a positive float less than or equal to 1.0"
        if top_p == 0.0:
            return "top_p_decay cannot be set without top_p"
        if not (0 <= top_p_decay <= 1.0):
            return "top_p_decay must be less than or equal to 1.0"

    top_p_bound = 0.0
    if "top_p_bound" in body:
        top_p_bound = body["top_p_bound"]
        if type(top_p_bound) is not float:
            return "top_p_bound must be a positive float less than or equal to top_p"
        if top_p == 0.0:
            return "top_p_bound cannot be set without top_p"
        if not (0.0 < top_p_bound <= top_p):
            return "top_p_bound must be greater than 0 and less than top_p"

    add_BOS = False
    if "add_BOS" in body:
        add_BOS = body["add_BOS"]
        if not isinstance(add_BOS, bool):
            return "add_BOS must be a boolean value"
    if any(len(prompt) == 0 for prompt in prompts) and not add_BOS:
        return "Empty prompts require add_BOS=true"

    flags = {}
    for name in ("stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon"):
        flags[name] = False
        if name in body:
            flags[name] = body[name]
            if not isinstance(flags[name], bool):
                return f"{name} must be a boolean value"

    random_seed = -1
    if "random_seed" in body:
        random_seed = body["random_seed"]
        if not isinstance(random_seed, int):
            return "random_seed must be integer"
        if random_seed < 0:
            return "random_seed must be a positive integer"

    no_log = False
    if "no_log" in body:
        no_log = body["no_log"]
        if not isinstance(no_log, bool):
            return "no_log must be a boolean value"

    beam_width = None
    if "beam_width" in body:
        beam_width = body["beam_width"]
        if not isinstance(beam_width, int):
            return "beam_width must be integer"
        if beam_width < 1:
            return "beam_width must be an integer > 1"
        if len(prompts) > 1:
            return "When doing beam_search, batch size must be 1"

    stop_token = 50256
    if "stop_token" in body:
        stop_token = body["stop_token"]
        if not isinstance(stop_token, int):
            return "stop_token must be an integer"

    length_penalty = 1
    if "length_penalty" in body:
        length_penalty = body["length_penalty"]
        if not isinstance(length_penalty, float):
            return "length_penalty must be a float"

    return dict(
        prompts=prompts,
        tokens_to_generate=tokens_to_generate,
        logprobs=logprobs,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        top_p_decay=top_p_decay,
        top_p_bound=top_p_bound,
        add_BOS=add_BOS,
        random_seed=random_seed,
        no_log=no_log,
        beam_width=beam_width,
        stop_token=stop_token,
        length_penalty=length_penalty,
        **flags,
    )


class MegatronServer:
    """The Flask app of rank 0.

    Args:
        model: the model of this rank (first pipeline stage, tensor-parallel rank 0).
        max_position_embeddings (int): the model's limit (tokens_to_generate above it: 400).
        max_prompts (int): prompts per request (Megatron: 128).
        max_request_bytes (int): request body limit.
        model_name (str): the name `/v1/models` reports.
    """

    def __init__(
        self,
        model,
        max_position_embeddings=None,
        max_prompts=MAX_PROMPTS,
        max_request_bytes=MAX_REQUEST_BYTES,
        model_name='megatron-gpt',
    ):
        from megatron.inference.completions import register_completions

        if max_position_embeddings is None:
            from megatron.training.global_vars import get_args

            max_position_embeddings = get_args().max_position_embeddings
        limits = {
            "max_position_embeddings": max_position_embeddings,
            "max_prompts": max_prompts,
            "max_request_bytes": max_request_bytes,
        }
        self.app = Flask(__name__, static_url_path='')
        # Bodies are read up to the limit only; a larger declared length is refused by Flask.
        self.app.config['MAX_CONTENT_LENGTH'] = max_request_bytes + 1
        api = Api(self.app)
        api.add_resource(MegatronGenerate, '/api', resource_class_args=[model, limits])
        register_completions(self.app, model, limits, model_name)

    def run(self, url, port):
        """Serve forever on url:port, one thread per request (generation itself is serialised)."""
        self.app.run(url, threaded=True, debug=False, port=port)
