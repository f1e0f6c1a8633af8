"""megatron.core.inference engines on checkpoints converted from random tiny Hugging Face GPT-2 and
Llama models (tools/checkpoint/convert.py), at TP1, TP2 and PP2, and Qwen3 and DeepSeek-V3 (MLA +
MoE, latent KV cache) at TP2:

- the static engine (MCoreEngine, r0.8 API) gives exactly the tokens and log probs of Megatron's
  generate() (same forwards), cut at num_tokens_to_generate and before the end-of-document id;
- the dynamic engine, with requests arriving at different steps, gives each request the tokens
  of transformers' greedy generate() for that prompt alone;
- both equal transformers' greedy continuation token for token.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import hf_checkpoints as hc
from tests.unit_tests.inference.test_generation import _setup_model, _tokenize

transformers = pytest.importorskip("transformers")

PROMPTS = ["Hello world, this is", "A", "The quick brown fox jumps over the"]
NEW = 6
EOD = hc.VOCAB_SIZE - 1


def _run_engines(ckpt, extra):
    from megatron.core.inference.common_inference_params import CommonInferenceParams
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.inference.inference_engine import get_inference_engine
    from megatron.inference.text_generation import generate_and_post_process
    from megatron.training.global_vars import get_args
    from megatron.training.gpt_builder import gpt_config_from_args

    model = _setup_model(ckpt, extra)
    args = get_args()
    rank0 = torch.distributed.get_rank() == 0
    request = dict(
        prompts=PROMPTS, tokens_to_generate=NEW, top_k_sampling=1, return_output_log_probs=True
    )
    legacy = (
        generate_and_post_process(model, **request) if rank0 else generate_and_post_process(model)
    )
    # From here the model returns vocabulary-parallel logits (as pretrain_gpt.py builds it): the
    # engines gather them over the TP group.
    if hasattr(model, "output_layer"):
        model.output_layer.gather_output = False

    greedy = CommonInferenceParams(top_k=1, num_tokens_to_generate=NEW, return_log_probs=True)
    static_engine = get_inference_engine(args, model, max_batch_size=len(PROMPTS))
    static = static_engine.generate(PROMPTS, greedy)
    static_again = get_inference_engine(args, model, max_batch_size=1).generate(PROMPTS[:1], greedy)

    # Dynamic engine, small blocks; request i arrives at step 2 * i.
    context = DynamicInferenceContext(
        gpt_config_from_args(args),  # MLA: the latent pools
        max_sequence_length=args.max_position_embeddings,
        block_size_tokens=4,
        num_blocks=32,
        max_tokens=64,
    )
    engine = DynamicInferenceEngine(static_engine.text_generation_controller, context)
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, return_log_probs=True)
    ids, step = [], 0
    while len(ids) < len(PROMPTS) or engine.has_unfinished_requests():
        if len(ids) < len(PROMPTS) and step % 2 == 0:
            ids.append(engine.add_request(PROMPTS[len(ids)], params))
        engine.step()
        step += 1
    dynamic = [engine.get_request(i) for i in ids]
    return {
        "legacy": legacy,
        "static": [
            (
                r.generated_tokens.tolist(),
                r.generated_text,
                r.generated_log_probs,
                r.prompt_log_probs,
            )
            for r in static
        ],
        "static_again": [r.generated_tokens.tolist() for r in static_again],
        "dynamic": [
            (r.generated_tokens, r.generated_text, r.generated_log_probs, r.finish_reason)
            for r in dynamic
        ],
        "free_blocks": context.block_allocator.total_avail,
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    def get(arch, tp, pp):
        return hc.converted_checkpoint(arch, tp, pp, tmp_path_factory)

    return get


def _before_eod(tokens):
    return tokens[: tokens.index(EOD)] if EOD in tokens else tokens


_CASES = [(a, lay) for a in ("gpt2", "llama") for lay in ((1, 1), (2, 1), (1, 2))]
# Qwen3 (q/k RMSNorm per head, head size != hidden / heads) at TP2: the server's model provider
# must build the q/k norms from the checkpoint's --qk-layernorm.
_CASES.append(("qwen3", (2, 1)))
# DeepSeek-V3 (multi-latent attention, MoE) at TP2: both engines cache the compressed latent,
# the dynamic one in its paged pools.
_CASES.append(("deepseek_v3", (2, 1)))


@pytest.mark.parametrize(
    "arch,layout", _CASES, ids=[f"{a}-tp{lay[0]}pp{lay[1]}" for a, lay in _CASES]
)
def test_engines_match_generate_and_transformers(checkpoints, arch, layout):
    tp, pp = layout
    # PP: a small threshold runs the static prompt step in pipelined micro-batches of 1 row.
    extra = ("--inference-batch-times-seqlen-threshold", "4") if pp > 1 else ()
    outs = run_distributed(
        _run_engines, world_size=tp * pp, tp=tp, pp=pp, args=(checkpoints(arch, tp, pp), extra)
    )
    out = outs[0]
    _texts, _segments, legacy_log_probs, legacy_tokens = out["legacy"]
    hf = hc.hf_model(arch)
    for i, prompt in enumerate(PROMPTS):
        ids = _tokenize(prompt)
        p = len(ids)
        expected = hc.hf_greedy(hf, ids, NEW)  # up to and including EOD
        # Static engine: legacy generate()'s tokens and log probs, cut at NEW and before EOD.
        tokens, text, log_probs, prompt_log_probs = out["static"][i]
        assert tokens == _before_eod(legacy_tokens[i][p : p + NEW])
        assert tokens == _before_eod(expected)
        assert log_probs == pytest.approx(
            legacy_log_probs[i][p - 1 : p - 1 + len(tokens)], abs=1e-6
        )
        assert prompt_log_probs == pytest.approx(legacy_log_probs[i][: p - 1], abs=1e-6)
        # Dynamic engine, staggered arrivals: transformers' tokens for this prompt alone (the
        # EOD that stops a request is kept in its tokens and left out of its text).
        tokens, text, log_probs, reason = out["dynamic"][i]
        assert tokens == expected, (arch, layout, i)
        assert reason == ("stop" if tokens[-1] == EOD else "length")
        assert len(log_probs) == len(tokens)
        n = len(out["static"][i][0])
        assert log_probs[:n] == pytest.approx(out["static"][i][2], abs=1e-4)
    assert out["static_again"][0] == out["static"][0][0]
    # Every rank returns the same results; every KV block came back.
    for rank_out in outs:
        assert rank_out["static"] == out["static"] and rank_out["dynamic"] == out["dynamic"]
        assert rank_out["free_blocks"] == 32


def _run_example(ckpt, extra):
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location(
        "_example_simple_gpt_batch_inference",
        hc.REPO / "examples" / "inference" / "gpt" / "simple_gpt_batch_inference.py",
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from megatron.training.global_vars import destroy_global_vars

    destroy_global_vars()
    args = hc.server_flags(ckpt) + ["--tokenizer-type", "GPT2BPETokenizer"]
    args += ["--num-tokens-to-generate", str(NEW), "--prompts", *PROMPTS[:2], *extra]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        module.main(args)
    return buffer.getvalue()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_simple_gpt_batch_inference_example(checkpoints, dynamic):
    extra = ["--max-batch-size", "2"]
    if dynamic:
        extra += ["--inference-dynamic-batching", "--inference-dynamic-batching-block-size", "8"]
    (stdout,) = run_distributed(_run_example, world_size=1, args=(checkpoints("gpt2", 1, 1), extra))
    lines = stdout.splitlines()
    hf = hc.hf_model("gpt2")
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    tok = GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES)
    for idx, prompt in enumerate(PROMPTS[:2]):
        header = lines.index(f"------------- RESULT FOR PROMPT {idx} --------------- ")
        assert lines[header - 1] == " "  # the header starts with " \n", as in Megatron
        printed = lines[header + 1]
        expected = _before_eod(hc.hf_greedy(hf, _tokenize(prompt), NEW))
        assert printed.startswith(
            "{"
            + f"'id': '{idx}', 'input_prompt': {prompt!r}, "
            + f"'generated_text': {tok.decode(expected)!r}, 'generated_tokens': "
        ), printed
        assert str(expected[0]) in printed.split("'generated_tokens': ")[1]
