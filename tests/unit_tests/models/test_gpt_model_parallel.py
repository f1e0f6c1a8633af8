"""Tensor-parallel, sequence-parallel, recompute and dropout parity of GPTModel on gloo ranks.

Every run returns the full (TP-gathered) parameters, gradients, logits and per-token losses, which
are compared with the TP=1 run of the same model:
- GPT-2 architecture with `use_cpu_initialization`: the same seed gives TP=k weights that are
  exact slices of the TP=1 weights, and the same outputs and gradients;
- Llama architecture (RoPE, RMSNorm, SwiGLU, GQA with several query groups per rank, untied
  output layer): TP=2/4 ranks load the TP split of the TP=1 state dict (QKV split by query group,
  fc1 split per gate/up half), with and without sequence parallelism;
- full (uniform, block) and selective recomputation give the gradients of no recomputation, with
  dropout on (the checkpoint replays the RNG streams);
- hidden dropout is drawn from the default generator, identical on all TP ranks, so TP=2/4 with
  hidden dropout equals TP=1 with hidden dropout.
All runs use one 4-rank pool (TP=1 runs as 4 data-parallel replicas).
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

WORLD = 4
ATOL = 2e-5


def _run(arch, config_overrides, full_sd=None, reseed=None, sp_reduce=True):
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.hf_weight_mapping import split_state_dict_for_tensor_parallel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.unit_tests.models import gpt_test_utils as U

    kwargs = (U.gpt2_like_kwargs if arch == "gpt2" else U.llama_like_kwargs)(**config_overrides)
    model, config = U.build_gpt(kwargs, arch=arch)
    snapshot = U.config_snapshot(config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if full_sd is not None:
        shard = split_state_dict_for_tensor_parallel(full_sd, config, tp)[tp_rank]
        missing, unexpected = model.load_state_dict(shard, strict=False)
        assert not unexpected and all(k.endswith("._extra_state") for k in missing)
    model.train()

    tokens, labels = U.batch()
    position_ids = torch.arange(U.SEQ).unsqueeze(0).expand(U.BATCH, -1)
    if reseed is not None:
        torch.manual_seed(reseed)
        model_parallel_cuda_manual_seed(reseed)
    loss = model(tokens, position_ids, None, labels=labels)
    loss.mean().backward()

    out = {}
    if config.sequence_parallel:
        norm_params = [n for n, p in model.named_parameters() if "layernorm" in n]
        out["norms_marked"] = all(
            getattr(p, "sequence_parallel", False)
            for n, p in model.named_parameters()
            if n in norm_params
        )
        out["norm_grads_before_reduce"] = U.gather_full(
            {n: p.grad for n, p in model.named_parameters() if n in norm_params}, config
        )
        if sp_reduce:
            finalize_model_grads([model])

    model.eval()
    with torch.no_grad():
        logits = model(tokens, position_ids, None)
    out.update(
        loss=loss.detach(),
        logits=U.gather_logits(logits),
        params=U.gather_full(
            {n: p for n, p in model.state_dict().items() if isinstance(p, torch.Tensor)}, config
        ),
        grads=U.gather_full(U.grads_of(model), config),
        config_unchanged=U.config_snapshot(config) == snapshot,
    )
    return out


def _assert_same(out, ref, params=True):
    torch.testing.assert_close(out["loss"], ref["loss"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["logits"], ref["logits"], atol=ATOL, rtol=0)
    if params:
        assert out["params"].keys() == ref["params"].keys()
        for name in ref["params"]:
            torch.testing.assert_close(
                out["params"][name], ref["params"][name], atol=0, rtol=0, msg=name
            )
    assert out["grads"].keys() == ref["grads"].keys()
    for name in ref["grads"]:
        torch.testing.assert_close(
            out["grads"][name], ref["grads"][name], atol=ATOL, rtol=1e-4, msg=name
        )


def _all_ranks_agree(outs):
    for out in outs[1:]:
        _assert_same(out, outs[0])


def test_tensor_parallel_same_seed_gpt2():
    ref = run_distributed(_run, WORLD, tp=1, args=("gpt2", {}))
    _all_ranks_agree(ref)
    assert ref[0]["config_unchanged"]
    # With sequence parallelism the row-parallel biases (added on sequence shards) and the norms
    # need the TP all-reduce of finalize_model_grads too.
    for tp, sp in ((2, False), (4, False), (4, True)):
        outs = run_distributed(_run, WORLD, tp=tp, args=("gpt2", {"sequence_parallel": sp}))
        for out in outs:
            assert out["config_unchanged"]
            _assert_same(out, ref[0])


def test_tensor_and_sequence_parallel_llama_gqa():
    ref = run_distributed(_run, WORLD, tp=1, args=("llama", {}))[0]
    full_sd = ref["params"]
    for tp, sp in ((2, False), (2, True), (4, True)):
        outs = run_distributed(
            _run, WORLD, tp=tp, args=("llama", {"sequence_parallel": sp}, full_sd)
        )
        for out in outs:
            assert out["config_unchanged"]
            _assert_same(out, ref)
        if sp:
            assert outs[0]["norms_marked"]


def test_sequence_parallel_needs_layernorm_grad_allreduce():
    """Without finalize_model_grads' TP all-reduce the SP norm gradients are partial sums."""
    ref = run_distributed(_run, WORLD, tp=1, args=("llama", {}))[0]
    outs = run_distributed(
        _run,
        WORLD,
        tp=2,
        args=("llama", {"sequence_parallel": True}, ref["params"]),
        kwargs={"sp_reduce": False},
    )
    before = outs[0]["norm_grads_before_reduce"]
    assert before, "no norm parameters found"
    for name, grad in before.items():
        assert not torch.allclose(grad, ref["grads"][name], atol=1e-6), name
    # Summing the two TP ranks' partial gradients (what the reduction does) gives the full one.
    for name in before:
        summed = (
            outs[0]["norm_grads_before_reduce"][name] + outs[1]["norm_grads_before_reduce"][name]
        )
        torch.testing.assert_close(summed, ref["grads"][name], atol=ATOL, rtol=1e-4, msg=name)


def _dropout_cases():
    return {"hidden_dropout": 0.2, "attention_dropout": 0.0}


def test_hidden_dropout_matches_across_tensor_parallel_sizes():
    """Hidden dropout uses the default generator (same seed on every TP rank), so its masks do not
    depend on the TP size."""
    ref = run_distributed(
        _run, WORLD, tp=1, args=("gpt2", _dropout_cases()), kwargs={"reseed": 99}
    )[0]
    no_dropout = run_distributed(_run, WORLD, tp=1, args=("gpt2", {}), kwargs={"reseed": 99})[0]
    assert not torch.allclose(ref["loss"], no_dropout["loss"]), "dropout had no effect"
    for tp in (2, 4):
        out = run_distributed(
            _run, WORLD, tp=tp, args=("gpt2", _dropout_cases()), kwargs={"reseed": 99}
        )[0]
        _assert_same(out, ref)


RECOMPUTE = {
    "selective": {"recompute_granularity": "selective"},
    "full_uniform_1": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full_uniform_2": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 2,
    },
    "full_block_1": {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 1,
    },
}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_gives_same_gradients(sequence_parallel):
    base = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "sequence_parallel": sequence_parallel}
    ref = run_distributed(_run, WORLD, tp=2, args=("gpt2", base), kwargs={"reseed": 5})
    for name, extra in RECOMPUTE.items():
        outs = run_distributed(
            _run, WORLD, tp=2, args=("gpt2", {**base, **extra}), kwargs={"reseed": 5}
        )
        for out, r in zip(outs, ref):
            _assert_same(out, r)
