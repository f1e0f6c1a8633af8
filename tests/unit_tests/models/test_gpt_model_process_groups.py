"""A GPTModel runs on process groups passed to it, not on the global ones.

Four gloo ranks are initialised with the global tensor-parallel size 1 (four data-parallel
replicas). Each rank then builds a GPTModel with `pg_collection.tp` = a new group of ranks [0, 1]
or [2, 3] (tensor parallel 2 inside each pair) and compares it with the unsharded (TP=1) model of
the same seed: initial weights (CPU initialisation cuts the master weight by the rank in the given
group), the per-token losses, and every gradient after `finalize_model_grads(pg_collection=...)`,
with and without sequence parallelism. A module that read the global TP group would see size 1
and build, split or reduce the wrong shapes.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

WORLD = 4
PAIRS = ([0, 1], [2, 3])
ATOL = 2e-5


def _gather(named, config, group):
    """Full (TP=1) `{name: tensor}` from the TP shards held by the ranks of `group`."""
    from megatron.core.models.gpt.hf_weight_mapping import (
        merge_tensor_parallel_state_dicts,
        tensor_parallel_partition_dim,
    )

    tp = group.size()
    shards = [dict() for _ in range(tp)]
    for name in sorted(named):
        t = named[name].detach().contiguous()
        if tensor_parallel_partition_dim(name) is None:
            pieces = [t] * tp
        else:
            pieces = [torch.empty_like(t) for _ in range(tp)]
            torch.distributed.all_gather(pieces, t, group=group)
        for r in range(tp):
            shards[r][name] = pieces[r]
    return merge_tensor_parallel_state_dicts(shards, config)


def _grads(model):
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def _loss_and_grads(model, config, pg_collection=None):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from tests.unit_tests.models import gpt_test_utils as U

    tokens, labels = U.batch()
    position_ids = torch.arange(U.SEQ).unsqueeze(0).expand(U.BATCH, -1)
    model.train()
    loss = model(tokens, position_ids, None, labels=labels)  # [b, s]
    loss.mean().backward()
    finalize_model_grads([model], pg_collection=pg_collection)
    return loss.detach()


def _run(sequence_parallel):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.models import gpt_test_utils as U

    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    rank = torch.distributed.get_rank()
    # Every rank creates both groups, in the same order.
    groups = [torch.distributed.new_group(ranks) for ranks in PAIRS]
    tp_group = groups[rank // 2]

    def build(tp, pg_collection):
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        config = TransformerConfig(
            tensor_model_parallel_size=tp,
            sequence_parallel=sequence_parallel and tp > 1,
            **U.gpt2_like_kwargs(),
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=U.VOCAB,
            max_sequence_length=U.SEQ * 2,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=True,
            pg_collection=pg_collection,
        )
        return model, config

    ref_model, ref_config = build(1, None)
    ref_params = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_loss = _loss_and_grads(ref_model, ref_config)

    model, config = build(2, ProcessGroupCollection(tp=tp_group))
    assert model.pg_collection.tp is tp_group
    assert model.decoder.layers[0].self_attention.pg_collection.tp is tp_group
    params = _gather(dict(model.named_parameters()), config, tp_group)
    loss = _loss_and_grads(model, config, ProcessGroupCollection(tp=tp_group))
    return {
        "ref_params": ref_params,
        "params": params,
        "ref_loss": ref_loss,
        "loss": loss,
        "ref_grads": _grads(ref_model),
        "grads": _gather(_grads(model), config, tp_group),
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_on_explicit_tp_group(sequence_parallel):
    outs = run_distributed(_run, world_size=WORLD, tp=1, args=(sequence_parallel,))
    for out in outs:
        assert sorted(out["params"]) == sorted(out["ref_params"])
        for name, ref in out["ref_params"].items():
            assert torch.equal(out["params"][name], ref), name
        torch.testing.assert_close(out["loss"], out["ref_loss"], atol=ATOL, rtol=1e-5)
        for name, ref in out["ref_grads"].items():
            torch.testing.assert_close(out["grads"][name], ref, atol=ATOL, rtol=1e-5, msg=name)
