"""Validation of a `PUT /api` body: Megatron's rules, order, messages and statuses, then the
numeric limits of what reaches the collectives.

Megatron answers most validation errors with HTTP 200 and an error string (only the prompt
checks use 400); those statuses are kept. The checks beyond Megatron answer 400: prompts that
are not strings, tokens_to_generate above max_position_embeddings, and values that the ranks
could not carry or compute with (a seed or stop token beyond 64 bits, top_k not below the
vocabulary, a beam wider than half of it, a length penalty that overflows).

Each step reads some fields of the body and returns their values, or raises `ApiError`.
"""

from megatron.inference.text_generation.request import INT64_MAX, INT64_MIN, MAX_LENGTH_PENALTY


class ApiError(Exception):
    """A rejected body: `message` returned with HTTP `status`."""

    def __init__(self, message, status=200):
        super().__init__(message)
        self.message = message
        self.status = status


def _bool_field(body, name):
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean value")
    return value


def check_prompts(body, limits):
    """prompts (and Megatron's renamed fields)."""
    if "prompts" not in body:
        raise ApiError("prompts argument required", 400)
    if "max_len" in body:
        raise ApiError("max_len is no longer used.  Replace with tokens_to_generate", 400)
    if "sentences" in body:
        raise ApiError("sentences is no longer used.  Replace with prompts", 400)
    prompts = body["prompts"]
    if not isinstance(prompts, list):
        raise ApiError("prompts is not a list of strings", 400)
    if len(prompts) == 0:
        raise ApiError("prompts is empty", 400)
    if len(prompts) > limits['max_prompts']:
        raise ApiError(f"Maximum number of prompts is {limits['max_prompts']}", 400)
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise ApiError(
            f"prompts is not a list of strings: prompts[{bad[0]}] is a "
            f"{type(prompts[bad[0]]).__name__}",
            400,
        )
    return {"prompts": prompts}


def check_length(body, limits):
    """tokens_to_generate (default 64) and logprobs."""
    tokens_to_generate = body.get("tokens_to_generate", 64)
    if not isinstance(tokens_to_generate, int):
        raise ApiError("tokens_to_generate must be an integer greater than 0")
    if tokens_to_generate < 0:
        raise ApiError("tokens_to_generate must be an integer greater than or equal to 0")
    if "tokens_to_generate" in body and tokens_to_generate > limits['max_position_embeddings']:
        raise ApiError(
            f"tokens_to_generate ({tokens_to_generate}) is more than the model's "
            f"max_position_embeddings ({limits['max_position_embeddings']})",
            400,
        )
    logprobs = _bool_field(body, "logprobs")
    if tokens_to_generate == 0 and not logprobs:
        raise ApiError("tokens_to_generate=0 implies logprobs should be True")
    return {"tokens_to_generate": tokens_to_generate, "logprobs": logprobs}


def check_temperature_and_top_k(body, limits):
    """temperature (default 1.0) and top_k (default 0)."""
    temperature = body.get("temperature", 1.0)
    if not (type(temperature) is int or type(temperature) is float) or not (
        0.0 < temperature <= 100.0
    ):
        raise ApiError("temperature must be a positive number less than or equal to 100.0")
    top_k = body.get("top_k", 0.0)
    if "top_k" in body:
        if type(top_k) is not int:
            raise ApiError(
                "top_k must be an integer equal to or greater than 0 and less than or equal to 1000"
            )
        if not (0 <= top_k <= 1000):
            raise ApiError(
                "top_k must be equal to or greater than 0 and less than or equal to 1000"
            )
        vocab_size = limits.get('vocab_size')
        if vocab_size is not None and top_k > 1 and top_k >= vocab_size:
            raise ApiError(
                f"top_k ({top_k}) must be less than the vocabulary size ({vocab_size})", 400
            )
    return {"temperature": temperature, "top_k": top_k}


