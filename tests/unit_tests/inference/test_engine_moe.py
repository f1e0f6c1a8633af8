"""The inference engines on MoE GPT models, with expert parallelism:

- a random tiny Hugging Face Mixtral (4 experts, top-2), converted by tools/checkpoint/convert.py
  to TP1 x EP2 and TP2 x EP2: the static engine gives Megatron's generate() tokens and log
  probs, the dynamic engine (requests arriving at different steps) transformers' greedy tokens
  for each prompt alone, on every rank;
- batch invariance of dropless MoE (float64, EP2, alltoall dispatcher): each request gets its
  alone tokens whether staggered among others or all at once, also when only rank 0 receives
  the requests (`request_source_rank`, as a server);
- the replicas of an expert-parallel group book the same tokens even when they would sample
  differently (other seeds here; last-bit logit differences in general);
- expert-parallel replicas given different requests stop with one error instead of hanging in
  the dispatch;
- an expert capacity (token dropping, which depends on the other requests of a step) is refused
  by the dynamic engine.
"""

import pytest
import torch

from megatron.core.inference.sampling_params import SamplingParams
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import engine_utils as eu
from tests.unit_tests.inference import hf_checkpoints as hc
from tests.unit_tests.inference.test_engine_hf import EOD, NEW, PROMPTS, _before_eod, _run_engines
from tests.unit_tests.inference.test_generation import _tokenize

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1ep2", "tp2ep2"])
def test_moe_engines_match_generate_and_mixtral(tmp_path_factory, tp):
    ckpt = hc.converted_checkpoint("mixtral", tp, 1, tmp_path_factory, ep=2)
    outs = run_distributed(
        _run_engines, world_size=2 * tp, tp=tp, ep=2, args=(ckpt, ()), timeout=600
    )
    out = outs[0]
    _texts, _segments, legacy_log_probs, legacy_tokens = out["legacy"]
    hf = hc.hf_model("mixtral")
    for i, prompt in enumerate(PROMPTS):
        ids = _tokenize(prompt)
        p = len(ids)
        expected = hc.hf_greedy(hf, ids, NEW)
        tokens, _text, log_probs, _prompt_log_probs = out["static"][i]
        assert tokens == _before_eod(legacy_tokens[i][p : p + NEW])
        assert tokens == _before_eod(expected)
        assert log_probs == pytest.approx(
            legacy_log_probs[i][p - 1 : p - 1 + len(tokens)], abs=1e-5
        )
        dynamic_tokens, _text, _log_probs, reason = out["dynamic"][i]
        assert dynamic_tokens == expected, (tp, i)
        assert reason == ("stop" if dynamic_tokens[-1] == EOD else "length")
    for rank_out in outs:
        assert rank_out["static"] == out["static"] and rank_out["dynamic"] == out["dynamic"]
        assert rank_out["free_blocks"] == 32


LENGTHS = [5, 17, 3, 11]
BUDGETS = [7, 4, 9, 5]
ARRIVALS = [0, 0, 1, 3]


def _ep2_invariance():
    _, config, controller = eu.build_model("mixtral", moe_token_dispatcher_type="alltoall")
    prompts = eu.prompts(LENGTHS)
    requests = [(p, eu.greedy(n, return_log_probs=True)) for p, n in zip(prompts, BUDGETS)]
    alone = [eu.solo(controller, config, p, sp) for p, sp in requests]
    staggered, steps = eu.run_schedule(eu.dynamic_engine(controller, config), requests, ARRIVALS)
    together, _ = eu.run_schedule(eu.dynamic_engine(controller, config), requests, [0] * 4)
    # As a server drives it: only rank 0 submits; each step starts with its broadcast.
    served = eu.dynamic_engine(controller, config, request_source_rank=0)
    rank = torch.distributed.get_rank()
    ids = [served.add_request(p, sp) for p, sp in requests] if rank == 0 else []
    served.step()
    while served.has_unfinished_requests():
        served.step()
    served_tokens = [served.get_request(str(i)).generated_tokens for i in range(len(requests))]
    # Replicas drawing different samples (here: other seeds) book the first replica's.
    sampled = eu.dynamic_engine(controller, config)
    hot = SamplingParams(temperature=3.0, num_tokens_to_generate=8, random_seed=rank)
    (sampled_request,) = sampled.generate([prompts[0]], hot)
    # Replicas given different requests: one error on every rank, before the dispatch.
    engine = eu.dynamic_engine(controller, config)
    engine.add_request(prompts[rank], eu.greedy(2))
    try:
        engine.step()
        mismatch = None
    except RuntimeError as exc:
        mismatch = str(exc)
    return {
        "alone": [(r.generated_tokens, r.generated_log_probs) for r in alone],
        "staggered": [(r.generated_tokens, r.generated_log_probs) for r in staggered],
        "together": [r.generated_tokens for r in together],
        "served": served_tokens,
        "sampled": sampled_request.generated_tokens,
        "steps": steps,
        "source_ids": ids,
        "mismatch": mismatch,
    }


def test_dropless_moe_batch_invariance_at_ep2():
    outs = run_distributed(_ep2_invariance, world_size=2, ep=2)
    out = outs[0]
    for i, ((alone_tokens, alone_lp), (tokens, lp)) in enumerate(
        zip(out["alone"], out["staggered"])
    ):
        assert len(tokens) == BUDGETS[i]
        assert tokens == alone_tokens, i
        assert lp == pytest.approx(alone_lp, abs=1e-10)
        assert out["together"][i] == tokens and out["served"][i] == tokens
    assert out["steps"] < sum(BUDGETS)
    assert outs[1]["source_ids"] == []
    for rank_out in outs:
        for key in ("alone", "staggered", "together", "served", "steps", "sampled"):
            assert rank_out[key] == out[key], key
    for rank, tokens in enumerate((5, 17)):
        assert outs[rank]["mismatch"] == (
            f"expert-parallel replicas scheduled different steps ({tokens} tokens here, 5 to 17 "
            "on the 2 ranks of the expert-parallel group, or other tokens): every replica of an "
            "expert-parallel group must be given the same requests (submit them on one rank with "
            "the engine's request_source_rank)"
        )


def _capacity_refused():
    _, config, controller = eu.build_model(
        "mixtral", moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0
    )
    try:
        eu.dynamic_engine(controller, config)
    except ValueError as exc:
        return str(exc)
    return None


def test_expert_capacity_is_refused_by_the_dynamic_engine():
    (message,) = run_distributed(_capacity_refused, world_size=1)
    assert message == (
        "dynamic batching: the MoE layers drop tokens beyond an expert capacity "
        "(--moe-expert-capacity-factor 1.0), chosen among all the requests of a step, so a "
        "request's output would depend on the others; serve this model without "
        "--inference-dynamic-batching (static batches), or train it dropless"
    )
