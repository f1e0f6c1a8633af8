"""megatron.core.inference's core_r0.8.0 API: Counter, Scheduler, the add_attributes hooks, the
sampler (r0.8's assertion messages and bounds), and the static MCoreEngine's fixes of r0.8's
quirks (a second generate() returns only its own requests; every request keeps its own settings;
log probs of the generated tokens, not an empty slice)."""

import pytest
import torch

from megatron.core.inference.common_inference_params import CommonInferenceParams
from megatron.core.inference.inference_request import Status
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
    InferenceWrapperConfig,
)
from megatron.core.inference.sampling import sample, sample_rows
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.scheduler import Scheduler
from megatron.core.inference.utils import Counter
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import engine_utils as eu


def test_counter():
    counter = Counter()
    assert next(counter) == 0 and next(counter) == 1
    counter.reset()
    assert next(counter) == 0


def test_add_attributes():
    params = CommonInferenceParams()
    assert params is not None and isinstance(params, SamplingParams)
    params.add_attributes({"min_length": 45})
    assert params.min_length == 45
    cfg = InferenceWrapperConfig(
        hidden_size=10,
        params_dtype=torch.float,
        inference_batch_times_seqlen_threshold=10,
        padded_vocab_size=10,
    )
    cfg.add_attributes({"abc": 45})
    assert cfg.abc == 45


def test_scheduler():
    scheduler = Scheduler(max_batch_size=4)
    params = CommonInferenceParams()
    for i in range(4):
        scheduler.add_request("prompt", [1, 2, 3], params)
        assert len(scheduler.active_request_pool) == i + 1
    scheduler.add_request("prompt", [1, 2, 3], params)
    assert list(scheduler.waiting_request_pool) == ["4"]
    assert scheduler.waiting_request_pool["4"].status == Status.WAITING_IN_QUEUE

    done = {}
    for request_id, request in scheduler.active_request_pool.items():
        if int(request_id) % 2 == 0:
            request.status = Status.COMPLETED
            done[request_id] = request
    scheduler.update_requests_pools(done)
    assert (len(scheduler.active_request_pool), len(scheduler.waiting_request_pool)) == (3, 0)
    assert len(scheduler.completed_request_pool) == 2
    # The waiting request was promoted, after the surviving active ones (FIFO).
    assert list(scheduler.active_request_pool) == ["1", "3", "4"]

    for request in scheduler.active_request_pool.values():
        request.status = Status.COMPLETED
    scheduler.update_requests_pools(dict(scheduler.active_request_pool))
    assert len(scheduler.completed_request_pool) == 5 and not scheduler.have_requests_pending()


def test_sampler_messages_and_bounds():
    vocab = 100
    logits = torch.arange(vocab, dtype=torch.float).repeat(4, 1)
    with pytest.raises(AssertionError, match="Cannot have top-p and top-k both greater than zero"):
        sample(logits, top_k=2, top_p=0.4)
    with pytest.raises(AssertionError, match=r"top-p should be in \(0,1\]"):
        sample(logits, top_p=1.4)
    with pytest.raises(AssertionError, match="top-k is larger than logit size."):
        sample(logits, top_k=vocab + 10)
    with pytest.raises(AssertionError, match="top-k is larger than vocab size."):
        sample(logits, top_k=vocab, vocab_size=vocab)
    assert (sample(logits, top_k=1) == vocab - 1).all()
    assert (sample(logits, top_k=2) >= vocab - 2).all()
    # top-p keeps the tokens ranked before the cumulative mass first exceeds p.
    for top_p, temperature in ((0.3, 1.0), (0.95, 2.0)):
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        sorted_probs = probs.sort(descending=True).values
        kept = int((sorted_probs.cumsum(0) <= top_p).sum()) + 1
        lowest_kept = vocab - kept
        for _ in range(5):
            assert (sample(logits, top_p=top_p, temperature=temperature) >= lowest_kept).all()
    # Clamped to the real vocabulary, as Megatron's sampler.
    assert (sample(logits, top_k=1, vocab_size=50) == 49).all()


