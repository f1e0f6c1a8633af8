"""Mamba checkpoints served as users serve them: random tiny HF models (GPT-2 vocabulary) saved
with save_pretrained, converted by tools/checkpoint/convert.py --model-type mamba, and started
with --load, --use-checkpoint-args and the tokenizer files only (the model kind, layer pattern
and mixer sizes come from the checkpoint's args); PUT /api greedy answers of concurrent clients
(their requests share engine steps) equal transformers' generate:

- a pure Mamba2ForCausalLM by tools/run_text_generation_server.py at TP1;
- a hybrid NemotronHForCausalLM (Mamba, attention, MLP layers: KV cache and Mamba states side by
  side) by tools/run_mamba_text_generation_server.py (core_r0.8.0's name) under torchrun at TP2
  (heads and groups split per rank).

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
#: (HF model kind, TP): a pure Mamba2 at TP1, a hybrid NemotronH (Mamba, attention, MLP) at TP2.
CASES = [("mamba2", 1), ("nemotron_h", 2)]
SCRIPTS = {1: "run_text_generation_server.py", 2: "run_mamba_text_generation_server.py"}


def _randomize(hf, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) - 2.0)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "mamba2":
        cfg = transformers.Mamba2Config(
            vocab_size=hc.VOCAB_SIZE, hidden_size=32, num_heads=4, head_dim=16, state_size=8,
            n_groups=2, expand=2, num_hidden_layers=2, conv_kernel=4, chunk_size=8,
            use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, residual_in_fp32=False,
            tie_word_embeddings=True, eos_token_id=hc.VOCAB_SIZE - 1,
        )  # fmt: skip
        hf = transformers.Mamba2ForCausalLM(cfg)
    else:
        cfg = transformers.NemotronHConfig(
            vocab_size=hc.VOCAB_SIZE, hidden_size=32,
            layers_block_type=["mamba", "attention", "mlp", "mamba"], mamba_num_heads=4,
            mamba_head_dim=16, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            mlp_hidden_act="relu2", use_bias=False, use_conv_bias=True, attention_bias=False,
            mlp_bias=False, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
            attn_implementation="eager", eos_token_id=hc.VOCAB_SIZE - 1,
        )  # fmt: skip
        hf = transformers.NemotronHForCausalLM(cfg)
    _randomize(hf, 1)
    return hf.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(kind, tp): (HF model, converted checkpoint dir)}."""
    from tests.functional_tests import convert_utils as cu

    root = tmp_path_factory.mktemp("mamba_server")
    out = {}
    for kind, tp in CASES:
        hf = _hf_model(kind)
        hf_dir, ckpt = root / f"hf_{kind}", str(root / f"ckpt_{kind}_tp{tp}")
        hf.save_pretrained(hf_dir, safe_serialization=True)
        cu.convert(
            "--loader", "hf", "--saver", "mcore", "--load-dir", str(hf_dir), "--save-dir", ckpt,
            "--target-tensor-parallel-size", str(tp), "--hf-tokenizer-type", "GPT2BPETokenizer",
            model_type="mamba",
        )  # fmt: skip
        # Megatron never clamps dt; NemotronH's prefill clamps at time_step_min.
        for module in hf.modules():
            if hasattr(module, "time_step_limit"):
                module.time_step_limit = (0.0, float("inf"))
        out[(kind, tp)] = (hf, ckpt)
    return out


def _expected(hf):
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    tok = GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out.append(tok.decode(ids + hc.hf_greedy(hf, ids, NEW)))
    return out


@pytest.mark.parametrize("kind,tp", CASES)
def test_served_greedy_equals_transformers_generate(checkpoints, kind, tp, tmp_path):
    hf, ckpt = checkpoints[(kind, tp)]
    script = SCRIPTS[tp]
    server = Server(ckpt, tp, str(tmp_path / "server.log"), script=script)
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
