"""A tiny GPT split over pipeline stages reproduces the single-stage run.

The reference is the same GPT on one rank (PP=1, TP=1) run by forward_backward_no_pipelining.
Its parameters are loaded into every (virtual) stage by *global* name: layer i of chunk c holds
global layer `layer_number - 1`, and TP ranks take their slice along each parameter's
`partition_dim`. Each pipeline run must give the reference's per-micro-batch losses and, after
gathering over TP (and averaging over DP, as DDP would), every parameter's gradient; the tied word
embedding's two copies (first-stage input embedding, last-stage output layer) must each carry the
full gradient, which needs finalize_model_grads' all-reduce over the embedding group.
"""

import functools

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import (
    _allreduce_layernorm_grads,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import transformer_layer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

VOCAB, SEQ, MBS, HIDDEN, HEADS = 128, 16, 2, 32, 4
NUM_LAYERS = 8
NUM_MICROBATCHES = 8
TIED = 'embedding.word_embeddings.weight'


def _config(sequence_parallel=False) -> TransformerConfig:
    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
        sequence_parallel=sequence_parallel,
        pipeline_dtype=torch.float32,
        finalize_model_grads_func=finalize_model_grads,
    )


def _batches(num_microbatches: int):
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (num_microbatches, MBS, SEQ + 1), generator=gen)
    return [{'tokens': t[:, :-1], 'labels': t[:, 1:]} for t in tokens]


def _forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    output = model(batch['tokens'], position_ids, None, labels=batch['labels'])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()  # per-token loss [b, s] -> scalar
        return loss, {'lm loss': loss.detach().clone()}

    return output, loss_func


