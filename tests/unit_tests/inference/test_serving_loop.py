"""The server's rank choreography without HTTP: global rank 0 runs the `ServingLoop` (engine steps
and legacy requests on one thread) as tools/run_text_generation_server.py does, the other rank
follows in `run_generation_worker_loop(model, engine)`, on converted GPT-2 checkpoints at TP2 and
PP2.

- Prompts submitted together (one request) and each alone give the same greedy tokens, and those
  are the tokens of Megatron's generate() loop run through the same serving loop (legacy path,
  one prompt at a time, and all prompts as one padded batch as --use-legacy-static-engine runs
  the OpenAI endpoints).
- A beam search (legacy path) submitted while engine requests run is served between steps and
  gives the answer it gives alone; the engine requests are not disturbed.
- TP2: a step that raises on every rank (a fault injected for a poisoned prompt) fails its
  request with the reason on rank 0, the other rank goes on, and the next request is answered
  as before.
- Rank 0's stop makes the follower return.
"""

import threading

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import hf_checkpoints as hc
from tests.unit_tests.inference.test_generation import _setup_model

pytest.importorskip("transformers")

PROMPTS = ["Hello world, this is", "A", "The cat sat on the mat and"]
NEW = 6
POISON = 31337  # a token id no other prompt has


class InjectedFault(RuntimeError):
    pass


def _raise_on_poison(_module, args):
    if (args[0] == POISON).any():
        raise InjectedFault("injected fault for a poisoned prompt")


def _greedy(n):
    from megatron.core.inference.sampling_params import SamplingParams

    return SamplingParams(top_k=1, num_tokens_to_generate=n, termination_id=-1)


def _serve(ckpt, poison):
    import torch

    from megatron.inference.generations import EngineGeneration
    from megatron.inference.inference_engine import get_dynamic_inference_engine
    from megatron.inference.serving import Serving
    from megatron.inference.text_generation import api
    from megatron.inference.text_generation.request import BEAM_SEARCH, GenerationSettings
    from megatron.inference.worker_loop import ServingLoop, run_generation_worker_loop
    from megatron.training.global_vars import get_args, get_tokenizer

    model = _setup_model(ckpt, ("--inference-dynamic-batching-block-size", "4"))
    if poison:
        model.register_forward_pre_hook(_raise_on_poison)
    engine = get_dynamic_inference_engine(
        get_args(), model, request_source_rank=0, isolate_failures=True
    )
    if torch.distributed.get_rank() != 0:
        run_generation_worker_loop(model, engine)
        return {"left": len(engine.requests), "free": engine.context.block_allocator.total_avail}

    tokenizer = get_tokenizer()
    ids = [tokenizer.tokenize(p) for p in PROMPTS]
    loop = ServingLoop(engine, model, heartbeat_s=0.05).start()
    out = {}

    def generate(prompts):
        generation = EngineGeneration(loop, tokenizer, prompts, [_greedy(NEW) for _ in prompts])
        generation.wait()
        return [c.generated if c.error is None else c.error for c in generation.choices]

    out["alone"] = [generate([p])[0] for p in ids]
    beam = GenerationSettings(mode=BEAM_SEARCH, tokens_to_generate=3, beam_size=2, num_return_gen=2)
    out["beam_alone"] = loop.run_legacy(api.prepare(["Hello world"], beam))
    # Engine requests and a beam search at once.
    beam_during = []
    thread = threading.Thread(
        target=lambda: beam_during.append(loop.run_legacy(api.prepare(["Hello world"], beam)))
    )
    thread.start()
    out["together"] = generate(ids)
    thread.join(timeout=300)
    out["beam_during"] = beam_during[0]
    # Megatron's generate() loop through the same serving loop.
    legacy = GenerationSettings(tokens_to_generate=NEW, top_k_sampling=1)
    out["legacy"] = [
        loop.run_legacy(api.prepare([p], legacy))[3][0][len(i) :] for p, i in zip(PROMPTS, ids)
    ]
    # --use-legacy-static-engine's generation of the OpenAI endpoints: one padded batch.
    legacy_batch = Serving(loop, tokenizer, legacy=True).generation(
        ids, [_greedy(NEW) for _ in ids], stops=()
    )
    legacy_batch.wait()
    out["legacy_batch"] = [c.completion()[1] for c in legacy_batch.choices]
    if poison:
        out["poisoned"] = generate([[POISON, 5, 6]])
        out["after"] = generate(ids[:1])
    out["free"] = engine.context.block_allocator.total_avail
    out["total"] = engine.context.num_blocks
    loop.stop()
    out["left"] = len(engine.requests)
    return out


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_serving_loop_batches_serves_legacy_and_survives_a_failed_step(layout, tmp_path_factory):
    tp, pp = layout
    ckpt = hc.converted_checkpoint("gpt2", tp, pp, tmp_path_factory)
    rank0, rank1 = run_distributed(_serve, world_size=2, tp=tp, pp=pp, args=(ckpt, tp == 2))
    assert rank0["together"] == rank0["alone"] == rank0["legacy"] == rank0["legacy_batch"]
    assert all(len(tokens) == NEW for tokens in rank0["alone"])
    assert rank0["beam_during"] == rank0["beam_alone"]
    assert len(rank0["beam_alone"][0]) == 2
    if tp == 2:
        (error,) = rank0["poisoned"]
        assert error == "InjectedFault: injected fault for a poisoned prompt", error
        assert rank0["after"] == rank0["alone"][:1]
    assert rank0["free"] == rank0["total"] and rank0["left"] == 0
    assert rank1["free"] == rank0["total"] and rank1["left"] == 0
