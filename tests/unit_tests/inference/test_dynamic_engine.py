"""The dynamic engine (continuous batching over a paged KV cache) on tiny float64 models:

- paged attention equals dense causal attention (random block tables, GQA, decode / chunk /
  whole prompt);
- batch invariance: requests arriving at different steps, with different prompt lengths and
  budgets, each get exactly their alone tokens, and the static engine's (dense KV cache) tokens;
- chunked prefill equals unchunked (logits within 1e-10, same tokens);
- a KV cache too small for everyone: requests wait, get preempted and recomputed, and still get
  their alone tokens; every block comes back;
- per-request sampling settings and seeds, stop conditions, log probs, cancellation, streaming,
  admission errors; PP2 with requests submitted on one rank only.
"""

import math

import pytest
import torch

from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.contexts.paged_attention import (
    kv_slots,
    paged_attention,
    write_to_paged_cache,
)
from megatron.core.inference.engines.dynamic_engine import QueueFullError
from megatron.core.inference.inference_request import Status
from megatron.core.inference.sampling_params import SamplingParams
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import engine_utils as eu


def _dense_causal(q, k, v, q_offset):
    """Reference: q [q, np, hn] at positions q_offset.., k / v [kv, np, hn]."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.size(-1))
    q_pos = torch.arange(q.size(0))[:, None] + q_offset
    scores = scores.masked_fill(torch.arange(k.size(0))[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense(block_size):
    g = torch.Generator().manual_seed(block_size)
    np_, ng, hn, num_blocks = 4, 2, 8, 40
    # (kv_len, q_len): decode, a chunk, a whole prompt.
    shapes = [(9, 1), (13, 5), (7, 7), (1, 1)]
    key_pool = torch.zeros(num_blocks, block_size, ng, hn, dtype=torch.float64)
    value_pool = torch.zeros_like(key_pool)
    free = torch.randperm(num_blocks, generator=g).tolist()
    queries, slots, requests, full = [], [], [], []
    for kv_len, q_len in shapes:
        blocks = [free.pop() for _ in range(-(-kv_len // block_size))]
        k = torch.randn(kv_len, ng, hn, generator=g, dtype=torch.float64)
        v = torch.randn(kv_len, ng, hn, generator=g, dtype=torch.float64)
        # The older keys are already cached; the q_len newest come with this step.
        for pos in range(kv_len - q_len):
            key_pool[blocks[pos // block_size], pos % block_size] = k[pos]
            value_pool[blocks[pos // block_size], pos % block_size] = v[pos]
        start = sum(len(x) for x in queries)
        q = torch.randn(q_len, np_, hn, generator=g, dtype=torch.float64)
        queries.append(q)
        slots += [
            blocks[p // block_size] * block_size + p % block_size
            for p in range(kv_len - q_len, kv_len)
        ]
        requests.append(
            (start, start + q_len, kv_len, kv_slots(torch.tensor(blocks), kv_len, block_size))
        )
        full.append((k, v))
    new_k = torch.cat([k[k.size(0) - q.size(0) :] for (k, _), q in zip(full, queries)])
    new_v = torch.cat([v[v.size(0) - q.size(0) :] for (_, v), q in zip(full, queries)])
    write_to_paged_cache(new_k[:, None], new_v[:, None], key_pool, value_pool, torch.tensor(slots))
    out = paged_attention(torch.cat(queries)[:, None], key_pool, value_pool, requests)
    for (start, end, kv_len, _), q, (k, v) in zip(requests, queries, full):
        ref = _dense_causal(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), kv_len - q.size(0)
        )
        assert (out[start:end, 0] - ref.reshape(q.size(0), -1)).abs().max() < 1e-12


# Prompt lengths, budgets and arrival steps of the mixed workload.
LENGTHS = [5, 17, 3, 11, 1, 8]
BUDGETS = [9, 4, 12, 6, 10, 7]
ARRIVALS = [0, 0, 1, 3, 4, 9]


def _invariance(arch):
    _, config, controller = eu.build_model(arch)
    prompts = eu.prompts(LENGTHS)
    requests = [(p, eu.greedy(n, return_log_probs=True)) for p, n in zip(prompts, BUDGETS)]
    alone = [eu.solo(controller, config, p, sp) for p, sp in requests]
    engine = eu.dynamic_engine(controller, config)
    staggered, steps = eu.run_schedule(engine, requests, ARRIVALS)
    # All at once, and with gaps of 3 steps between arrivals.
    together, _ = eu.run_schedule(eu.dynamic_engine(controller, config), requests, [0] * 6)
    spread, _ = eu.run_schedule(
        eu.dynamic_engine(controller, config), requests, [3 * i for i in range(6)]
    )
    # The static engine: dense KV cache, one request per batch.
    texts = [" ".join(map(str, p)) for p in prompts]
    static = [
        eu.static_engine(controller).generate([t], [eu.greedy(n)])[0].generated_tokens.tolist()
        for t, n in zip(texts, BUDGETS)
    ]
    return {
        "alone": [(r.generated_tokens, r.generated_log_probs) for r in alone],
        "staggered": [(r.generated_tokens, r.generated_log_probs) for r in staggered],
        "together": [r.generated_tokens for r in together],
        "spread": [r.generated_tokens for r in spread],
        "static": static,
        "steps": steps,
        "free": engine.context.block_allocator.total_avail,
    }


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_batch_invariance_and_paged_equals_dense(arch):
    (out,) = run_distributed(_invariance, world_size=1, args=(arch,))
    for i, ((alone_tokens, alone_lp), (tokens, lp)) in enumerate(
        zip(out["alone"], out["staggered"])
    ):
        assert len(tokens) == BUDGETS[i]
        assert tokens == alone_tokens, i
        assert lp == pytest.approx(alone_lp, abs=1e-10)
        assert out["together"][i] == tokens and out["spread"][i] == tokens
        assert out["static"][i] == tokens
    # Requests overlapped: far fewer steps than one after the other.
    assert out["steps"] < sum(BUDGETS)
    assert out["free"] == 64


def _chunked():
    _, config, controller = eu.build_model("llama")
    (prompt,) = eu.prompts([23])
    params = eu.greedy(5, return_log_probs=True)
    out = {}
    for name, max_tokens in (("whole", 64), ("chunk1", 1), ("chunk3", 3), ("chunk16", 16)):
        engine = eu.dynamic_engine(
            controller, config, max_tokens=max_tokens, max_requests=1, chunked=True
        )
        request = eu.run_schedule(engine, [(prompt, params)], [0])[0][0]
        out[name] = (
            request.generated_tokens,
            request.prompt_log_probs,
            request.generated_log_probs,
        )
    # A chunked prompt next to decoding requests (several chunks, interleaved with decodes).
    others = eu.prompts([4, 6], seed=5)
    engine = eu.dynamic_engine(controller, config, max_tokens=5, chunked=True)
    records, _ = eu.run_schedule(
        engine, [(others[0], eu.greedy(8)), (others[1], eu.greedy(8)), (prompt, params)], [0, 0, 2]
    )
    out["mixed"] = (
        records[2].generated_tokens,
        records[2].prompt_log_probs,
        records[2].generated_log_probs,
    )
    out["others_alone"] = [
        eu.solo(controller, config, p, eu.greedy(8)).generated_tokens for p in others
    ]
    out["others"] = [r.generated_tokens for r in records[:2]]
    try:
        eu.dynamic_engine(controller, config, max_tokens=8).add_request(prompt, params)
    except ValueError as exc:
        out["unchunked_error"] = str(exc)
    return out


def test_chunked_prefill_equals_unchunked():
    (out,) = run_distributed(_chunked, world_size=1)
    tokens, prompt_lp, lp = out["whole"]
    assert len(prompt_lp) == 22
    for name in ("chunk1", "chunk3", "chunk16", "mixed"):
        assert out[name][0] == tokens, name
        assert out[name][1] == pytest.approx(prompt_lp, abs=1e-10)
        assert out[name][2] == pytest.approx(lp, abs=1e-10)
    assert out["others"] == out["others_alone"]
    assert "enable chunked prefill" in out["unchunked_error"]


def _pressure():
    _, config, controller = eu.build_model("llama")
    prompts = eu.prompts([6, 9, 7, 13])
    requests = [(p, eu.greedy(14)) for p in prompts]
    alone = [eu.solo(controller, config, p, sp).generated_tokens for p, sp in requests]
    # 10 blocks of 4 tokens: each request needs 5-7 blocks by its end, so they cannot all run.
    engine = eu.dynamic_engine(controller, config, num_blocks=10)
    ids = [engine.add_request(p, sp) for p, sp in requests]
    engine.step()
    waiting_after_first_step = [engine.get_request(i).status for i in ids]
    while engine.has_unfinished_requests():
        engine.step()
    records = [engine.get_request(i) for i in ids]
    return {
        "alone": alone,
        "tokens": [r.generated_tokens for r in records],
        "preemptions": [r.num_preemptions for r in records],
        "first_status": waiting_after_first_step,
        "free": engine.context.block_allocator.total_avail,
    }


def test_block_exhaustion_waits_preempts_and_recomputes():
    (out,) = run_distributed(_pressure, world_size=1)
    assert out["tokens"] == out["alone"]
    assert sum(out["preemptions"]) > 0
    # 10 blocks hold the first prompts; the last one waits in the queue.
    assert out["first_status"][-1] == Status.WAITING_IN_QUEUE
    assert out["first_status"][0] == Status.ACTIVE_AND_GENERATING_TOKENS
    assert out["free"] == 10


def _sampling_stops_cancel():
    _, config, controller = eu.build_model("gpt2")
    prompts = eu.prompts([5, 8, 6, 3])
    hot = SamplingParams(
        temperature=1.5, num_tokens_to_generate=10, termination_id=-1, random_seed=11
    )
    nucleus = SamplingParams(top_p=0.8, num_tokens_to_generate=10, termination_id=-1, random_seed=5)
    requests = [(prompts[0], hot), (prompts[1], eu.greedy(10)), (prompts[2], nucleus)]
    engine = eu.dynamic_engine(controller, config)
    batched, _ = eu.run_schedule(engine, requests, [0, 1, 0])
    out = {
        "batched": [r.generated_tokens for r in batched],
        "alone": [eu.solo(controller, config, p, sp).generated_tokens for p, sp in requests],
        "other_seed": eu.solo(
            controller,
            config,
            prompts[0],
            SamplingParams(
                temperature=1.5, num_tokens_to_generate=10, termination_id=-1, random_seed=12
            ),
        ).generated_tokens,
    }
    # Stop conditions on the greedy continuation of prompt 3.
    ref = eu.solo(controller, config, prompts[3], eu.greedy(10)).generated_tokens
    j = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    out["ref"], out["j"] = ref, j
    stop = eu.solo(
        controller,
        config,
        prompts[3],
        SamplingParams(top_k=1, num_tokens_to_generate=10, termination_id=ref[j]),
    )
    out["stop"] = (stop.generated_tokens, stop.generated_text, stop.finish_reason, stop.status)
    seq = eu.solo(
        controller, config, prompts[3], eu.greedy(10, stop_token_ids=[ref[j - 1 : j + 1]])
    )
    out["seq"] = (seq.generated_tokens, seq.generated_text, seq.finish_reason)
    # Streaming and cancellation.
    engine = eu.dynamic_engine(controller, config)
    a = engine.add_request(prompts[0], eu.greedy(10))
    b = engine.add_request(prompts[1], eu.greedy(10))
    streamed = {a: [], b: []}
    for _ in range(3):
        for rid, toks in engine.step().new_tokens.items():
            streamed[rid] += toks
    held = engine.context.block_allocator.total_avail
    engine.cancel_request(a)
    result = engine.step()
    streamed[b] += result.new_tokens.get(b, [])
    assert a not in result.new_tokens
    out["cancel"] = (
        engine.get_request(a).status,
        engine.get_request(a).finish_reason,
        [r.request_id for r in result.finished_requests],
        held,
        engine.context.block_allocator.total_avail,
    )
    while engine.has_unfinished_requests():
        for rid, toks in engine.step().new_tokens.items():
            streamed[rid] += toks
    out["streamed"] = streamed[b] == engine.get_request(b).generated_tokens
    out["b"] = engine.get_request(b).generated_tokens
    out["b_alone"] = eu.solo(controller, config, prompts[1], eu.greedy(10)).generated_tokens
    out["free"] = engine.context.block_allocator.total_avail
    return out


def test_sampling_seeds_stops_streaming_and_cancel():
    (out,) = run_distributed(_sampling_stops_cancel, world_size=1)
    # Per-request settings and seeds: a sampled request draws the same tokens batched or alone.
    assert out["batched"] == out["alone"]
    assert out["other_seed"] != out["alone"][0]
    ref, j = out["ref"], out["j"]
    tokens, text, reason, status = out["stop"]
    # The termination id is kept in the tokens, left out of the text.
    assert tokens == ref[: j + 1] and reason == "stop" and status == Status.COMPLETED
    assert text == " ".join(map(str, ref[:j]))
    tokens, text, reason = out["seq"]
    assert tokens == ref[: j + 1] and text == " ".join(map(str, tokens)) and reason == "stop"
    status, reason, finished, held, freed = out["cancel"]
    assert status == Status.CANCELLED and reason == "cancelled" and finished == ["0"]
    assert freed > held
    assert out["streamed"] and out["b"] == out["b_alone"]
    assert out["free"] == 64


def _admission():
    _, config, controller = eu.build_model("gpt2")
    engine = eu.dynamic_engine(
        controller, config, num_blocks=8, max_tokens=16, max_requests=1, max_waiting_requests=2
    )
    errors = {}
    cases = {
        "empty": ([], eu.greedy(3)),
        "too_long": (list(range(64)), eu.greedy(3)),
        "budget": (list(range(10)), eu.greedy(60)),
        "blocks": (list(range(10)), eu.greedy(40)),
        "step": (list(range(20)), eu.greedy(3)),
        "params": ([1, 2], SamplingParams(top_k=2, top_p=0.5)),
        "temperature": ([1, 2], SamplingParams(temperature=0.0)),
    }
    for name, (prompt, params) in cases.items():
        try:
            engine.add_request(prompt, params)
        except ValueError as exc:
            errors[name] = str(exc)
    engine.add_request([1, 2], eu.greedy(2), request_id="x")
    try:
        engine.add_request([1, 2], eu.greedy(2), request_id="x")
    except ValueError as exc:
        errors["duplicate"] = str(exc)
    # One request takes the free row at the next step, two more may wait: the fourth is refused.
    engine.add_request([1, 2], eu.greedy(2))
    engine.add_request([1, 2], eu.greedy(2))
    try:
        engine.add_request([1, 2], eu.greedy(2))
    except QueueFullError as exc:
        errors["queue"] = str(exc)
    try:
        DynamicInferenceContext(
            config, max_sequence_length=64, buffer_size_gb=1e-6, block_size_tokens=16
        )
    except ValueError as exc:
        errors["kv_budget"] = str(exc)
    # num_tokens_to_generate None: up to the max sequence length.
    engine = eu.dynamic_engine(controller, config, num_blocks=32)
    (record,) = engine.generate(
        [[1, 2, 3]], SamplingParams(top_k=1, num_tokens_to_generate=None, termination_id=-1)
    )
    errors["default_budget"] = len(record.generated_tokens)
    return errors


def _queue_limit_mid_step():
    """The step thread has taken the inbox but not yet queued its requests (it does so without
    the lock): an add arriving then must still see them."""
    _, config, controller = eu.build_model("gpt2")
    engine = eu.dynamic_engine(
        controller, config, num_blocks=8, max_tokens=16, max_requests=1, max_waiting_requests=2
    )
    for _ in range(3):  # one row, two waiting
        engine.add_request([1, 2], eu.greedy(2))
    taken = engine._take_inbox()
    refused = None
    try:
        engine.add_request([1, 2], eu.greedy(2))
    except QueueFullError as exc:
        refused = str(exc)
    for entry in taken:  # what step() does next
        engine.waiting.append(engine._states[entry[1]])
    while engine.has_unfinished_requests():
        engine.step()
    return refused


def test_queue_limit_is_hard_while_a_step_takes_the_inbox():
    (refused,) = run_distributed(_queue_limit_mid_step, world_size=1)
    assert refused is not None and refused.startswith("2 requests are already waiting"), refused


def test_admission_errors_before_any_work():
    (errors,) = run_distributed(_admission, world_size=1)
    assert "prompt is empty" in errors["empty"]
    assert "max_sequence_length is 64" in errors["too_long"]
    assert "exceeds max_sequence_length (64)" in errors["budget"]
    assert "needs 13 KV blocks of 4 tokens, the cache has 8" in errors["blocks"]
    # docs/errors.md rows inference-prompt-too-long and inference-kv-cache-too-small.
    assert errors["step"] == (
        "prompt of 20 tokens exceeds the 16 tokens of one step "
        "(--inference-dynamic-batching-max-tokens): enable chunked prefill "
        "(--enable-chunked-prefill) or raise max_tokens"
    )
    assert errors["kv_budget"] == (
        "KV cache buffer of 1e-06 GiB holds no block of 16384 bytes (16 tokens); raise "
        "--inference-dynamic-batching-buffer-size-gb or lower the block size"
    )
    assert "top-p and top-k" in errors["params"]
    assert "temperature" in errors["temperature"]
    assert "already in use" in errors["duplicate"]
    assert "2 requests are already waiting" in errors["queue"]
    assert errors["default_budget"] == eu.MAX_SEQ - 3


def _pipeline_served_from_rank0():
    """PP2 as a server runs it: global rank 0 submits to an EngineLoop, the other rank follows
    (run_follower_loop) until rank 0 stops. Reference: each request alone, submitted on every
    rank."""
    import time

    from megatron.core.inference.engines.engine_loop import EngineLoop, run_follower_loop

    _, config, controller = eu.build_model("llama")
    prompts = eu.prompts([5, 9, 3])
    engine = eu.dynamic_engine(controller, config, request_source_rank=0)
    served = {}
    if torch.distributed.get_rank() == 0:
        loop = EngineLoop(engine, heartbeat_s=0.05).start()
        time.sleep(0.2)  # idle heartbeats first: the follower waits inside the broadcast
        streams = [loop.submit(p, eu.greedy(6)) for p in prompts]
        served = {s.request_id: s.result(timeout=120).generated_tokens for s in streams}
        loop.stop()
    else:
        run_follower_loop(engine)
    alone = [eu.solo(controller, config, p, eu.greedy(6)).generated_tokens for p in prompts]
    return served, {str(i): tokens for i, tokens in enumerate(alone)}, len(engine.requests)


def test_pipeline_parallel_requests_from_one_rank():
    outs = run_distributed(_pipeline_served_from_rank0, world_size=2, pp=2)
    (served, alone0, left0), (_, alone1, left1) = outs
    assert served == alone0 == alone1
    assert all(len(tokens) == 6 for tokens in served.values()) and len(served) == 3
    assert left0 == left1 == 0


def _engine_loop():
    """A server's use: 8 client threads submit at once to a background EngineLoop and read their
    streams; one client cancels mid-stream."""
    import threading

    from megatron.core.inference.engines.engine_loop import EngineLoop

    _, config, controller = eu.build_model("llama")
    prompts = eu.prompts([5, 9, 3, 12, 7, 4, 10, 6])
    alone = [eu.solo(controller, config, p, eu.greedy(8)).generated_tokens for p in prompts]
    engine = eu.dynamic_engine(controller, config, num_blocks=24)
    loop = EngineLoop(engine).start()
    streamed = [None] * len(prompts)

    def client(i):
        stream = loop.submit(prompts[i], eu.greedy(8 if i else 40))
        tokens = []
        for token in stream:
            tokens.append(token)
            if i == 0 and len(tokens) == 3:
                loop.cancel(stream.request_id)
        streamed[i] = (tokens, stream.result(timeout=60).generated_tokens, stream.result().status)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        loop.submit([1, 2], eu.greedy(100))
    except ValueError as exc:
        bad_request = str(exc)
    loop.stop()
    after_stop = None
    try:
        loop.submit([1, 2], eu.greedy(2))
    except RuntimeError as exc:
        after_stop = str(exc)
    return {
        "alone": alone,
        "streamed": streamed,
        "free": engine.context.block_allocator.total_avail,
        "bad_request": bad_request,
        "after_stop": after_stop,
        "leftover": len(engine.requests),
    }


def test_engine_loop_serves_concurrent_streams_and_cancel():
    (out,) = run_distributed(_engine_loop, world_size=1)
    for i, (tokens, final, status) in enumerate(out["streamed"]):
        if i == 0:
            # Cancelled after its third token: it stops early, its blocks come back.
            assert status == Status.CANCELLED and 3 <= len(final) < 40 and tokens == final
            continue
        assert status == Status.COMPLETED and tokens == final == out["alone"][i], i
    assert out["free"] == 24 and out["leftover"] == 0
    assert "exceeds max_sequence_length" in out["bad_request"]
    assert "not running" in out["after_stop"]