def test_sample_rows_generators_make_rows_independent():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0.7), SamplingParams(top_p=0.9)]

    def gens(seeds):
        return [torch.Generator().manual_seed(s) for s in seeds]

    batched = sample_rows(logits, params, generators=gens([1, 2, 3]))
    assert batched[0] == logits[0].argmax()
    # Each row's sample depends only on its own generator, not on the other rows.
    alone = sample_rows(logits[2:], params[2:], generators=gens([3]))
    assert alone[0] == batched[2]
    draws = {int(sample_rows(logits[1:2], params[1:2], generators=gens([s]))[0]) for s in range(20)}
    assert len(draws) > 1
    with pytest.raises(ValueError, match="top-p and top-k"):
        SamplingParams(top_k=3, top_p=0.5).validate()


def _static_behaviours():
    _, _, controller = eu.build_model("llama")
    engine = eu.static_engine(controller, max_batch_size=2)
    texts = [" ".join(map(str, p)) for p in eu.prompts([5, 9, 3])]
    first = engine.generate(texts, eu.greedy(6, return_log_probs=True))
    second = engine.generate(texts[:1], eu.greedy(6))
    hot = SamplingParams(temperature=3.0, num_tokens_to_generate=2, termination_id=-1)
    mixed = engine.generate(texts[:2], [hot, eu.greedy(7)])
    ref = engine.generate(texts[1:2], eu.greedy(7))
    tokens = first[0].generated_tokens.tolist()
    # A termination id that first appears at position j >= 1, and a stop sequence.
    j = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    stop = tokens[j - 1 : j + 1]
    stopped = engine.generate(texts[:1], eu.greedy(6, stop_token_ids=[stop]))
    eod_stop = engine.generate(
        texts[:1], SamplingParams(top_k=1, num_tokens_to_generate=6, termination_id=tokens[j])
    )
    full = controller.inference_wrapped_model.model(
        torch.tensor([first[0].prompt_tokens + first[0].generated_tokens.tolist()]), None, None
    )[0]
    return {
        "first": [
            (
                r.request_id,
                r.status,
                r.generated_tokens.tolist(),
                r.generated_text,
                r.generated_log_probs,
                r.prompt_log_probs,
            )
            for r in first
        ],
        "second": [r.request_id for r in second],
        "second_tokens": second[0].generated_tokens.tolist(),
        "mixed": [r.generated_tokens.tolist() for r in mixed],
        "ref": ref[0].generated_tokens.tolist(),
        "stopped": stopped[0].generated_tokens.tolist(),
        "eod_stop": eod_stop[0].generated_tokens.tolist(),
        "j": j,
        "full_log_probs": torch.log_softmax(full, dim=-1),
        "prompt_len": len(first[0].prompt_tokens),
        "prompt_tokens": first[0].prompt_tokens,
    }


def test_static_engine_fixes_r08_quirks():
    (out,) = run_distributed(_static_behaviours, world_size=1)
    ids = [r[0] for r in out["first"]]
    assert ids == ["0", "1", "2"] and all(r[1] == Status.COMPLETED for r in out["first"])
    # A second generate() returns its own request only (r0.8 returned the first call's too).
    assert out["second"] == ["3"] and out["second_tokens"] == out["first"][0][2]
    # Each request keeps its own settings in a shared batch (r0.8 used the first request's).
    assert len(out["mixed"][0]) == 2 and out["mixed"][1] == out["ref"]
    # Stop sequence: kept; termination id: not returned (r0.8).
    tokens = out["first"][0][2]
    j = out["j"]
    assert out["stopped"] == tokens[: j + 1] and out["eod_stop"] == tokens[:j]
    # Log probs: one per generated token, equal to a full forward's (later megatron-core's slice;
    # r0.8's was empty), and the prompt's apart.
    _, _, tokens, text, log_probs, prompt_log_probs = out["first"][0]
    assert text == " ".join(map(str, tokens))
    full, p = out["full_log_probs"], out["prompt_len"]
    expect = [full[p - 1 + i, t].item() for i, t in enumerate(tokens)]
    assert log_probs == pytest.approx(expect, abs=1e-10)
    tokens_all = out["prompt_tokens"]
    assert prompt_log_probs == pytest.approx(
        [full[k, tokens_all[k + 1]].item() for k in range(p - 1)], abs=1e-10
    )
