"""BertModel and T5Model run on process groups passed to them, not on the global ones.

As in test_gpt_model_process_groups.py: four gloo ranks are initialised with the global
tensor-parallel size 1, then each rank builds the model with `pg_collection.tp` = a new group of
ranks [0, 1] or [2, 3] (tensor parallel 2 inside each pair) and compares it with the unsharded
(TP=1) model of the same seed: initial weights, the per-token losses and every gradient after
`finalize_model_grads(pg_collection=...)`, with and without sequence parallelism. A module that
read the global TP group (size 1) would build, split or reduce the wrong shapes: BERT's output
layer and pooler, T5's LM head, the embeddings and the transformer blocks of both.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

WORLD = 4
PAIRS = ([0, 1], [2, 3])
ATOL = 2e-5


def _partition_dim(name):
    """TP split dimension of a BERT / T5 parameter (None = replicated).

    GPT's table plus T5's cross attention (column-parallel q / kv, row-parallel projection).
    """
    from megatron.core.models.gpt.hf_weight_mapping import tensor_parallel_partition_dim

    if name.endswith(("cross_attention.linear_q.weight", "cross_attention.linear_q.bias")):
        return 0
    if name.endswith(("cross_attention.linear_kv.weight", "cross_attention.linear_kv.bias")):
        return 0
    if name.endswith("cross_attention.linear_proj.weight"):
        return 1
    return tensor_parallel_partition_dim(name)


def _gather(named, group):
    """Full (TP=1) `{name: tensor}` from the TP shards held by the ranks of `group` (no gated
    MLP here, so the shards simply concatenate)."""
    full = {}
    for name in sorted(named):
        t = named[name].detach().contiguous()
        dim = _partition_dim(name)
        if dim is None:
            full[name] = t.clone()
        else:
            pieces = [torch.empty_like(t) for _ in range(group.size())]
            torch.distributed.all_gather(pieces, t, group=group)
            full[name] = torch.cat(pieces, dim=dim)
    return full


def _grads(model):
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def _build_bert(tp, sequence_parallel, pg_collection):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.models import bert_test_utils as B

    config = TransformerConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        **B.tiny_bert_kwargs(),
    )
    model = BertModel(
        config=config,
        num_tokentypes=2,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=B.VOCAB,
        max_sequence_length=B.MAX_POS,
        share_embeddings_and_output_weights=True,
        add_binary_head=True,
        pg_collection=pg_collection,
    )
    return model, config


def _bert_loss(model):
    from tests.unit_tests.models import bert_test_utils as B

    batch = B.batch()
    loss, binary_logits = model(
        batch['ids'], batch['padding_mask'], tokentype_ids=batch['types'], lm_labels=batch['labels']
    )
    # The binary logits bring the pooler (and its sequence-parallel gather) into the gradients.
    return loss, loss.mean() + binary_logits.sum()


def _build_t5(tp, sequence_parallel, pg_collection):
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_local_block_spec,
        get_t5_encoder_with_local_block_spec,
    )
    from tests.unit_tests.models import t5_test_utils as T

    config = T.tiny_config(
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1
    )
    model = T5Model(
        config,
        get_t5_encoder_with_local_block_spec(2),
        get_t5_decoder_with_local_block_spec(2),
        vocab_size=T.VOCAB,
        max_sequence_length=T.MAX_POS,
        share_embeddings_and_output_weights=True,
        pg_collection=pg_collection,
    )
    return model, config


def _t5_loss(model):
    from tests.unit_tests.models import t5_test_utils as T

    batch = T.random_batch(batch_size=2, seed=7)
    loss = model(*T.model_inputs(batch), lm_labels=batch['labels'])
    return loss, loss.mean()


_MODELS = {"bert": (_build_bert, _bert_loss), "t5": (_build_t5, _t5_loss)}


def _run(model_name, sequence_parallel):
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    rank = torch.distributed.get_rank()
    # Every rank creates both groups, in the same order.
    groups = [torch.distributed.new_group(ranks) for ranks in PAIRS]
    tp_group = groups[rank // 2]
    build_fn, loss_fn = _MODELS[model_name]

    def build(tp, pg_collection):
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        return build_fn(tp, sequence_parallel, pg_collection)

    def loss_and_grads(model, pg_collection=None):
        model.train()
        loss, objective = loss_fn(model)
        objective.backward()
        finalize_model_grads([model], pg_collection=pg_collection)
        return loss.detach()

    ref_model, _ = build(1, None)
    ref_params = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref_loss = loss_and_grads(ref_model)

    model, _ = build(2, ProcessGroupCollection(tp=tp_group))
    assert model.pg_collection.tp is tp_group
    assert model.output_layer.tp_group is tp_group
    params = _gather(dict(model.named_parameters()), tp_group)
    loss = loss_and_grads(model, ProcessGroupCollection(tp=tp_group))
    return {
        "ref_params": ref_params,
        "params": params,
        "ref_loss": ref_loss,
        "loss": loss,
        "ref_grads": _grads(ref_model),
        "grads": _gather(_grads(model), tp_group),
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("model_name", ["bert", "t5"])
def test_on_explicit_tp_group(model_name, sequence_parallel):
    outs = run_distributed(_run, world_size=WORLD, tp=1, args=(model_name, sequence_parallel))
    for out in outs:
        assert sorted(out["params"]) == sorted(out["ref_params"])
        for name, ref in out["ref_params"].items():
            assert torch.equal(out["params"][name], ref), name
        torch.testing.assert_close(out["loss"], out["ref_loss"], atol=ATOL, rtol=1e-5)
        for name, ref in out["ref_grads"].items():
            torch.testing.assert_close(out["grads"][name], ref, atol=ATOL, rtol=1e-5, msg=name)
