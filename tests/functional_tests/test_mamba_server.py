"""A hybrid Mamba checkpoint served as users serve it: a random tiny HF Mamba2ForCausalLM (GPT-2
vocabulary) saved with save_pretrained, converted by tools/checkpoint/convert.py --model-type
mamba, and started with --load, --use-checkpoint-args and the tokenizer files only (the model
kind, layer pattern and mixer sizes come from the checkpoint's args):

- tools/run_text_generation_server.py at TP1: PUT /api greedy answers of concurrent clients
  (their requests share engine steps) equal transformers' generate;
- tools/run_mamba_text_generation_server.py (core_r0.8.0's name) under torchrun at TP2 (heads
  and groups split per rank): the same answers.

Servers bind 127.0.0.1 and are stopped by the test with bounded waits.
"""

import concurrent.futures

import pytest
import torch

from tests.functional_tests.server_utils import Server
from tests.unit_tests.inference import hf_checkpoints as hc

pytest.importorskip("requests")
transformers = pytest.importorskip("transformers")
pytest.importorskip("flask_restful")

PROMPTS = ["the whale", "Call me Ishmael. Some years ago", "a"]
NEW = 8


@pytest.fixture(scope="module")
def mamba_checkpoints(tmp_path_factory):
    """(HF model, {tp: converted checkpoint dir})."""
    from tests.functional_tests import convert_utils as cu

    root = tmp_path_factory.mktemp("mamba_server")
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(
        vocab_size=hc.VOCAB_SIZE, hidden_size=32, num_heads=4, head_dim=16, state_size=8,
        n_groups=2, expand=2, num_hidden_layers=2, conv_kernel=4, chunk_size=8, use_bias=False,
        use_conv_bias=True, layer_norm_epsilon=1e-5, residual_in_fp32=False,
        tie_word_embeddings=True, eos_token_id=hc.VOCAB_SIZE - 1,
    )  # fmt: skip
    hf = transformers.Mamba2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) - 2.0)
            elif not name.endswith("norm.weight") and not name.endswith("norm_f.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    hf.eval()
    hf.save_pretrained(root / "hf", safe_serialization=True)
    ckpts = {}
    for tp in (1, 2):
        ckpts[tp] = str(root / f"ckpt_tp{tp}")
        cu.convert(
            "--loader", "hf", "--saver", "mcore", "--load-dir", str(root / "hf"),
            "--save-dir", ckpts[tp], "--target-tensor-parallel-size", str(tp),
            "--hf-tokenizer-type", "GPT2BPETokenizer", model_type="mamba",
        )  # fmt: skip
    return hf, ckpts


def _expected(hf):
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    tok = GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out.append(tok.decode(ids + hc.hf_greedy(hf, ids, NEW)))
    return out


@pytest.mark.parametrize(
    "tp,script", [(1, "run_text_generation_server.py"), (2, "run_mamba_text_generation_server.py")]
)
def test_served_greedy_equals_transformers_generate(mamba_checkpoints, tp, script, tmp_path):
    hf, ckpts = mamba_checkpoints
    server = Server(ckpts[tp], tp, str(tmp_path / "server.log"), script=script)
    try:
        # Concurrent clients: their requests share engine steps (state slots side by side).
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(
                pool.map(
                    lambda p: server.put({"prompts": [p], "tokens_to_generate": NEW, "top_k": 1}),
                    PROMPTS,
                )
            )
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        assert "building Mamba model" in server.read_log()
        assert [r.json()["text"][0] for r in replies] == _expected(hf)
    finally:
        server.stop()
