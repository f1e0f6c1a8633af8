"""The text generation server on the dynamic-batching engine, as users run it.

On the session's tensor-parallel server (`tp2_server`: 2 ranks under torchrun, gloo, a random
tiny GPT-2 with 1024 positions converted to TP 2; --max-batch-size 16, --max-waiting-requests 16,
16-token KV blocks in a 0.01 GiB cache):

- 32 clients at once (PUT /api and /v1/completions, prompts and budgets of different lengths)
  each get the answer they get alone (transformers' greedy continuation), and the burst takes
  far fewer engine steps than the same requests one after the other (they were batched);
- with 16 requests running and 16 waiting, the next request is answered 503 (Megatron's string
  on /api, OpenAI's error on /v1) and /health shows the blocks in use; when the streaming
  clients disconnect, every block comes back;
- the chat endpoint refuses a tokenizer without a chat template with a 400 that names the fix;
- the rank choreography: generation-time errors, beam search, concurrent clients, OpenAI client.

On a one-process server of a tiny random Llama with a ChatML tokenizer, served with
`--tokenizer-type SFTTokenizer --sft-tokenizer-prompt-format default` as examples/sft serves a
fine-tuned model: /v1/chat/completions renders the conversation with the prompt format (the
tokens fine-tuning sees), answers transformers' greedy continuation up to the end of the turn,
and streams the same answer.
"""

import functools
import json
import random
import socket
import threading
import time

import pytest
import torch

from tests.functional_tests.server_utils import (
    REQUEST_TIMEOUT,
    TP2_MAX_BATCH,
    TP2_MAX_WAITING,
    Server,
    health,
)
from tests.unit_tests.inference import hf_checkpoints as hc

requests = pytest.importorskip("requests")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("flask_restful")

EOD = hc.VOCAB_SIZE - 1
WORDS = (
    "the a whale ship sea captain old man sailed into storm night harbor and of to his crew "
    "called me Ishmael years ago never mind how long precisely having little or no money"
).split()
#: Greedy choices closer than this (in float64 logits) may flip with the batch's fp32 rounding.
MARGIN = 1e-3


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    return GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES)


def _greedy_with_margin(hf64, ids, n):
    """transformers' greedy continuation (float64, with its KV cache; up to and including EOD)
    and the smallest top-1 / top-2 logit gap along it."""
    out = hf64.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=EOD,
        eos_token_id=EOD,
        output_scores=True,
        return_dict_in_generate=True,
    )
    top2 = torch.cat(out.scores).topk(2, dim=-1).values  # [new tokens, 2]
    return out.sequences[0, len(ids) :].tolist(), (top2[:, 0] - top2[:, 1]).min().item()


