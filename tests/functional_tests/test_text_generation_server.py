"""The text generation server as users run it: tools/run_text_generation_server.py started as a
real process on a loopback port, queried with `requests`, the `openai` client and the CLI.

One single-process server (a random tiny HF GPT-2, saved with save_pretrained and converted by
tools/checkpoint/convert.py; started with --load, --use-checkpoint-args and the tokenizer files
only) serves these tests and is stopped by its fixture. The tensor-parallel server's tests
(batching, queue limits, the rank choreography) are in test_server_engine.py.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from tests.functional_tests.server_utils import REQUEST_TIMEOUT
from tests.functional_tests.server_utils import Server as _Server
from tests.unit_tests.inference import hf_checkpoints as hc

requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("flask_restful")

REPO = pathlib.Path(__file__).resolve().parents[2]
EOD = hc.VOCAB_SIZE - 1


@pytest.fixture(scope="module")
def hf_gpt2():
    return hc.hf_model("gpt2")


@pytest.fixture(scope="module")
def server(hf_gpt2, tmp_path_factory):
    ckpt = hc.converted_checkpoint("gpt2", 1, 1, tmp_path_factory)
    srv = _Server(
        ckpt,
        1,
        str(tmp_path_factory.mktemp("log") / "server.log"),
        extra=("--max-request-bytes", "4096"),
    )
    yield srv
    srv.stop()


def _tokenize(text):
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    return GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES).encode(text)


def _decode(ids):
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    return GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES).decode(ids)


def _hf_text(hf_model, prompt, new_tokens):
    ids = _tokenize(prompt)
    return _decode(ids + hc.hf_greedy(hf_model, ids, new_tokens))


# ------------------------------------------------------------------------------------------------
# PUT /api: Megatron's request fields, validation and responses

VALIDATION_CASES = [
    ({}, "prompts argument required", 400),
    (
        {"prompts": ["a"], "max_len": 3},
        "max_len is no longer used.  Replace with tokens_to_generate",
        400,
    ),
    (
        {"prompts": ["a"], "sentences": ["a"]},
        "sentences is no longer used.  Replace with prompts",
        400,
    ),
    ({"prompts": "a"}, "prompts is not a list of strings", 400),
    ({"prompts": []}, "prompts is empty", 400),
    ({"prompts": ["a"] * 129}, "Maximum number of prompts is 128", 400),
    (
        {"prompts": ["a"], "tokens_to_generate": 1.5},
        "tokens_to_generate must be an integer greater than 0",
        200,
    ),
    (
        {"prompts": ["a"], "tokens_to_generate": -1},
        "tokens_to_generate must be an integer greater than or equal to 0",
        200,
    ),
    ({"prompts": ["a"], "logprobs": 1}, "logprobs must be a boolean value", 200),
    (
        {"prompts": ["a"], "tokens_to_generate": 0},
        "tokens_to_generate=0 implies logprobs should be True",
        200,
    ),
    (
        {"prompts": ["a"], "temperature": 0.0},
        "temperature must be a positive number less than or equal to 100.0",
        200,
    ),
    (
        {"prompts": ["a"], "temperature": "1"},
        "temperature must be a positive number less than or equal to 100.0",
        200,
    ),
    (
        {"prompts": ["a"], "temperature": 100.5},
        "temperature must be a positive number less than or equal to 100.0",
        200,
    ),
    (
        {"prompts": ["a"], "top_k": 1.0},
        "top_k must be an integer equal to or greater than 0 and less than or equal to 1000",
        200,
    ),
    (
        {"prompts": ["a"], "top_k": 1001},
        "top_k must be equal to or greater than 0 and less than or equal to 1000",
        200,
    ),
    (
        {"prompts": ["a"], "top_p": 1},
        "top_p must be a positive float less than or equal to 1.0",
        200,
    ),
    (
        {"prompts": ["a"], "top_k": 5, "top_p": 0.5},
        "cannot set both top-k and top-p samplings.",
        200,
    ),
    ({"prompts": ["a"], "top_p": 1.5}, "top_p must be less than or equal to 1.0", 200),
    (
        {"prompts": ["a"], "top_p": 0.5, "top_p_decay": 1},
        "top_p_decay must be a positive float less than or equal to 1.0",
        200,
    ),
    ({"prompts": ["a"], "top_p_decay": 0.5}, "top_p_decay cannot be set without top_p", 200),
    (
        {"prompts": ["a"], "top_p": 0.5, "top_p_decay": 1.5},
        "top_p_decay must be less than or equal to 1.0",
        200,
    ),
    (
        {"prompts": ["a"], "top_p": 0.5, "top_p_bound": 1},
        "top_p_bound must be a positive float less than or equal to top_p",
        200,
    ),
    ({"prompts": ["a"], "top_p_bound": 0.5}, "top_p_bound cannot be set without top_p", 200),
    (
        {"prompts": ["a"], "top_p": 0.5, "top_p_bound": 0.7},
        "top_p_bound must be greater than 0 and less than top_p",
        200,
    ),
    ({"prompts": ["a"], "add_BOS": "yes"}, "add_BOS must be a boolean value", 200),
    ({"prompts": [""]}, "Empty prompts require add_BOS=true", 200),
    (
        {"prompts": ["a"], "stop_on_double_eol": 1},
        "stop_on_double_eol must be a boolean value",
        200,
    ),
    ({"prompts": ["a"], "stop_on_eol": 1}, "stop_on_eol must be a boolean value", 200),
    (
        {"prompts": ["a"], "prevent_newline_after_colon": 1},
        "prevent_newline_after_colon must be a boolean value",
        200,
    ),
    ({"prompts": ["a"], "random_seed": 1.0}, "random_seed must be integer", 200),
    ({"prompts": ["a"], "random_seed": -2}, "random_seed must be a positive integer", 200),
    ({"prompts": ["a"], "no_log": 1}, "no_log must be a boolean value", 200),
    ({"prompts": ["a"], "beam_width": 1.0}, "beam_width must be integer", 200),
    ({"prompts": ["a"], "beam_width": 0}, "beam_width must be an integer > 1", 200),
    ({"prompts": ["a", "b"], "beam_width": 2}, "When doing beam_search, batch size must be 1", 200),
    ({"prompts": ["a"], "beam_width": 2, "stop_token": "x"}, "stop_token must be an integer", 200),
    (
        {"prompts": ["a"], "beam_width": 2, "length_penalty": 1},
        "length_penalty must be a float",
        200,
    ),
    # Generation-time limits (Megatron's ValueErrors, status 200).
    (
        {"prompts": ["a " * 40], "tokens_to_generate": 40},
        "Length of prompt + tokens_to_generate longer than allowed",
        200,
    ),
    # Beam search caps the length at max_position_embeddings: only a prompt that fills it fails.
    (
        {"prompts": ["a " * 70], "tokens_to_generate": 1, "beam_width": 1},
        "context length + tokens_to_generate too large",
        200,
    ),
]


def test_every_validation_rule_returns_megatrons_message_and_status(server):
    for body, message, status in VALIDATION_CASES:
        response = server.put(body)
        assert (response.status_code, response.json()) == (status, message), body
        # The body is a JSON-encoded string literal, as flask-restful writes it.
        assert response.text == json.dumps(message) + "\n"
        assert response.headers["Content-Type"] == "application/json"


def test_bad_requests_get_400_and_the_server_keeps_serving(server):
    bad = [
        (
            {"data": "x" * 5000, "headers": {"Content-Type": "application/json"}},
            "more than the limit of 4096",
        ),
        ({"json": {"prompts": ["a"] * 200}}, "Maximum number of prompts is 128"),
        (
            {"json": {"prompts": ["a"], "tokens_to_generate": 65}},
            "more than the model's max_position_embeddings (64)",
        ),
        ({"data": "{not json", "headers": {"Content-Type": "application/json"}}, "not valid JSON"),
        ({"json": ["prompts"]}, "must be a JSON object"),
        ({"json": {"prompts": ["a", 3]}}, "prompts[1] is a int"),
        ({"json": {"prompts": [None]}}, "prompts[0] is a NoneType"),
        ({"json": {"prompts": ["<image>"], "images": ["AAAA"]}}, "model takes no images"),
    ]
    for kwargs, reason in bad:
        response = requests.put(server.url + "/api", timeout=REQUEST_TIMEOUT, **kwargs)
        assert response.status_code == 400, (kwargs, response.text)
        message = response.json()
        assert isinstance(message, str) and reason in message and "\n" not in message
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = requests.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [image]}]},
        timeout=REQUEST_TIMEOUT,
    )
    assert chat.status_code == 400 and "model takes no images" in chat.json()["error"]["message"]
    good = server.put({"prompts": ["Hello"], "tokens_to_generate": 2, "top_k": 1})
    assert good.status_code == 200 and good.json()["text"][0].startswith("Hello")


def test_flask_level_answers(server):
    page = requests.get(server.url + "/index.html", timeout=30)
    assert page.status_code == 200 and 'fetch("api"' in page.text
    assert (
        requests.post(server.url + "/api", json={"prompts": ["a"]}, timeout=30).status_code == 405
    )
    assert requests.get(server.url + "/api", timeout=30).status_code == 404
    response = requests.put(
        server.url + "/api",
        data='{"prompts": ["a"]}',
        headers={"Content-Type": "text/plain"},
        timeout=30,
    )
    assert response.status_code == 415 and "message" in response.json()


def test_greedy_generation_matches_transformers_and_response_format(server, hf_gpt2):
    prompts = ["Hello world, this is", "The cat"]
    response = server.put(
        {"prompts": prompts, "tokens_to_generate": 5, "top_k": 1, "logprobs": True, "no_log": True}
    )
    assert response.status_code == 200
    # jsonify sorts the keys.
    assert (
        response.text.index('"logprobs"')
        < response.text.index('"segments"')
        < response.text.index('"text"')
    )
    body = response.json()
    width = max(len(_tokenize(p)) for p in prompts) + 5
    for prompt, text, segments, logprobs in zip(
        prompts, body["text"], body["segments"], body["logprobs"]
    ):
        want = _hf_text(hf_gpt2, prompt, width - len(_tokenize(prompt)))
        assert want.startswith(text) and text.startswith(prompt)
        assert "".join(segments) == text and len(logprobs) == len(segments) - 1

    # tokens_to_generate = 0 scores the prompt.
    scored = server.put(
        {"prompts": ["Hello world"], "tokens_to_generate": 0, "logprobs": True}
    ).json()
    assert scored["text"] == ["Hello world"] and len(scored["logprobs"][0]) == 1

    # Beam search: one text and one score per beam.
    beams = server.put(
        {"prompts": ["Hello world"], "tokens_to_generate": 3, "beam_width": 2}
    ).json()
    assert sorted(beams) == ["scores", "segments", "text"] and len(beams["text"]) == 2


def test_seeded_sampling_reproduces(server):
    body = {
        "prompts": ["Once upon a time"],
        "tokens_to_generate": 8,
        "random_seed": 1234,
        "temperature": 1.5,
    }
    first, second = server.put(body).json(), server.put(body).json()
    assert first["text"] == second["text"]


def _check_concurrent_clients(server, prompts):
    """Each prompt from its own thread, twice, all at once: every answer is the prompt's own
    (as answered alone)."""
    expected = {
        p: server.put({"prompts": [p], "tokens_to_generate": 12, "top_k": 1}).json()["text"][0]
        for p in prompts
    }
    results, errors = {}, []

    def client(prompt):
        try:
            for _ in range(2):
                r = server.put({"prompts": [prompt], "tokens_to_generate": 12, "top_k": 1})
                results.setdefault(prompt, []).append(r.json()["text"][0])
        except Exception as exc:  # noqa: BLE001 (reported by the main thread below)
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT)
    assert not errors
    for p in prompts:
        assert results[p] == [expected[p]] * 2


def test_concurrent_clients_each_get_their_own_answer(server):
    _check_concurrent_clients(server, ["Alpha beta gamma", "Numbers one two", "Why is the sky"])


# ------------------------------------------------------------------------------------------------
# OpenAI-compatible endpoints, with the official client


def test_openai_client_completions(server, hf_gpt2):
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    models = client.models.list()
    assert [m.id for m in models.data] == [
        os.path.basename(os.path.normpath(next(a for a in server.proc.args if "ckpt" in a)))
    ]

    prompt = "Hello world, this is"
    completion = client.completions.create(
        model="gpt", prompt=prompt, max_tokens=6, temperature=0, logprobs=1
    )
    choice = completion.choices[0]
    full = _hf_text(hf_gpt2, prompt, 6)
    assert prompt + choice.text == full.split("<|endoftext|>")[0]
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage.prompt_tokens == len(_tokenize(prompt))
    assert len(choice.logprobs.token_logprobs) == completion.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text

    # Streaming (server-sent events) gives the same text in pieces.
    stream = client.completions.create(
        model="gpt", prompt=prompt, max_tokens=6, temperature=0, stream=True
    )
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in stream]
    assert "".join(text for text, _ in pieces) == choice.text
    assert len(pieces) > 1 and pieces[-1][1] == choice.finish_reason

    # A list of prompts, a stop sequence, a seed.
    batch = client.completions.create(
        model="gpt", prompt=["The cat", "A dog"], max_tokens=4, temperature=0.0
    )
    assert [c.index for c in batch.choices] == [0, 1]
    stop = choice.text[2:5]
    if stop.strip():
        stopped = client.completions.create(
            model="gpt", prompt=prompt, max_tokens=6, temperature=0, stop=[stop]
        )
        assert stopped.choices[0].text == choice.text[: choice.text.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"
    seeded = [
        client.completions.create(model="gpt", prompt=prompt, max_tokens=6, seed=5).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]

    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.completions.create(model="gpt", prompt=prompt, n=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="gpt", prompt=prompt, max_tokens=1000)


def test_cli(server):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "text_generation_cli.py"),
            f"127.0.0.1:{server.port}",
        ],
        input="Hello world\n3\nHi\n-1\n",
        capture_output=True,
        text=True,
        timeout=REQUEST_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Megatron Response: \nHello world" in proc.stdout
    assert "Error: tokens_to_generate must be an integer greater than or equal to 0" in proc.stdout
