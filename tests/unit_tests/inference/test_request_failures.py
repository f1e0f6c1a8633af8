"""A failed request leaves every rank of a tensor-parallel server in step: rank 0 runs requests
as the HTTP server does (`worker_loop.serve`), rank 1 follows them as the worker loop does
(`worker_loop.follow_one_request`), on a TP2 checkpoint.

The failures: a request rank 0 refuses before any work (top_k not below the vocabulary), and a
generation loop that raises on every rank (a fault injected with a forward pre-hook that raises
for a batch of 3 prompts: any exception raised at the same point on every rank, as a
deterministic function of the broadcast request is). Each is reported on both ranks, and the next
request gives the answer it gave before.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.inference import hf_checkpoints as hc
from tests.unit_tests.inference.test_generation import _setup_model

pytest.importorskip("transformers")


class InjectedFault(RuntimeError):
    pass


def _raise_for_three_prompts(_module, args):
    if args[0].size(0) == 3:
        raise InjectedFault("injected fault for a batch of 3")


def _serve_and_follow(ckpt):
    import torch

    from megatron.inference.text_generation import api
    from megatron.inference.text_generation.request import GenerationSettings
    from megatron.inference.worker_loop import follow_one_request, serve

    model = _setup_model(ckpt)
    model.register_forward_pre_hook(_raise_for_three_prompts)
    greedy = GenerationSettings(tokens_to_generate=4, top_k_sampling=1)
    requests = [
        (["Hello world"], greedy),
        # Refused on rank 0 before anything is broadcast: the worker sees no request at all.
        (["Hello world"], GenerationSettings(tokens_to_generate=4, top_k_sampling=60000)),
        (["a", "b", "c"], greedy),  # raises inside the loop, on both ranks
        (["Hello world"], greedy),
    ]
    outcomes = []
    if torch.distributed.get_rank() == 0:
        for prompts, settings in requests:
            try:
                prepared = api.prepare(prompts, settings)
            except ValueError as exc:
                outcomes.append(('refused', str(exc)))
                continue
            try:
                outcomes.append(('ok', serve(model, prepared)[3]))
            except api.GenerationFailed as exc:
                outcomes.append(('failed', str(exc), exc.ranks))
    else:
        for _ in range(3):  # the refused request is never broadcast
            outcomes.append(follow_one_request(model))
    return outcomes


def test_failed_requests_leave_the_ranks_in_step(tmp_path_factory):
    ckpt = hc.converted_checkpoint("gpt2", 2, 1, tmp_path_factory)
    rank0, rank1 = run_distributed(_serve_and_follow, world_size=2, tp=2, args=(ckpt,))
    assert rank0[0][0] == 'ok' and rank0[3] == rank0[0], rank0
    assert rank0[1] == (
        'refused',
        'top_k must be 0 (off), 1 (greedy) or below the vocabulary size (50257), got 60000',
    )
    assert rank0[2] == (
        'failed',
        'generation failed: InjectedFault: injected fault for a batch of 3',
        [0, 1],
    )
    assert rank1 == ['ok', 'failed', 'ok']