def _clients(n, seed=7):
    """n (endpoint, body) pairs: prompts of 1-24 words, 4-16 new tokens, greedy."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
        new = rng.randint(4, 16)
        if i % 2:
            out.append(("/api", {"prompts": [prompt], "tokens_to_generate": new, "top_k": 1}))
        else:
            out.append(("/v1/completions", {"prompt": prompt, "max_tokens": new, "temperature": 0}))
    return out


def _ask(server, endpoint, body):
    if endpoint == "/api":
        response = server.put(dict(body, no_log=True))
        return response.status_code, response.json()["text"][0]
    response = requests.post(server.url + endpoint, json=body, timeout=REQUEST_TIMEOUT)
    return response.status_code, response.json()["choices"][0]["text"]


def _expected(hf64, endpoint, body):
    """(the answer transformers' greedy continuation gives, its margin)."""
    prompt = body.get("prompt") or body["prompts"][0]
    n = body.get("max_tokens") or body["tokens_to_generate"]
    ids = _tokenizer().encode(prompt)
    new, margin = _greedy_with_margin(hf64, ids, n)
    if endpoint == "/api":
        return _tokenizer().decode(ids + new), margin  # prompt + generation, EOD included
    return _tokenizer().decode([t for t in new if t != EOD]), margin


def test_32_concurrent_clients_each_get_their_alone_answer(tp2_server):
    """The alone answer of each client is transformers' greedy continuation (float64; the first
    four are also asked alone from the server); together, every client gets it."""
    server, hf = tp2_server
    hf64 = hf.double()
    clients = _clients(32)
    expected = [_expected(hf64, endpoint, body) for endpoint, body in clients]
    alone = [_ask(server, endpoint, body) for endpoint, body in clients[:4]]
    assert alone == [(200, want) for want, _ in expected[:4]]

    answers = [None] * len(clients)
    barrier = threading.Barrier(len(clients))

    def client(i):
        barrier.wait(timeout=60)
        try:
            answers[i] = _ask(server, *clients[i])
        except Exception as exc:  # noqa: BLE001 (reported by the main thread below)
            answers[i] = ("error", repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(clients))]
    steps_before = health(server)["engine"]["steps"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT)
    steps = health(server)["engine"]["steps"] - steps_before
    clear = 0
    for (endpoint, body), got, (want, margin) in zip(clients, answers, expected):
        if margin < MARGIN:
            assert got[0] == 200  # a near-tie: fp32 batch rounding may pick either
            continue
        clear += 1
        assert got == (200, want), (endpoint, body, got, want, margin)
    assert clear >= 28, clear
    # Batched, not serialized: one after the other, each request needs a step per generated
    # token (its prefill samples the first); the burst took a fraction of that.
    one_by_one = sum(body.get("max_tokens") or body["tokens_to_generate"] for _, body in clients)
    assert steps < one_by_one / 3, (steps, one_by_one)
    assert health(server)["engine"]["running"] == 0


def _open_stream(server, body, path="/v1/completions"):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    data = json.dumps(body)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n{data}".encode()
    )
    return sock


