"""Tensor-, sequence- and pipeline-parallel BertModel against the unsharded model, on gloo ranks.

Every run loads the TP split of one full (TP=1) state dict, runs a padded batch forward and
backward with the pretraining loss (masked-LM mean over `loss_mask` + sentence-order cross
entropy), and returns the TP-gathered loss, logits, binary logits and gradients:
- TP=2 and TP=4, without and with sequence parallelism (the LM-head dense, the norms and the
  row-parallel biases then need finalize_model_grads' TP all-reduce), against TP=1;
- PP=2 x TP=2 with the padding mask rebuilt on every stage, activations and gradients exchanged
  by hand, and the tied word-embedding gradient all-reduced over the embedding group.
All runs use one 4-rank pool (TP=1 runs as 4 data-parallel replicas).
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

WORLD = 4
ATOL = 2e-5


def _loss(lm_loss, binary_logits, b):
    loss = (lm_loss * b['loss_mask']).sum() / b['loss_mask'].sum()
    return loss + torch.nn.functional.cross_entropy(binary_logits.float(), b['is_random'])


def _load_shard(model, full_sd, name_map=lambda n: n):
    from tests.unit_tests.models import bert_test_utils as U

    local = {
        name: U.split_full(full_sd[name_map(name)], name)
        for name, value in model.state_dict().items()
        if isinstance(value, torch.Tensor)
    }
    missing, unexpected = model.load_state_dict(local, strict=False)
    assert not unexpected and all(k.endswith('._extra_state') for k in missing)


def _tp_run(config_overrides, full_sd=None):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from tests.unit_tests.models import bert_test_utils as U

    model, config = U.build_bert(U.tiny_bert_kwargs(**config_overrides))
    if full_sd is not None:
        _load_shard(model, full_sd)
    model.train()
    b = U.batch()
    lm_loss, binary_logits = model(
        b['ids'], b['padding_mask'], tokentype_ids=b['types'], lm_labels=b['labels']
    )
    loss = _loss(lm_loss, binary_logits, b)
    loss.backward()
    if config.sequence_parallel:
        finalize_model_grads([model])
    model.eval()
    with torch.no_grad():
        logits, eval_binary = model(b['ids'], b['padding_mask'], tokentype_ids=b['types'])
    grads = {n: p.grad for n, p in model.named_parameters()}
    return dict(
        loss=loss.detach(),
        logits=gather_from_tensor_model_parallel_region(logits),
        binary_logits=eval_binary,
        params=U.gather_full(
            {n: p for n, p in model.state_dict().items() if isinstance(p, torch.Tensor)}
        ),
        grads=U.gather_full(grads),
    )


def _assert_same(out, ref):
    torch.testing.assert_close(out['loss'], ref['loss'], atol=ATOL, rtol=0)
    torch.testing.assert_close(out['binary_logits'], ref['binary_logits'], atol=ATOL, rtol=0)
    torch.testing.assert_close(out['logits'], ref['logits'], atol=ATOL, rtol=0)
    assert out['grads'].keys() == ref['grads'].keys()
    for name in ref['grads']:
        torch.testing.assert_close(
            out['grads'][name], ref['grads'][name], atol=ATOL, rtol=1e-4, msg=name
        )


@pytest.fixture(scope='module')
def reference():
    return run_distributed(_tp_run, WORLD, tp=1, args=({},))[0]


@pytest.mark.parametrize('tp,sp', [(2, False), (2, True), (4, True)])
def test_tensor_parallel_matches_unsharded(reference, tp, sp):
    outs = run_distributed(
        _tp_run, WORLD, tp=tp, args=({'sequence_parallel': sp}, reference['params'])
    )
    for out in outs:
        _assert_same(out, reference)


def _pipeline_run(full_sd):
    from megatron.core import parallel_state as ps
    from tests.unit_tests.models import bert_test_utils as U

    model, config = U.build_bert(U.tiny_bert_kwargs())
    first = ps.is_pipeline_first_stage()
    offset = ps.get_pipeline_model_parallel_rank() * (config.num_layers // 2)

    def global_name(name):
        parts = name.split('.')
        if name.startswith('encoder.layers.'):
            parts[2] = str(int(parts[2]) + offset)
        if name == 'output_layer.weight':
            return 'embedding.word_embeddings.weight'
        return '.'.join(parts)

    _load_shard(model, full_sd, global_name)
    model.train()
    b = U.batch()
    shape = (U.SEQ, U.BATCH, config.hidden_size)
    out = {'first': first, 'layer_numbers': [m.layer_number for m in model.encoder.layers]}
    if first:
        hidden = model(b['ids'], b['padding_mask'], tokentype_ids=b['types'])
        next_rank = ps.get_pipeline_model_parallel_next_rank()
        torch.distributed.send(hidden.detach().contiguous(), next_rank)
        grad = torch.empty(shape)
        torch.distributed.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        hidden.backward(grad)
    else:
        received = torch.empty(shape)
        torch.distributed.recv(received, ps.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(True)
        model.set_input_tensor(received)
        # Only the padding mask reaches the last stage (ids and types are read on the first).
        lm_loss, binary_logits = model(None, b['padding_mask'], lm_labels=b['labels'])
        loss = _loss(lm_loss, binary_logits, b)
        loss.backward()
        prev_rank = ps.get_pipeline_model_parallel_prev_rank()
        torch.distributed.send(received.grad.contiguous(), prev_rank)
        out['loss'] = loss.detach()
    if ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        torch.distributed.all_reduce(weight.grad, group=ps.get_embedding_group())
    out['grads'] = {
        global_name(n): g
        for n, g in U.gather_full({n: p.grad for n, p in model.named_parameters()}).items()
    }
    return out


def test_pipeline_two_stages_with_tp_matches_unsharded(reference):
    outs = run_distributed(_pipeline_run, WORLD, tp=2, pp=2, args=(reference['params'],))
    # tp fastest: ranks 0, 1 are stage 0, ranks 2, 3 stage 1.
    assert outs[0]['layer_numbers'] == [1] and outs[2]['layer_numbers'] == [2]
    for out in outs[2:]:
        torch.testing.assert_close(out['loss'], reference['loss'], atol=ATOL, rtol=0)
    for out in outs:
        for name, grad in out['grads'].items():
            torch.testing.assert_close(
                grad, reference['grads'][name], atol=ATOL, rtol=1e-4, msg=name
            )
    assert set(outs[0]['grads']) | set(outs[2]['grads']) == set(reference['grads'])
