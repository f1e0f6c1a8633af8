"""No request can stop the text generation server: one tensor-parallel server (2 ranks under
torchrun, gloo) is sent every kind of bad body Megatron's server died of or answered with invalid
JSON (values that overflowed the settings broadcast, a temperature that made the sampling NaN,
beams wider than the vocabulary, NaN literals, out-of-range seeds and stop tokens), then valid
requests that must still be answered exactly as before. A streaming client that disconnects
ends its generation at once, stop sequences end generation, and `usage` counts the returned
tokens only.

The server is the session's shared TP2 engine server (`tp2_server` in conftest.py: a random tiny
GPT-2 with 1024 positions, so that an abandoned generation would take seconds, converted to TP 2
by tools/checkpoint/convert.py); it is stopped after the last test that uses it.
"""

import json
import re
import socket
import time

import pytest

from tests.functional_tests.server_utils import TP2_POSITIONS as POSITIONS

requests = pytest.importorskip("requests")
pytest.importorskip("transformers")
pytest.importorskip("flask_restful")


def _refuse_nan(name):
    raise AssertionError(f"{name} in a response body: not JSON")


def strict_json(text):
    """json.loads that fails on NaN / Infinity (Python's parser takes them, JSON does not)."""
    return json.loads(text, parse_constant=_refuse_nan)


@pytest.fixture
def server(tp2_server):
    return tp2_server[0]


GREEDY = {"prompts": ["Hello world"], "tokens_to_generate": 4, "top_k": 1, "no_log": True}
HUGE = 10**40

#: (method, path, raw body, expected status). Each one killed a rank, desynchronized the ranks,
#: or answered invalid JSON before.
BAD_BODIES = [
    ("PUT", "/api", {"prompts": ["Hi"], "tokens_to_generate": 3, "temperature": 1e-300}, 200),
    ("PUT", "/api", {"prompts": ["Hi"], "tokens_to_generate": 3, "temperature": 1e-40}, 200),
    ("PUT", "/api", {"prompts": ["Hi"], "tokens_to_generate": 3, "top_p": 1e-300}, 200),
    ("PUT", "/api", {"prompts": ["Hi"], "random_seed": HUGE}, 400),
    ("PUT", "/api", {"prompts": ["Hi"], "random_seed": 2**64}, 400),
    ("PUT", "/api", {"prompts": ["Hi"], "tokens_to_generate": 2, "beam_width": 100000}, 400),
    ("PUT", "/api", {"prompts": ["Hi"], "tokens_to_generate": 2, "beam_width": 30000}, 400),
    ("PUT", "/api", {"prompts": ["Hi"], "beam_width": 2, "stop_token": HUGE}, 400),
    ("PUT", "/api", {"prompts": ["Hi"], "beam_width": 2, "length_penalty": 1e300}, 400),
    ("PUT", "/api", {"prompts": ["Hi"], "beam_width": 2, "length_penalty": -1e300}, 400),
    ("PUT", "/api", '{"prompts": ["Hi"], "beam_width": 2, "length_penalty": NaN}', 400),
    ("PUT", "/api", '{"prompts": ["Hi"], "temperature": Infinity}', 400),
    ("PUT", "/api", "[" * 100000 + "]" * 100000, 400),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 1e-300}, 200),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "seed": HUGE}, 400),
    ("POST", "/v1/completions", {"prompt": "Hi", "model": {"a": 1}}, 400),
    ("POST", "/v1/completions", '{"prompt": "Hi", "top_p": NaN}', 400),
    ("GET", "/v1/nothing", None, 404),
    ("PUT", "/v1/completions", {}, 405),
]


def _send(server, method, path, body):
    data = body if isinstance(body, str) or body is None else json.dumps(body)
    return requests.request(
        method,
        server.url + path,
        data=data,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )


