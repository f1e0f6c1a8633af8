"""How the ranks of a text generation server run requests together.

Global rank 0 serves HTTP. For each accepted request it takes the lock (one generation at a
time), broadcasts a choice over the default group (`GENERATE_NUM` = 0 for sampling, `BEAM_NUM`
= 1 for beam search: Megatron's protocol), and runs the request's collective path
(`text_generation.api.run_prepared`). Every other rank waits in `run_generation_worker_loop` for
that choice and joins the same path.

A failed request never stops a rank: the request path ends with every rank agreeing on whether
any of them failed, and then raises the same exception on all of them (`RequestRefused`,
`GenerationFailed`), so the loop reports it and waits for the next choice, in step with rank 0.
This covers every failure that is a function of the request (the same on every rank: the ranks
hold identical settings, tokens and, within a stage, identical logits). A rank that fails alone
in the middle of a collective (a device fault) leaves its peers waiting in that collective; only
tearing the process group down would free them, which this loop does not attempt.
"""

import threading

import torch

from megatron.core.utils import get_current_device
from megatron.inference.text_generation.api import (
    GenerationFailed,
    RequestRefused,
    run_prepared,
    run_request,
)
from megatron.inference.text_generation.request import BEAM_SEARCH

GENERATE_NUM = 0
BEAM_NUM = 1
#: One generation at a time: the other ranks follow rank 0's broadcasts in order.
lock = threading.Lock()


def _send_choice(choice):
    tensor = torch.tensor([choice], dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(tensor, 0)


def send_do_generate():
    """Tell the waiting ranks to join a sampling generation."""
    _send_choice(GENERATE_NUM)


def send_do_beam_search():
    """Tell the waiting ranks to join a beam search."""
    _send_choice(BEAM_NUM)


def serve(model, prepared, step_callback=None):
    """Rank 0: run a prepared request on every rank (under the lock).

    Returns:
        The post-processed result (see `run_prepared`).

    Raises:
        GenerationFailed: a loop raised on some rank (all ranks are back in step).
    """
    with lock:
        _send_choice(BEAM_NUM if prepared.settings.mode == BEAM_SEARCH else GENERATE_NUM)
        return run_prepared(model, prepared, step_callback=step_callback)


def follow_one_request(model):
    """Every rank but the server's: wait for rank 0's next choice and join that request.

    Whatever the request does (refused, or a loop that raised on any rank), this rank leaves it
    together with the others, ready for the next one.

    Returns:
        'ok', 'refused', 'failed', or 'ignored' (a choice that is no request).
    """
    choice = torch.tensor([-1], dtype=torch.long, device=get_current_device())
    torch.distributed.broadcast(choice, 0)
    if choice.item() not in (GENERATE_NUM, BEAM_NUM):
        return 'ignored'
    try:
        # One path for both choices: the mode travels with the request's settings.
        run_request(model)
    except RequestRefused:
        return 'refused'
    except GenerationFailed as exc:
        print(
            f'rank {torch.distributed.get_rank()}: request failed ({exc}); waiting for the next '
            f'one',
            flush=True,
        )
        return 'failed'
    return 'ok'


def run_generation_worker_loop(model):
    """Loop of every rank but the server's: follow rank 0's requests, forever."""
    while True:
        follow_one_request(model)
