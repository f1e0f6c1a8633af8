"""A tiny T5 split into encoder and decoder pipeline stages reproduces the single-stage run.

The reference is the whole T5Model on one rank, run by forward_backward_no_pipelining. Each layout
builds its stage as training.get_model does for ModelType.encoder_and_decoder (pre_process on
stage 0 and the split rank, post_process on the last encoder stage and the last stage,
add_encoder / add_decoder by the split rank), loads the reference weights by *global* name (layer
numbers from the model's own stage offsets, TP slices along `partition_dim`) and runs the 1F1B
schedule with finalize_model_grads. Every stage must give the reference's per-micro-batch losses
and every parameter's gradient (gathered over TP): this needs the decoder stages to forward the
encoder output, its gradient to cross the split back into the encoder, and the embedding copies
(stage 0, split rank, tied head) to be all-reduced.
"""

import functools

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import _allreduce_layernorm_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.models import t5_test_utils as tu

MBS = 2
NUM_MICROBATCHES = 4
ENC_LAYERS = 2
DEC_LAYERS = 4
RTOL = 1e-5
WORD = 'embedding.word_embeddings.weight'


def _batches():
    return [tu.random_batch(MBS, seed=100 + i) for i in range(NUM_MICROBATCHES)]


def _forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output = model(*tu.model_inputs(batch), lm_labels=batch['labels'])
    loss_mask = batch['loss_mask']

    def loss_func(output_tensor):
        # pretrain_t5's form: (sum of masked losses, token count, report).
        total = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
        num_tokens = loss_mask.sum().to(torch.int)
        return total, num_tokens, {'lm loss': (total.detach().clone(), num_tokens.clone())}

    return output, loss_func


