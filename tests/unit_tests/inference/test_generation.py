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


def _setup_model(ckpt, arch, tp, pp, extra=()):
    """initialize_megatron + the server's model provider + load_checkpoint, in this rank."""
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    tool = _load_server_tool()
    destroy_global_vars()
    initialize_megatron(
        extra_args_provider=tool.add_text_generate_args,
        args_defaults={'no_load_rng': True, 'no_load_optim': True},
        args_list=hc.server_flags(arch, tp, pp) + ["--load", ckpt] + list(extra),
    )
    model = get_model(tool.model_provider, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    return model[0]


def _serve_requests(ckpt, arch, tp, pp, requests, extra=()):
    """Run each request as the server does: rank 0 passes it, the other ranks join empty."""
    from megatron.inference.text_generation import (
        beam_search_and_post_process,
        generate_and_post_process,
    )

    model = _setup_model(ckpt, arch, tp, pp, extra)
    rank0 = torch.distributed.get_rank() == 0
    results = []
    for req in requests:
        req = dict(req)
        beam = req.pop("beam", False)
        fn = beam_search_and_post_process if beam else generate_and_post_process
        out = fn(model, **req) if rank0 else fn(model)
        results.append(out)
    return results