def _wait_for(server, predicate, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = health(server)
        if predicate(state["engine"]):
            return state["engine"]
        time.sleep(0.2)
    raise AssertionError(f"timed out; last /health: {state}\n{server.read_log()}")


def test_full_queue_answers_503_and_disconnects_free_every_block(tp2_server):
    server, _ = tp2_server
    idle = health(server)["engine"]
    assert idle["free_blocks"] == idle["total_blocks"] and idle["waiting"] == 0
    body = {"prompt": "Hi there", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    socks = [_open_stream(server, dict(body, stream=True)) for _ in range(TP2_MAX_BATCH)]
    socks += [_open_stream(server, dict(body, stream=True)) for _ in range(TP2_MAX_WAITING)]
    try:
        busy = _wait_for(
            server, lambda e: e["running"] == TP2_MAX_BATCH and e["waiting"] == TP2_MAX_WAITING
        )
        assert busy["free_blocks"] < busy["total_blocks"]
        full = server.put({"prompts": ["Hello"], "tokens_to_generate": 2, "no_log": True})
        assert full.status_code == 503, full.text
        message = full.json()
        assert "the server is busy, try again later" in message
        assert f"--max-waiting-requests {TP2_MAX_WAITING}" in message
        assert f"--max-batch-size {TP2_MAX_BATCH}" in message
        full = requests.post(server.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
        assert full.status_code == 503
        error = full.json()["error"]
        assert error["code"] == "queue_full" and "busy" in error["message"], error
    finally:
        closed = time.time()
        for sock in socks:
            sock.close()
    # Every client went away: their requests are cancelled and every block is free again.
    _wait_for(
        server,
        lambda e: e["running"] == e["waiting"] == 0 and e["free_blocks"] == e["total_blocks"],
    )
    assert time.time() - closed < 60
    assert "(the client went away)" in server.read_log()
    ok = server.put({"prompts": ["Hello"], "tokens_to_generate": 2, "top_k": 1, "no_log": True})
    assert ok.status_code == 200


def test_chat_without_a_chat_template_is_a_clear_400(tp2_server):
    server, _ = tp2_server
    url = server.url + "/v1/chat/completions"
    response = requests.post(
        url, json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=REQUEST_TIMEOUT
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert "has no chat template" in error["message"] and error["param"] == "messages"
    assert "--tokenizer-type HuggingFaceTokenizer" in error["message"]
    missing = requests.post(url, json={"model": "m"}, timeout=REQUEST_TIMEOUT)
    assert missing.status_code == 400 and "Missing 'messages'" in missing.json()["error"]["message"]


def test_tensor_parallel_server(tp2_server):
    """Rank 0 serves, rank 1 joins every engine step and legacy request."""
    server, hf = tp2_server
    prompt = "Hello world, this is"
    ids = _tokenizer().encode(prompt)
    want = _tokenizer().decode(ids + hc.hf_greedy(hf, ids, 6))
    body = server.put({"prompts": [prompt], "tokens_to_generate": 6, "top_k": 1}).json()
    assert body["text"][0] == want, server.read_log()
    # A generation-time error on every rank, then beam search (the legacy path), then the
    # engine again.
    too_long = server.put({"prompts": ["a " * 40], "tokens_to_generate": 1000})
    assert too_long.json() == "Length of prompt + tokens_to_generate longer than allowed"
    beams = server.put({"prompts": [prompt], "tokens_to_generate": 3, "beam_width": 2}).json()
    assert len(beams["scores"]) == 2
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    text = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
    assert prompt + text.choices[0].text == body["text"][0].split("<|endoftext|>")[0]


# ------------------------------------------------------------------------------------------------
# Chat with a fine-tuned model's prompt format (examples/sft)


@pytest.fixture(scope="module")
def sft_server(tmp_path_factory):
    """(server, HF model, SFTTokenizer): a random tiny Llama with the ChatML tokenizer of
    examples/sft/make_tiny_llama.py, converted to TP 1 and served with the SFT tokenizer."""
    pytest.importorskip("tokenizers")
    from examples.sft.make_tiny_llama import build_model, build_tokenizer
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer
    from tests.functional_tests import convert_utils as cu

    root = tmp_path_factory.mktemp("sft_chat")
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    tokenizer = build_tokenizer(str(hc.REPO / "data" / "sft" / "chat.jsonl"), 512)
    model = build_model(512, 64, 2, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # wider weights than HF's init: greedy choices by clear margins
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(hf_dir, safe_serialization=True)
    tokenizer.save_pretrained(hf_dir)
    cu.convert("--loader", "hf", "--saver", "mcore", "--load-dir", hf_dir, "--save-dir", ckpt)
    flags = ["--load", ckpt, "--use-checkpoint-args", "--tokenizer-type", "SFTTokenizer",
             "--tokenizer-model", hf_dir, "--sft-tokenizer-prompt-format", "default"]  # fmt: skip
    srv = Server(ckpt, 1, str(root / "server.log"), flags=flags)
    yield srv, model.eval().double(), SFTTokenizer(hf_dir, "default")
    srv.stop()


def test_sft_model_answers_chat_requests_in_its_prompt_format(sft_server):
    server, hf64, tokenizer = sft_server
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the title of chapter 1 of Moby-Dick?"},
    ]
    ids = tokenizer.tokenize_conversation(messages, False, add_generation_prompt=True).tolist()
    assert tokenizer.detokenize(ids).endswith("<|im_start|>assistant\n")
    eos = tokenizer.eod  # <|im_end|>: the end of the assistant's turn
    new = []
    with torch.no_grad():
        for _ in range(12):
            token = int(hf64(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(token)
            if token == eos:
                break
    answer = tokenizer.detokenize([t for t in new if t != eos])

    url = server.url + "/v1/chat/completions"
    body = {"model": "sft", "messages": messages, "max_tokens": 12, "temperature": 0}
    response = requests.post(url, json=body, timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["object"] == "chat.completion"
    (choice,) = reply["choices"]
    assert choice["message"] == {"role": "assistant", "content": answer}
    assert choice["finish_reason"] == ("stop" if new[-1] == eos else "length")
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["usage"]["completion_tokens"] == len([t for t in new if t != eos])

    # The official client, streaming: the same answer in pieces, the role first.
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT
    )
    chunks = list(
        client.chat.completions.create(
            model="sft", messages=messages, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
    assert chunks[-1].choices[0].finish_reason == choice["finish_reason"]