def _stage_flags():
    """(pre_process, post_process, add_encoder, add_decoder) as training.get_model sets them."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return True, True, True, True
    rank = parallel_state.get_pipeline_model_parallel_rank()
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    return (
        rank in (0, split),
        rank in (split - 1, pp - 1),
        parallel_state.is_pipeline_stage_before_split(),
        parallel_state.is_pipeline_stage_after_split(),
    )


def _build(sequence_parallel=False, tied=True):
    pre, post, add_enc, add_dec = _stage_flags()
    config = tu.tiny_config(num_layers=ENC_LAYERS, sequence_parallel=sequence_parallel)
    model = tu.build_t5(
        config,
        ENC_LAYERS,
        DEC_LAYERS,
        pre_process=pre,
        post_process=post,
        add_encoder=add_enc,
        add_decoder=add_dec,
        tied=tied,
    )
    return config, model


def _global_name(model, name):
    parts = name.split('.')
    if parts[0] in ('encoder', 'decoder') and parts[1] == 'layers':
        block = model.encoder if parts[0] == 'encoder' else model.decoder
        parts[2] = str(block.layers[int(parts[2])].layer_number - 1)
        return '.'.join(parts)
    if parts[0] == 'lm_head':
        name = '.'.join(parts[1:])  # the head's linear is also registered as output_layer
    if name == 'output_layer.weight' and model.share_embeddings_and_output_weights:
        return WORD
    return name


def _tp_slice(param, full):
    if not getattr(param, 'tensor_model_parallel', False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(tp, dim=param.partition_dim)[parallel_state.get_tensor_model_parallel_rank()]


def _gather_tp(param, tensor):
    if not getattr(param, 'tensor_model_parallel', False):
        return tensor
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _run_schedule(model, config):
    return get_forward_backward_func()(
        forward_step_func=_forward_step_func,
        data_iterator=iter(_batches()),
        model=[model],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=tu.S_ENC,
        micro_batch_size=MBS,
        decoder_seq_length=tu.S_DEC,
    )


def _reference_body(tied):
    config, model = _build(tied=tied)
    tu.randomize(model, seed=3)
    params = {_global_name(model, n): p.detach().clone() for n, p in model.named_parameters()}
    losses = _run_schedule(model, config)
    grads = {_global_name(model, n): p.grad for n, p in model.named_parameters()}
    return {
        'params': params,
        'losses': [float(d['lm loss'][0] / d['lm loss'][1]) for d in losses],
        'grads': grads,
    }


@functools.lru_cache(maxsize=None)
def _reference(tied=True):
    return run_distributed(_reference_body, 1, args=(tied,), timeout=120)[0]


def _pipeline_body(params, sequence_parallel, tied, mutation):
    config, model = _build(sequence_parallel=sequence_parallel, tied=tied)
    # Embedding copies as the model's own initialisation leaves them (must equal stage 0's).
    init_tables = {}
    if model.pre_process:
        init_tables['word'] = _gather_tp(
            model.embedding.word_embeddings.weight, model.embedding.word_embeddings.weight.data
        )
        init_tables['position'] = model.embedding.position_embeddings.weight.data.clone()
    elif tied and model.post_process and model.add_decoder:
        init_tables['word'] = _gather_tp(model.output_layer.weight, model.output_layer.weight.data)

    if mutation == 'skip_embedding_allreduce':
        config.finalize_model_grads_func = lambda m, n: _allreduce_layernorm_grads(m, config)
    if mutation == 'drop_encoder_grad_skip':
        # The decoder stages no longer forward the encoder output's gradient across the split.
        from megatron.core.pipeline_parallel import microbatch_step

        real_backward = microbatch_step.backward_step

        def backward_without_skip(input_tensor, output_tensor, output_tensor_grad, *rest):
            if isinstance(output_tensor_grad, list) and len(output_tensor_grad) > 1:
                output_tensor_grad = [output_tensor_grad[0], None]
            return real_backward(input_tensor, output_tensor, output_tensor_grad, *rest)

        import megatron.core.pipeline_parallel.schedules as schedules

        schedules.backward_step = backward_without_skip

    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(_tp_slice(p, params[_global_name(model, name)]))
        losses = _run_schedule(model, config)
    finally:
        if mutation == 'drop_encoder_grad_skip':
            schedules.backward_step = real_backward
    grads = {_global_name(model, n): _gather_tp(p, p.grad) for n, p in model.named_parameters()}
    return {
        'losses': [float(d['lm loss'][0] / d['lm loss'][1]) for d in losses],
        'grads': grads,
        'init_tables': init_tables,
        'is_last': parallel_state.is_pipeline_last_stage(),
        'rank': torch.distributed.get_rank(),
    }


LAYOUTS = {
    # name: (world size, tp, pp, split rank)
    'pp2_split1': (2, 1, 2, 1),
    'pp4_split2': (4, 1, 4, 2),
    'pp3_split1': (3, 1, 3, 1),
    'tp2': (2, 2, 1, None),
    'tp2_pp2_split1': (4, 2, 2, 1),
}


def _run(layout, sequence_parallel=False, tied=True, mutation=None):
    world, tp, pp, split = LAYOUTS[layout]
    ref = _reference(tied)
    outs = run_distributed(
        _pipeline_body,
        world,
        tp=tp,
        pp=pp,
        split_rank=split,
        args=(ref['params'], sequence_parallel, tied, mutation),
        timeout=180,
    )
    return ref, outs


def _check(ref, outs):
    seen = set()
    for out in outs:
        if out['is_last']:
            assert out['losses'] == pytest.approx(ref['losses'], rel=RTOL)
        for name, grad in out['grads'].items():
            torch.testing.assert_close(grad, ref['grads'][name], rtol=RTOL, atol=1e-7, msg=name)
            seen.add(name)
        for kind, table in out['init_tables'].items():
            first = outs[0]['init_tables'][kind]
            assert torch.equal(table, first), f"rank {out['rank']}: {kind} table differs"
    assert seen == set(ref['grads'])


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_layout_matches_serial_t5(layout):
    ref, outs = _run(layout)
    assert len(ref['losses']) == NUM_MICROBATCHES
    _check(ref, outs)


def test_tp2_pp2_sequence_parallel_untied():
    ref, outs = _run('tp2_pp2_split1', sequence_parallel=True, tied=False)
    _check(ref, outs)


@pytest.mark.parametrize('mutation', ['skip_embedding_allreduce', 'drop_encoder_grad_skip'])
def test_broken_pipeline_is_detected(mutation):
    """The checks above see a missing embedding all-reduce or a dropped encoder-output gradient."""
    ref, outs = _run('pp4_split2', mutation=mutation)
    with pytest.raises(AssertionError):
        _check(ref, outs)
