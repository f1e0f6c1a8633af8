"""Text generation (megatron/inference/text_generation) on checkpoints converted from random tiny
Hugging Face GPT-2 and Llama models: greedy output equals transformers' generate token for token
at TP1, TP2 and PP2; KV cache on/off, log probs against a full forward, seeds, top-k 1 and beam
width 1 against greedy; sampling filters against their definitions."""

import importlib.util

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import hf_checkpoints as hc

transformers = pytest.importorskip("transformers")


def _load_server_tool():
    spec = importlib.util.spec_from_file_location(
        "_tool_run_text_generation_server", hc.REPO / "tools" / "run_text_generation_server.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup_model(ckpt, extra=()):
    """initialize_megatron + the server's model provider + load_checkpoint, in this rank."""
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    tool = _load_server_tool()
    destroy_global_vars()
    initialize_megatron(
        extra_args_provider=tool.add_text_generate_args,
        args_defaults=tool.ARGS_DEFAULTS,
        args_list=hc.server_flags(ckpt) + list(extra),
    )
    model = get_model(tool.model_provider, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    return model[0]


def _serve_requests(ckpt, requests, extra=()):
    """Run each request as the server does: rank 0 passes it, the other ranks join empty."""
    from megatron.inference.text_generation import (
        beam_search_and_post_process,
        generate_and_post_process,
    )

    model = _setup_model(ckpt, extra)
    rank0 = torch.distributed.get_rank() == 0
    results = []
    for req in requests:
        req = dict(req)
        beam = req.pop("beam", False)
        fn = beam_search_and_post_process if beam else generate_and_post_process
        out = fn(model, **req) if rank0 else fn(model)
        results.append(out)
    return results


PROMPTS = ["Hello world, this is", "A"]
NEW = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(HF models by arch, get(arch, tp, pp) -> the HF model converted by convert.py to that
    layout, on first use)."""
    models = {arch: hc.hf_model(arch) for arch in ("gpt2", "llama")}

    def get(arch, tp, pp):
        return hc.converted_checkpoint(arch, tp, pp, tmp_path_factory)

    return models, get


def _tokenize(text):
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    return GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES).encode(text)


def _hf_expected(hf_model, prompts, tokens_to_generate):
    """Megatron pads every prompt to the longest plus tokens_to_generate, so a shorter prompt
    gets more new tokens: ask transformers for that many."""
    ids = [_tokenize(p) for p in prompts]
    width = max(len(i) for i in ids) + tokens_to_generate
    return [i + hc.hf_greedy(hf_model, i, width - len(i)) for i in ids]


def _hf_token_logprobs(hf_model, tokens, padded_vocab):
    """log P(token k + 1 | tokens 0..k) from transformers' full forward. Megatron's log-softmax
    runs over the padded vocabulary, whose extra rows the conversion tool fills (as Megatron's
    savers do) with copies of the last real row: their logits repeat the last real logit."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0]
    pad = logits[:, -1:].expand(-1, padded_vocab - logits.size(1))
    log_probs = torch.log_softmax(torch.cat([logits, pad], dim=-1).double(), dim=-1)
    return [log_probs[k, tokens[k + 1]].item() for k in range(len(tokens) - 1)]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_greedy_matches_transformers(checkpoints, arch, layout):
    models, get_ckpt = checkpoints
    tp, pp = layout
    greedy = {"prompts": PROMPTS, "tokens_to_generate": NEW, "top_k_sampling": 1}
    requests = [dict(greedy, return_output_log_probs=True)]
    extra = ()
    if pp > 1:
        # Small threshold: the prompt step runs in pipelined micro-batches of 1 row.
        extra = ("--inference-batch-times-seqlen-threshold", "4")
    outs = run_distributed(
        _serve_requests,
        world_size=tp * pp,
        tp=tp,
        pp=pp,
        args=(get_ckpt(arch, tp, pp), requests, extra),
    )
    texts, segments, logprobs, tokens = outs[0][0]
    expected = _hf_expected(models[arch], PROMPTS, NEW)
    for row, want in zip(tokens, expected):
        # A row may stop early on <|endoftext|> (included), like transformers.
        assert row == want[: len(row)], (row, want)
        assert len(row) == len(want) or row[-1] == hc.VOCAB_SIZE - 1
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    tok = GPT2Tokenizer(hc.GPT2_VOCAB, hc.GPT2_MERGES)
    assert texts == [tok.decode(row) for row in tokens]
    assert [len(s) for s in segments] == [len(row) for row in tokens]
    for row, lp in zip(tokens, logprobs):
        assert len(lp) == len(row) - 1
        torch.testing.assert_close(
            torch.tensor(lp, dtype=torch.float64),
            torch.tensor(
                _hf_token_logprobs(models[arch], row, hc.padded_vocab_size(tp)),
                dtype=torch.float64,
            ),
            atol=1e-5,
            rtol=0,
        )
    # Results are post-processed on the first pipeline stage only (ranks 0..tp-1 here).
    for rank, out in enumerate(outs):
        assert (out[0] is not None) == (rank // tp == 0)
        if out[0] is not None:
            assert out[0][3] == tokens


def _greedy_without_cache(model, prompt_ids, new_tokens, vocab_size, eod):
    """Reference greedy loop without a KV cache: the whole prefix goes through the model at
    every step (argmax over the padded vocabulary, clamped as Megatron does)."""
    row = list(prompt_ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([row]), None, None)  # [1, s, v]
            row.append(min(int(logits[0, -1].argmax()), vocab_size - 1))
            if row[-1] == eod:
                break
    return row


def _full_forward_logprobs(model, row):
    with torch.no_grad():
        logits = model(torch.tensor([row]), None, None)[0]  # [s, v]
    log_probs = torch.log_softmax(logits, dim=-1)
    return [log_probs[k, row[k + 1]].item() for k in range(len(row) - 1)]


def _behaviours(ckpt):
    from megatron.inference.text_generation import (
        beam_search_and_post_process,
        generate_and_post_process,
    )
    from megatron.training.global_vars import get_tokenizer

    model = _setup_model(ckpt)
    tokenizer = get_tokenizer()
    run = lambda **kw: generate_and_post_process(
        model, prompts=PROMPTS, tokens_to_generate=NEW, **kw
    )
    out = {}
    out["greedy"] = run(top_k_sampling=1, return_output_log_probs=True)
    out["no_cache"] = [
        _greedy_without_cache(
            model,
            tokenizer.tokenize(p),
            len(row) - len(tokenizer.tokenize(p)),
            tokenizer.vocab_size,
            tokenizer.eod,
        )
        for p, row in zip(PROMPTS, out["greedy"][3])
    ]
    out["full_forward_logprobs"] = [_full_forward_logprobs(model, row) for row in out["greedy"][3]]
    out["score"] = generate_and_post_process(
        model, prompts=PROMPTS[:1], tokens_to_generate=0, return_output_log_probs=True
    )
    out["score_reference"] = _full_forward_logprobs(model, tokenizer.tokenize(PROMPTS[0]))
    out["seed_a"] = run(random_seed=7)
    out["seed_b"] = run(random_seed=7)
    out["seed_c"] = run(random_seed=8)
    out["top_k_1_hot"] = run(top_k_sampling=1, temperature=0.3)
    out["top_p_tiny"] = run(top_p_sampling=1e-6, temperature=2.0)
    out["beam_1"] = beam_search_and_post_process(
        model, prompts=PROMPTS[:1], tokens_to_generate=NEW, beam_size=1, num_return_gen=1
    )
    out["beam_3"] = beam_search_and_post_process(
        model,
        prompts=PROMPTS[:1],
        tokens_to_generate=NEW,
        beam_size=3,
        num_return_gen=3,
        length_penalty=1.5,
    )
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generation_behaviours(checkpoints, arch):
    _, get_ckpt = checkpoints
    (out,) = run_distributed(_behaviours, world_size=1, args=(get_ckpt(arch, 1, 1),))
    _texts, segments, logprobs, tokens = out["greedy"]

    # With and without the KV cache: the same tokens.
    assert out["no_cache"] == tokens
    # Log probs equal the full forward's log-softmax at those tokens.
    for lp, ref in zip(logprobs, out["full_forward_logprobs"]):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), atol=1e-5, rtol=0)
    # Scoring (tokens_to_generate = 0): the prompt's log probs, text unchanged.
    assert out["score"][0] == PROMPTS[:1]
    torch.testing.assert_close(
        torch.tensor(out["score"][2][0]), torch.tensor(out["score_reference"]), atol=1e-5, rtol=0
    )
    # A fixed random_seed reproduces a sampled output; another seed samples something else.
    assert out["seed_a"][3] == out["seed_b"][3]
    assert out["seed_a"][3] != out["seed_c"][3]
    assert out["seed_a"][3] != tokens
    # top_k = 1 is greedy whatever the temperature; a tiny top_p keeps only the top token.
    assert out["top_k_1_hot"][3] == tokens
    assert out["top_p_tiny"][3] == tokens

    # Beam search with width 1 follows the greedy path; its score is the length-normalised sum
    # of the generated tokens' log probs.
    _beam_texts, beam_segments, beam_scores = out["beam_1"]
    prompt_len = len(_tokenize(PROMPTS[0]))
    greedy_row = tokens[0]
    assert beam_segments[0][: len(greedy_row)] == segments[0]
    if greedy_row[-1] != hc.VOCAB_SIZE - 1:
        generated = len(greedy_row) - prompt_len
        expected = sum(logprobs[0][prompt_len - 1 :]) / generated
        assert abs(beam_scores[0] - expected) < 1e-4, (beam_scores, expected)
    # Wider beams: one text per beam, best score first.
    texts3, _, scores3 = out["beam_3"]
    assert len(texts3) == 3 and scores3 == sorted(scores3, reverse=True)
    assert all(t.startswith(PROMPTS[0]) for t in texts3)


EOL, DOUBLE_EOL = 198, 628  # GPT-2 ids of "\n" and "\n\n"


def _boosted_generations(ckpt):
    """Greedy generations while a forward hook on the output layer adds a large bias to the
    logit of "\\n" or "\\n\\n" (the model itself is unchanged), with each termination option."""
    from megatron.inference.text_generation import generate_and_post_process
    from megatron.training.global_vars import get_args, get_tokenizer

    model = _setup_model(ckpt)
    boost = torch.zeros(get_args().padded_vocab_size)

    def add_boost(_module, _inputs, output):
        logits, bias = output  # logits [s, b, v]
        return logits + boost, bias

    model.output_layer.register_forward_hook(add_boost)

    def run(prompts, **kw):
        """Each row's tokens cut to its length, as its text and segments are (the returned
        tokens themselves are the whole padded rows, as in Megatron)."""
        _, segments, _, tokens = generate_and_post_process(
            model, prompts=prompts, tokens_to_generate=NEW, top_k_sampling=1, **kw
        )
        return [row[: len(seg)] for row, seg in zip(tokens, segments)]

    tokenize = get_tokenizer().tokenize
    out = {"prompts": [tokenize(p) for p in PROMPTS], "colon_prompt": tokenize("Answer:")}
    out["colon_unboosted"] = run(["Answer:"], prevent_newline_after_colon=True)
    boost[EOL] = 1e3
    out["eol"] = run(PROMPTS)
    out["eol_stop_on_eol"] = run(PROMPTS, stop_on_eol=True)
    out["eol_stop_on_double_eol"] = run(PROMPTS, stop_on_double_eol=True)
    out["colon_prevent"] = run(["Answer:"], prevent_newline_after_colon=True)
    out["colon_allow"] = run(["Answer:"], prevent_newline_after_colon=False)
    boost[EOL] = 0.0
    boost[DOUBLE_EOL] = 1e3
    out["double_eol_stop_on_eol"] = run(PROMPTS, stop_on_eol=True)
    out["double_eol_stop_on_double_eol"] = run(PROMPTS, stop_on_double_eol=True)
    return out


def test_stop_on_eol_double_eol_and_no_newline_after_colon(checkpoints):
    _, get_ckpt = checkpoints
    (out,) = run_distributed(_boosted_generations, world_size=1, args=(get_ckpt("gpt2", 1, 1),))
    prompts, width = out["prompts"], max(len(p) for p in out["prompts"]) + NEW
    # Without a stop option "\n" does not end a row: every row runs to the padded width.
    assert out["eol"] == [p + [EOL] * (width - len(p)) for p in prompts]
    # stop_on_eol: each row ends on its first "\n" (kept), rows of different prompt lengths
    # ending at different columns.
    assert out["eol_stop_on_eol"] == [p + [EOL] for p in prompts]
    # stop_on_double_eol: two "\n" in a row, or one "\n\n" token.
    assert out["eol_stop_on_double_eol"] == [p + [EOL, EOL] for p in prompts]
    assert out["double_eol_stop_on_double_eol"] == [p + [DOUBLE_EOL] for p in prompts]
    # stop_on_eol also stops on "\n\n", as in Megatron.
    assert out["double_eol_stop_on_eol"] == [p + [DOUBLE_EOL] for p in prompts]

    # prevent_newline_after_colon: right after ":" the "\n" logit is forbidden, so the first
    # token is the model's own choice without the boost; after that "\n" is allowed again.
    colon = out["colon_prompt"]
    assert colon[-1] == 25  # ":"
    (unboosted,) = out["colon_unboosted"]
    assert unboosted[len(colon)] != EOL
    (prevented,) = out["colon_prevent"]
    assert prevented == colon + [unboosted[len(colon)]] + [EOL] * (NEW - 1)
    (allowed,) = out["colon_allow"]
    assert allowed == colon + [EOL] * NEW