def check_top_p(body, top_k):
    """top_p, top_p_decay and top_p_bound (defaults 0.0)."""
    top_p = body.get("top_p", 0.0)
    if "top_p" in body:
        if type(top_p) is not float:
            raise ApiError("top_p must be a positive float less than or equal to 1.0")
        if top_p > 0.0 and top_k > 0.0:
            raise ApiError("cannot set both top-k and top-p samplings.")
        if not (0 <= top_p <= 1.0):
            raise ApiError("top_p must be less than or equal to 1.0")
    top_p_decay = body.get("top_p_decay", 0.0)
    if "top_p_decay" in body:
        if type(top_p_decay) is not float:
            raise ApiError("top_p_decay must be a positive float less than or equal to 1.0")
        if top_p == 0.0:
            raise ApiError("top_p_decay cannot be set without top_p")
        if not (0 <= top_p_decay <= 1.0):
            raise ApiError("top_p_decay must be less than or equal to 1.0")
    top_p_bound = body.get("top_p_bound", 0.0)
    if "top_p_bound" in body:
        if type(top_p_bound) is not float:
            raise ApiError("top_p_bound must be a positive float less than or equal to top_p")
        if top_p == 0.0:
            raise ApiError("top_p_bound cannot be set without top_p")
        if not (0.0 < top_p_bound <= top_p):
            raise ApiError("top_p_bound must be greater than 0 and less than top_p")
    return {"top_p": top_p, "top_p_decay": top_p_decay, "top_p_bound": top_p_bound}


def check_flags(body, prompts):
    """add_BOS (empty prompts need it) and the three stop / newline flags."""
    values = {"add_BOS": _bool_field(body, "add_BOS")}
    if any(len(prompt) == 0 for prompt in prompts) and not values["add_BOS"]:
        raise ApiError("Empty prompts require add_BOS=true")
    for name in ("stop_on_double_eol", "stop_on_eol", "prevent_newline_after_colon"):
        values[name] = _bool_field(body, name)
    return values


def check_seed_and_log(body):
    """random_seed (default -1: unset) and no_log."""
    random_seed = body.get("random_seed", -1)
    if "random_seed" in body:
        if not isinstance(random_seed, int):
            raise ApiError("random_seed must be integer")
        if random_seed < 0:
            raise ApiError("random_seed must be a positive integer")
        if random_seed > INT64_MAX:
            raise ApiError(f"random_seed must be at most 2**63 - 1, got {random_seed}", 400)
    return {"random_seed": random_seed, "no_log": _bool_field(body, "no_log")}


def check_beam_search(body, prompts, limits):
    """beam_width (default None: sampling), stop_token (50256) and length_penalty (1)."""
    beam_width = body.get("beam_width")
    if "beam_width" in body:
        if not isinstance(beam_width, int):
            raise ApiError("beam_width must be integer")
        if beam_width < 1:
            raise ApiError("beam_width must be an integer > 1")
        if len(prompts) > 1:
            raise ApiError("When doing beam_search, batch size must be 1")
        largest = max(1, limits.get('vocab_size', 2 * beam_width) // 2)
        if beam_width > largest:
            raise ApiError(
                f"beam_width ({beam_width}) must be at most {largest}: each step ranks "
                f"2 x beam_width candidates among the vocabulary's tokens",
                400,
            )
    stop_token = body.get("stop_token", 50256)
    if "stop_token" in body:
        if not isinstance(stop_token, int):
            raise ApiError("stop_token must be an integer")
        if not INT64_MIN <= stop_token <= INT64_MAX:
            raise ApiError(f"stop_token must fit in 64 bits, got {stop_token}", 400)
    length_penalty = body.get("length_penalty", 1)
    if "length_penalty" in body:
        if not isinstance(length_penalty, float):
            raise ApiError("length_penalty must be a float")
        if abs(length_penalty) > MAX_LENGTH_PENALTY:
            raise ApiError(
                f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {length_penalty}",
                400,
            )
    return {"beam_width": beam_width, "stop_token": stop_token, "length_penalty": length_penalty}


def validate_api_request(body, limits):
    """Check a `PUT /api` body, step by step in Megatron's order.

    Args:
        body (dict): the JSON body.
        limits (dict): max_prompts, max_position_embeddings and (optional) vocab_size.

    Returns:
        dict: the request's settings, defaults filled in.

    Raises:
        ApiError: the first rule broken (message and HTTP status).
    """
    params = check_prompts(body, limits)
    params.update(check_length(body, limits))
    params.update(check_temperature_and_top_k(body, limits))
    params.update(check_top_p(body, params["top_k"]))
    params.update(check_flags(body, params["prompts"]))
    params.update(check_seed_and_log(body))
    params.update(check_beam_search(body, params["prompts"], limits))
    return params
