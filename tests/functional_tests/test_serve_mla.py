"""A multi-latent-attention model served by the text generation server, as users serve it.

A random tiny DeepseekV3ForCausalLM (MLA with q-LoRA and YaRN, a dense then a grouped sigmoid MoE
layer with expert bias and a shared expert; `hf_checkpoints.build_hf_model("deepseek_v3")`) is
converted by tools/checkpoint/convert.py and served by tools/run_text_generation_server.py (one
process, loopback port, always stopped) on the dynamic engine, whose paged cache holds each
token's compressed latent and rotary key (12 + 4 values per token and layer instead of the
4 x (8 + 4) + 4 x 6 = 72 of expanded keys and values), in 8-token blocks so that requests
span several blocks. Over PUT /api and /v1/completions, alone and four at once, every greedy
answer is transformers' greedy continuation (its own KV cache, float32; near-ties skipped), and
every KV block comes back.
"""

import threading

import pytest

from tests.functional_tests.server_utils import REQUEST_TIMEOUT, Server, health
from tests.functional_tests.test_server_engine import _ask, _expected
from tests.unit_tests.inference import hf_checkpoints as hc

requests = pytest.importorskip("requests")
pytest.importorskip("transformers")
pytest.importorskip("flask_restful")

MARGIN = 1e-3
CLIENTS = [
    ("/api", {"prompts": ["Call me Ishmael. Some years ago"], "tokens_to_generate": 9, "top_k": 1}),
    ("/v1/completions", {"prompt": "The whale", "max_tokens": 12, "temperature": 0}),
    ("/api", {"prompts": ["a"], "tokens_to_generate": 5, "top_k": 1}),
    (
        "/v1/completions",
        {"prompt": "the old man sailed into the storm at night", "max_tokens": 7, "temperature": 0},
    ),
]


@pytest.fixture(scope="module")
def mla_server(tmp_path_factory):
    ckpt = hc.converted_checkpoint("deepseek_v3", 1, 1, tmp_path_factory)
    extra = (
        "--inference-dynamic-batching-block-size", "8",
        "--inference-dynamic-batching-buffer-size-gb", "0.001",
    )  # fmt: skip
    srv = Server(ckpt, 1, str(tmp_path_factory.mktemp("log") / "server.log"), extra=extra)
    try:
        yield srv, hc.hf_model("deepseek_v3")
    finally:
        srv.stop()


def test_served_mla_greedy_equals_transformers(mla_server):
    server, hf = mla_server
    # float32: transformers' grouped expert matmul takes no float64.
    expected = [_expected(hf, endpoint, body) for endpoint, body in CLIENTS]
    clear = [i for i, (_, margin) in enumerate(expected) if margin >= MARGIN]
    assert len(clear) >= 3, expected
    alone = [_ask(server, endpoint, body) for endpoint, body in CLIENTS]
    answers = [None] * len(CLIENTS)

    def client(i):
        try:
            answers[i] = _ask(server, *CLIENTS[i])
        except Exception as exc:  # noqa: BLE001 (reported below)
            answers[i] = ("error", repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(CLIENTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT)
    for i in clear:
        assert alone[i] == (200, expected[i][0]), (CLIENTS[i], alone[i], expected[i])
        assert answers[i] == (200, expected[i][0]), (CLIENTS[i], answers[i], expected[i])
    engine = health(server)["engine"]
    assert engine["running"] == 0
    assert engine["free_blocks"] == engine["total_blocks"], engine
