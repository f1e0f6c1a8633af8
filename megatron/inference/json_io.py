"""JSON in and out of the text generation server.

In: the request body as a JSON object, or `BadRequest` with a one-line reason: too large, not
valid JSON (Python's parser also takes `NaN`, `Infinity` and `-Infinity`, which no JSON client
sends and which would reach the generation as non-finite numbers: they are refused), nested too
deep, or not an object.

Out: responses never hold a non-finite float (`NaN` is not JSON: a client's parser fails on
it); `finite` turns them into null, and `FiniteJSONProvider` does that for every `jsonify`.
"""

import json
import math

from flask import request
from flask.json.provider import DefaultJSONProvider


class BadRequest(Exception):
    """A request the server rejects with HTTP 400 before any work (beyond Megatron's checks)."""


def _refuse_constant(name):
    raise ValueError(f'{name} is not a JSON number')


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
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0]
        raise BadRequest(f"request body is not valid JSON: {reason}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def finite(value):
    """`value` with every non-finite float (NaN, +-inf) replaced by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value, **kwargs):
    """json.dumps of `finite(value)`; raises rather than ever writing NaN."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


class FiniteJSONProvider(DefaultJSONProvider):
    """Flask's JSON provider (keys sorted, as Megatron's responses are) without non-finite
    floats."""

    def dumps(self, obj, **kwargs):
        return super().dumps(finite(obj), allow_nan=False, **kwargs)