def test_no_request_stops_the_server(server):
    before = server.put(GREEDY).json()
    for method, path, body, status in BAD_BODIES:
        response = _send(server, method, path, body)
        assert response.status_code == status, (body, response.text, server.read_log())
        payload = strict_json(response.text)
        if path.startswith("/v1/") and status != 200:
            # OpenAI's error shape.
            assert set(payload) == {"error"} and payload["error"]["message"], payload
        # Both ranks are still there and in step: the same answer as before.
        assert server.proc.poll() is None, server.read_log()
        assert server.put(GREEDY).json() == before, (body, server.read_log())
    # A tiny temperature samples greedily (its limit), not NaN.
    tiny = server.put(dict(GREEDY, top_k=0, temperature=1e-300)).json()
    assert tiny["text"] == before["text"]
    # Beam scores are finite numbers (they were NaN / -Infinity).
    beams = server.put({"prompts": ["Hi"], "tokens_to_generate": 3, "beam_width": 3}).json()
    assert all(isinstance(s, float) for s in beams["scores"])
    assert "Traceback" not in server.read_log()


def _open_stream(server, body):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    data = json.dumps(body)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n{data}".encode()
    )
    return sock


def test_disconnected_stream_stops_its_generation(server):
    sock = _open_stream(
        server, {"prompt": "Hi", "max_tokens": POSITIONS - 8, "temperature": 0, "stream": True}
    )
    first = b""
    while b"data: " not in first:
        first += sock.recv(4096)
    sock.close()
    # The server is free for the next request at once (not after ~1000 more tokens).
    start = time.time()
    assert server.put(GREEDY).status_code == 200
    assert time.time() - start < 30
    deadline = time.time() + 30
    while "the client went away" not in server.read_log() and time.time() < deadline:
        time.sleep(0.2)
    ended = re.findall(r"ended after (\d+) step\(s\) of at most (\d+) \(the client went away\)",
                       server.read_log())  # fmt: skip
    assert ended, server.read_log()
    steps, most = map(int, ended[-1])
    assert most == POSITIONS - 8 and steps < most // 4


def test_stop_sequences_end_generation_and_usage_counts_returned_tokens(server):
    url = server.url + "/v1/completions"
    full = requests.post(url, json={"prompt": "Hi", "max_tokens": 12, "temperature": 0}).json()
    text = full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 12
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    long = {"prompt": "Hi", "max_tokens": POSITIONS - 8, "temperature": 0, "stop": [stop]}
    stopped = requests.post(url, json=long).json()
    choice = stopped["choices"][0]
    assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
    # The returned text is made of exactly `completion_tokens` tokens (those cut are not
    # counted), and generation ended right after the stop sequence appeared.
    kept = stopped["usage"]["completion_tokens"]
    assert kept < 12 and _decode(_greedy_ids(server, kept))[: len(choice["text"])] == choice["text"]
    if kept:
        assert len(_decode(_greedy_ids(server, kept - 1))) < len(choice["text"])
    ended = re.findall(r"ended after (\d+) step\(s\) of at most %d \(every choice finished\)"
                       % (POSITIONS - 8), server.read_log())  # fmt: skip
    assert ended and int(ended[-1]) <= 12, server.read_log()
    # Streaming: the same text in pieces, and the usage chunk OpenAI's include_usage asks for.
    stream = requests.post(
        url,
        json=dict(long, stream=True, stream_options={"include_usage": True}),
        stream=True,
        timeout=120,
    )
    chunks = [
        strict_json(line[len("data: ") :])
        for line in stream.iter_lines(decode_unicode=True)
        if line.startswith("data: {")
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == stopped["usage"]


def _greedy_ids(server, n):
    """The first n greedy tokens after "Hi" (through PUT /api: the segments are the tokens)."""
    if n <= 0:
        return []
    body = {"prompts": ["Hi"], "tokens_to_generate": n, "top_k": 1, "no_log": True}
    return server.put(body).json()["segments"][0][1:]


def _decode(segments):
    return "".join(segments)