def _offset_ignoring_virtual_rank(config) -> int:
    """A classic bug: the non-interleaved offset pp_rank * num_layers / pp for every chunk."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return parallel_state.get_pipeline_model_parallel_rank() * (config.num_layers // pp)


def _build_chunks(config, wrong_virtual_offset=False):
    """One GPTModel per virtual stage, with the virtual rank set per chunk as get_model does.

    wrong_virtual_offset swaps in a layer-offset function that ignores the virtual rank (chunks
    otherwise built right), which is the bug the loss and layout checks must catch.
    """
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    saved_offset = transformer_layer.get_transformer_layer_offset
    if wrong_virtual_offset:
        transformer_layer.get_transformer_layer_offset = _offset_ignoring_virtual_rank
    chunks = []
    try:
        for chunk in range(vp or 1):
            if vp is not None:
                parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
            chunks.append(
                GPTModel(
                    config=config,
                    transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB,
                    max_sequence_length=SEQ,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=True,
                )
            )
    finally:
        transformer_layer.get_transformer_layer_offset = saved_offset
    if vp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


def _global_name(chunk, name: str) -> str:
    if name.startswith('decoder.layers.'):
        parts = name.split('.')
        parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
        return '.'.join(parts)
    if name == 'output_layer.weight' and chunk.share_embeddings_and_output_weights:
        return TIED
    return name


def _tp_slice(param, full: torch.Tensor) -> torch.Tensor:
    if not getattr(param, 'tensor_model_parallel', False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(tp, dim=param.partition_dim)[parallel_state.get_tensor_model_parallel_rank()]


def _gather_tp(param, tensor: torch.Tensor) -> torch.Tensor:
    if not getattr(param, 'tensor_model_parallel', False):
        return tensor
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _reference_body(num_microbatches: int):
    config = _config()
    model = _build_chunks(config)[0]
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step_func,
        data_iterator=iter(_batches(num_microbatches)),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {'params': params, 'losses': [d['lm loss'] for d in losses], 'grads': grads}


@functools.lru_cache(maxsize=None)
def _reference(num_microbatches: int):
    return run_distributed(_reference_body, 1, args=(num_microbatches,), timeout=120)[0]


def _pipeline_body(params, num_microbatches, sequence_parallel, forward_only, mutation):
    config = _config(sequence_parallel=sequence_parallel)
    if mutation == 'skip_embedding_allreduce':
        config.finalize_model_grads_func = lambda model, num_tokens: _allreduce_layernorm_grads(
            model, config
        )
    chunks = _build_chunks(config, wrong_virtual_offset=(mutation == 'wrong_virtual_offset'))
    models = chunks
    if mutation == 'ddp':
        # As training.get_model + setup_model_and_optimizer wire it for overlapped DDP.
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True)
        models = [
            DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=(i > 0))
            for i, chunk in enumerate(chunks)
        ]
        config.no_sync_func = [m.no_sync for m in models]
        config.grad_sync_func = [m.start_grad_sync for m in models]
        if len(models) == 1:
            config.no_sync_func = config.no_sync_func[0]
            config.grad_sync_func = config.grad_sync_func[0]
        else:
            # Megatron's CLI default with interleaving: overlapped, unbatched p2p.
            config.overlap_p2p_comm = True
            config.batch_p2p_comm = False

    # The tied output layer must start equal to the first stage's embedding (init all-reduce).
    tie = {}
    for chunk in chunks:
        if chunk.pre_process:
            tie['embedding'] = _gather_tp(
                chunk.embedding.word_embeddings.weight, chunk.embedding.word_embeddings.weight.data
            )
        if chunk.post_process and not chunk.pre_process:
            tie['output_layer'] = _gather_tp(
                chunk.output_layer.weight, chunk.output_layer.weight.data
            )

    layer_numbers = []
    for chunk in chunks:
        layer_numbers.append([layer.layer_number for layer in chunk.decoder.layers])
        for name, param in chunk.named_parameters():
            param.data.copy_(_tp_slice(param, params[_global_name(chunk, name)]))

    dp_rank = parallel_state.get_data_parallel_rank()
    batches = _batches(num_microbatches * parallel_state.get_data_parallel_world_size())
    mine = batches[dp_rank * num_microbatches : (dp_rank + 1) * num_microbatches]
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step_func,
        data_iterator=[iter(mine) for _ in chunks] if vp else iter(mine),
        model=models,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
    )

    grads = {}
    dp_group = parallel_state.get_data_parallel_group()
    dp_size = parallel_state.get_data_parallel_world_size()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if mutation == 'ddp':
                assert param.grad is None, "DDP moves gradients into main_grad"
                grad = param.main_grad  # already averaged over DP by finish_grad_sync
            elif param.grad is None:
                grads[(_global_name(chunk, name), name)] = None
                continue
            else:
                grad = param.grad.clone()
                torch.distributed.all_reduce(grad, group=dp_group)  # what DDP does
                grad = grad / dp_size
            grads[(_global_name(chunk, name), name)] = _gather_tp(param, grad)
    return {
        'pp_rank': parallel_state.get_pipeline_model_parallel_rank(),
        'tp_rank': parallel_state.get_tensor_model_parallel_rank(),
        'dp_rank': dp_rank,
        'losses': [d['lm loss'] for d in losses],
        'grads': grads,
        'layer_numbers': layer_numbers,
        'tie': tie,
    }


def _run(
    world_size,
    tp,
    pp,
    vpp,
    num_microbatches=NUM_MICROBATCHES,
    sequence_parallel=False,
    forward_only=False,
    mutation=None,
):
    dp = world_size // (tp * pp)
    ref = _reference(num_microbatches * dp)
    outs = run_distributed(
        _pipeline_body,
        world_size,
        tp=tp,
        pp=pp,
        vpp=vpp,
        args=(ref['params'], num_microbatches, sequence_parallel, forward_only, mutation),
        timeout=240,
    )
    return ref, outs


def _check_losses(ref, outs, pp, num_microbatches):
    for out in outs:
        if out['pp_rank'] != pp - 1:
            assert out['losses'] == [], "only the last stage returns losses"
            continue
        expected = ref['losses'][
            out['dp_rank'] * num_microbatches : (out['dp_rank'] + 1) * num_microbatches
        ]
        torch.testing.assert_close(
            torch.stack(out['losses']),
            torch.stack(expected),
            rtol=1e-5,
            atol=1e-5,
            msg=lambda m: f"losses of dp rank {out['dp_rank']} differ: {m}",
        )


def _check_grads(ref, outs):
    seen = set()
    for out in outs:
        for (name, local_name), grad in out['grads'].items():
            seen.add(name)
            torch.testing.assert_close(
                grad,
                ref['grads'][name],
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m: f"grad of {name} ({local_name} on pp rank {out['pp_rank']}): {m}",
            )
    assert seen == set(ref['grads']), set(ref['grads']) ^ seen


def _check_layout(outs, pp, vpp):
    """Layer numbers follow Megatron's layout; the tied output layer starts equal to the
    embedding."""
    chunks = vpp or 1
    per_chunk = NUM_LAYERS // (pp * chunks)
    for out in outs:
        expected = [
            [c * pp * per_chunk + out['pp_rank'] * per_chunk + i + 1 for i in range(per_chunk)]
            for c in range(chunks)
        ]
        assert out['layer_numbers'] == expected, (out['pp_rank'], out['layer_numbers'])
    embedding = {o['tp_rank']: o['tie']['embedding'] for o in outs if 'embedding' in o['tie']}
    for out in outs:
        if 'output_layer' in out['tie']:
            torch.testing.assert_close(out['tie']['output_layer'], embedding[out['tp_rank']])


@pytest.mark.parametrize(
    'world_size,tp,pp,vpp,sequence_parallel',
    [
        (2, 1, 2, None, False),
        (4, 1, 4, None, False),
        (2, 1, 2, 2, False),
        (8, 2, 2, None, True),
    ],
    ids=['pp2', 'pp4', 'pp2-vpp2', 'tp2-pp2-dp2-sp'],
)
def test_pipeline_reproduces_single_stage(world_size, tp, pp, vpp, sequence_parallel):
    ref, outs = _run(world_size, tp, pp, vpp, sequence_parallel=sequence_parallel)
    _check_layout(outs, pp, vpp)
    _check_losses(ref, outs, pp, NUM_MICROBATCHES)
    _check_grads(ref, outs)


@pytest.mark.parametrize('vpp', [None, 2], ids=['pp2-dp2', 'pp2-vpp2-dp2'])
def test_pipeline_with_overlapped_ddp(vpp):
    """DDP's no_sync / start_grad_sync hooks and finish_grad_sync inside finalize_model_grads.

    The interleaved case also runs with overlap_p2p_comm, as Megatron's training does by default.
    """
    ref, outs = _run(4, 1, 2, vpp, num_microbatches=4, mutation='ddp')
    _check_losses(ref, outs, 2, 4)
    _check_grads(ref, outs)


def test_pipeline_forward_only():
    ref, outs = _run(2, 1, 2, 2, forward_only=True)
    _check_losses(ref, outs, 2, NUM_MICROBATCHES)
    for out in outs:
        assert all(grad is None for grad in out['grads'].values())


def test_missed_embedding_allreduce_is_caught():
    ref, outs = _run(2, 1, 2, None, mutation='skip_embedding_allreduce')
    _check_losses(ref, outs, 2, NUM_MICROBATCHES)  # forward is unaffected
    with pytest.raises(AssertionError, match=TIED.replace('.', r'\.')):
        _check_grads(ref, outs)


def test_wrong_virtual_layer_offset_is_caught():
    ref, outs = _run(2, 1, 2, 2, mutation='wrong_virtual_offset')
    with pytest.raises(AssertionError):
        _check_layout(outs, 2, 2)
    # Independently of the layer numbers, the computation itself no longer matches.
    with pytest.raises(AssertionError, match="losses"):
        _check_losses(ref, outs, 2, NUM_MICROBATCHES)
