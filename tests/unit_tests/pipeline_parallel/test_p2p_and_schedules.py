"""p2p communication and the three schedules on a small stage model against a serial reference.

The stage model is a stack of Linear+tanh layers ([s, b, h] -> [s, b, h]) with an input projection
on the first stage and a 1-wide head on the last; every layer's weights are a function of its
*global* index only, so the same layer has the same weights whichever stage builds it. Every
schedule must reproduce the serial model's per-micro-batch losses and every parameter's gradient.
"""

import contextlib
import dataclasses
from typing import List

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func, p2p_communication, schedules
from tests.unit_tests.dist_utils import run_distributed

SEQ, MBS, HIDDEN, IN_DIM = 4, 2, 8, 3
NUM_LAYERS = 8
NUM_MICROBATCHES = 8


@dataclasses.dataclass
class StageConfig(ModelParallelConfig):
    """ModelParallelConfig plus the two transformer fields the schedules read."""

    hidden_size: int = HIDDEN
    num_layers: int = NUM_LAYERS


def _config(**overrides) -> StageConfig:
    kwargs = dict(
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
        pipeline_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return StageConfig(**kwargs)


def _layer_params(global_index: int, fan_in: int, fan_out: int):
    gen = torch.Generator().manual_seed(1000 + global_index)
    weight = torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5
    bias = torch.randn(fan_out, generator=gen) * 0.1
    return weight, bias


class StageModel(torch.nn.Module):
    """Layers [offset, offset + num_local) of the stack; embed / head on first / last stage."""

    def __init__(self, config, pre_process: bool, post_process: bool, offset: int, num_local: int):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor = None
        self.layer_numbers = list(range(offset, offset + num_local))
        if pre_process:
            self.embed = torch.nn.Linear(IN_DIM, HIDDEN)
            w, b = _layer_params(-1, IN_DIM, HIDDEN)
            self.embed.weight.data.copy_(w)
            self.embed.bias.data.copy_(b)
        self.layers = torch.nn.ModuleList()
        for index in self.layer_numbers:
            layer = torch.nn.Linear(HIDDEN, HIDDEN)
            w, b = _layer_params(index, HIDDEN, HIDDEN)
            layer.weight.data.copy_(w)
            layer.bias.data.copy_(b)
            self.layers.append(layer)
        if post_process:
            self.head = torch.nn.Linear(HIDDEN, 1)
            w, b = _layer_params(-2, HIDDEN, 1)
            self.head.weight.data.copy_(w)
            self.head.bias.data.copy_(b)

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, x):
        hidden = self.embed(x) if self.pre_process else self.input_tensor  # [s, b, h]
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        if self.post_process:
            return self.head(hidden)  # [s, b, 1]
        return hidden

    def global_named_grads(self):
        """{global parameter name: grad}, the names a serial model would use."""
        out = {}
        for name, param in self.named_parameters():
            if name.startswith('layers.'):
                _, local, rest = name.split('.', 2)
                name = f'layers.{self.layer_numbers[int(local)]}.{rest}'
            out[name] = param.grad
        return out


def _batches(num_microbatches: int) -> List[dict]:
    gen = torch.Generator().manual_seed(7)
    return [
        {
            'x': torch.randn(SEQ, MBS, IN_DIM, generator=gen),
            'y': torch.randn(SEQ, MBS, 1, generator=gen),
        }
        for _ in range(num_microbatches)
    ]


def _loss_func(batch, output):
    loss = torch.nn.functional.mse_loss(output, batch['y'])
    return loss, {'loss': loss.detach().clone()}


def _forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch['x'])
    return output, lambda out: _loss_func(batch, out)


def _serial_reference(num_microbatches: int):
    """Losses and grads of the whole stack on one process, micro-batch losses averaged."""
    model = StageModel(None, True, True, 0, NUM_LAYERS)
    losses = []
    for batch in _batches(num_microbatches):
        loss, _ = _loss_func(batch, model(batch['x']))
        (loss / num_microbatches).backward()
        losses.append(loss.detach())
    return torch.stack(losses), model.global_named_grads()


def _build_chunks(config, num_layers=NUM_LAYERS):
    """One StageModel per virtual stage, virtual rank set per chunk as get_model does."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for chunk in range(vp or 1):
        if vp is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        per_stage = num_layers // (pp * (vp or 1))
        virtual_stage = chunk * pp + pp_rank
        chunks.append(
            StageModel(
                config,
                parallel_state.is_pipeline_first_stage(),
                parallel_state.is_pipeline_last_stage(),
                virtual_stage * per_stage,
                per_stage,
            )
        )
    if vp is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks


# ------------------------------------------------------------------------------------------------
# p2p communication


def _p2p_body(batch_p2p_comm: bool, variable_seq_lengths: bool):
    config = _config(batch_p2p_comm=batch_p2p_comm, variable_seq_lengths=variable_seq_lengths)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    prev, nxt = (rank - 1) % pp, (rank + 1) % pp
    fwd_shape = [3, 2, 4]
    # With variable_seq_lengths the two directions carry different shapes, so a swap would show.
    bwd_shape = [5, 2, 4] if variable_seq_lengths else fwd_shape
    out = {}

    def act(r):
        return torch.full(fwd_shape, 100.0 + r)

    def grad(r):
        return torch.full(bwd_shape, 200.0 + r)

    # Plain chain: forward sends then backward sends, stage by stage.
    p2p_communication.send_forward(act(rank), config)
    received = p2p_communication.recv_forward(fwd_shape, config)
    out['recv_forward'] = None if received is None else received.clone()
    p2p_communication.send_backward(grad(rank), config)
    received = p2p_communication.recv_backward(bwd_shape, config)
    out['recv_backward'] = None if received is None else received.clone()

    # 1F1B steady-state pairs: stage r sends forward and waits for the grad, r+1 the mirror.
    if rank % 2 == 0:
        got = p2p_communication.send_forward_recv_backward(act(rank), bwd_shape, config)
        out['sfrb'] = None if got is None else got.clone()
        got = p2p_communication.send_backward_recv_forward(grad(rank), fwd_shape, config)
        out['sbrf'] = None if got is None else got.clone()
    else:
        got = p2p_communication.send_backward_recv_forward(grad(rank), fwd_shape, config)
        out['sbrf'] = None if got is None else got.clone()
        got = p2p_communication.send_forward_recv_backward(act(rank), bwd_shape, config)
        out['sfrb'] = None if got is None else got.clone()

    # Ring exchanges as the interleaved schedule does them (last stage wraps to the first).
    out['sfrf'] = p2p_communication.send_forward_recv_forward(
        act(rank), recv_prev=True, tensor_shape=fwd_shape, config=config
    ).clone()
    out['sbrb'] = p2p_communication.send_backward_recv_backward(
        grad(rank), recv_next=True, tensor_shape=bwd_shape, config=config
    ).clone()
    # Both directions at once: with pp=2 both messages go to the same peer and must not cross.
    fwd_in, bwd_in = p2p_communication.send_forward_backward_recv_forward_backward(
        act(rank), grad(rank), recv_prev=True, recv_next=True, tensor_shape=fwd_shape, config=config
    )
    out['both'] = (fwd_in.clone(), bwd_in.clone())
    out['prev'], out['next'] = prev, nxt
    out['rank'], out['pp'] = rank, pp
    return out


@pytest.mark.parametrize(
    'world_size,batch_p2p_comm,variable_seq_lengths',
    [(2, True, False), (2, False, True), (2, True, True), (4, True, False), (4, False, False)],
)
def test_p2p_exchanges_reach_the_right_neighbour(world_size, batch_p2p_comm, variable_seq_lengths):
    outs = run_distributed(
        _p2p_body,
        world_size,
        pp=world_size,
        args=(batch_p2p_comm, variable_seq_lengths),
        timeout=90,
    )
    fwd_shape = [3, 2, 4]
    bwd_shape = [5, 2, 4] if variable_seq_lengths else fwd_shape
    for out in outs:
        rank, pp, prev, nxt = out['rank'], out['pp'], out['prev'], out['next']
        first, last = rank == 0, rank == pp - 1
        if first:
            assert out['recv_forward'] is None and out['sbrf'] is None
        else:
            torch.testing.assert_close(out['recv_forward'], torch.full(fwd_shape, 100.0 + prev))
            torch.testing.assert_close(out['sbrf'], torch.full(fwd_shape, 100.0 + prev))
        if last:
            assert out['recv_backward'] is None and out['sfrb'] is None
        else:
            torch.testing.assert_close(out['recv_backward'], torch.full(bwd_shape, 200.0 + nxt))
            torch.testing.assert_close(out['sfrb'], torch.full(bwd_shape, 200.0 + nxt))
        torch.testing.assert_close(out['sfrf'], torch.full(fwd_shape, 100.0 + prev))
        torch.testing.assert_close(out['sbrb'], torch.full(bwd_shape, 200.0 + nxt))
        torch.testing.assert_close(out['both'][0], torch.full(fwd_shape, 100.0 + prev))
        torch.testing.assert_close(out['both'][1], torch.full(bwd_shape, 200.0 + nxt))


# ------------------------------------------------------------------------------------------------
# schedules against the serial reference


def _schedule_body(num_microbatches: int, forward_only: bool, config_overrides: dict):
    config = _config(**config_overrides)
    chunks = _build_chunks(config)
    batches = _batches(num_microbatches)
    data_iterators = [iter(batches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step_func,
        data_iterator=data_iterators if len(chunks) > 1 else data_iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
    )
    grads = {}
    for chunk in chunks:
        grads.update(chunk.global_named_grads())
    return {'losses': [d['loss'] for d in losses], 'grads': grads}


def _check_against_reference(outs, num_microbatches: int, forward_only: bool):
    ref_losses, ref_grads = _serial_reference(num_microbatches)
    last = outs[-1]
    assert len(last['losses']) == num_microbatches
    torch.testing.assert_close(torch.stack(last['losses']), ref_losses, rtol=1e-5, atol=1e-6)
    for out in outs[:-1]:
        assert out['losses'] == []
    grads = {}
    for out in outs:
        for name, grad in out['grads'].items():
            assert name not in grads, f"{name} held by two stages"
            grads[name] = grad
    assert sorted(grads) == sorted(ref_grads)
    for name, ref in ref_grads.items():
        if forward_only:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    'world_size,vpp,num_microbatches,forward_only,overrides',
    [
        (1, None, 4, False, {}),
        (1, None, 4, True, {}),
        (2, None, NUM_MICROBATCHES, False, {}),
        (2, None, 1, False, {}),
        (2, None, NUM_MICROBATCHES, False, {'deallocate_pipeline_outputs': True}),
        (2, None, 3, True, {}),
        (2, 2, NUM_MICROBATCHES, False, {}),
        (2, 2, 2, False, {}),  # num_microbatches == pp: all-warm-up path
        (2, 2, 4, True, {}),
        (2, 4, 4, False, {'deallocate_pipeline_outputs': True, 'batch_p2p_comm': False}),
        (4, None, NUM_MICROBATCHES, False, {}),
        (4, None, 2, False, {}),  # fewer micro-batches than stages
        (4, 2, NUM_MICROBATCHES, False, {'deallocate_pipeline_outputs': True}),
        (4, 2, 4, True, {}),
        # Megatron's CLI default for interleaving: overlapped, unbatched p2p.
        (2, 2, NUM_MICROBATCHES, False, {'overlap_p2p_comm': True, 'batch_p2p_comm': False}),
        (2, 2, 2, False, {'overlap_p2p_comm': True, 'batch_p2p_comm': False}),
        (4, 2, 4, True, {'overlap_p2p_comm': True, 'batch_p2p_comm': False}),
        (
            4,
            2,
            NUM_MICROBATCHES,
            False,
            {
                'overlap_p2p_comm': True,
                'batch_p2p_comm': False,
                'deallocate_pipeline_outputs': True,
            },
        ),
    ],
)
def test_schedule_matches_serial_reference(
    world_size, vpp, num_microbatches, forward_only, overrides
):
    outs = run_distributed(
        _schedule_body,
        world_size,
        pp=world_size,
        vpp=vpp,
        args=(num_microbatches, forward_only, overrides),
        timeout=120,
    )
    _check_against_reference(outs, num_microbatches, forward_only)


def test_get_forward_backward_func_picks_schedule():
    assert run_distributed(_pick_body, 1) == ['forward_backward_no_pipelining']
    assert (
        run_distributed(_pick_body, 2, pp=2)
        == ['forward_backward_pipelining_without_interleaving'] * 2
    )
    assert (
        run_distributed(_pick_body, 2, pp=2, vpp=2)
        == ['forward_backward_pipelining_with_interleaving'] * 2
    )


def _pick_body():
    return get_forward_backward_func().__name__


# ------------------------------------------------------------------------------------------------
# order of forward / backward steps (warm-up counts)


class _RecordBackward(torch.autograd.Function):
    """Identity that appends ('B', tag) to a trace when its backward runs."""

    @staticmethod
    def forward(ctx, x, trace, tag):
        ctx.trace, ctx.tag = trace, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.trace.append(('B', ctx.tag))
        return grad, None, None


def _trace_body(num_microbatches: int):
    config = _config()
    chunks = _build_chunks(config)
    batches = _batches(num_microbatches)
    trace = []

    def forward_step_func(data_iterator, model):
        chunk = chunks.index(model)
        trace.append(('F', chunk))
        batch = next(data_iterator)
        if model.pre_process:
            x = _RecordBackward.apply(batch['x'].requires_grad_(), trace, chunk)
            output = model(x)
        else:
            model.input_tensor = _RecordBackward.apply(model.input_tensor, trace, chunk)
            output = model(batch['x'])
        return output, lambda out: _loss_func(batch, out)

    data_iterators = [iter(batches) for _ in chunks]
    get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterators if len(chunks) > 1 else data_iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    return trace


def _expected_warmup(pp, rank, num_microbatches, vpp):
    """Warm-up forwards as the schedule papers define them (written independently of schedules)."""
    if vpp is None:
        return min(pp - rank - 1, num_microbatches)
    total = num_microbatches * vpp
    if num_microbatches == pp:
        return total
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


@pytest.mark.parametrize(
    'world_size,vpp,num_microbatches', [(4, None, 8), (4, None, 2), (2, 2, 6), (4, 2, 8)]
)
def test_warmup_forward_counts(world_size, vpp, num_microbatches):
    traces = run_distributed(
        _trace_body, world_size, pp=world_size, vpp=vpp, args=(num_microbatches,), timeout=120
    )
    for rank, trace in enumerate(traces):
        total = num_microbatches * (vpp or 1)
        assert [kind for kind, _ in trace].count('F') == total
        assert [kind for kind, _ in trace].count('B') == total
        leading = next(i for i, (kind, _) in enumerate(trace) if kind == 'B')
        warmup = _expected_warmup(world_size, rank, num_microbatches, vpp)
        # The steady state starts with one more forward unless everything ran as warm-up.
        expected = warmup if warmup == total else warmup + 1
        assert leading == expected, (
            f"rank {rank}: {leading} forwards before first backward, trace {trace}"
        )
        if warmup < total:
            # Steady state alternates one forward and one backward.
            steady = [kind for kind, _ in trace[leading : leading + 2 * (total - warmup) - 1]]
            assert steady == ['B', 'F'] * (total - warmup - 1) + ['B'], trace
        if vpp is not None:
            # Forward chunk order: groups of pp micro-batches per chunk.
            fwd_chunks = [chunk for kind, chunk in trace if kind == 'F']
            assert fwd_chunks == [(k % (world_size * vpp)) // world_size for k in range(total)]


# ------------------------------------------------------------------------------------------------
# hooks: no_sync, grad_sync_func, param_sync_func, finalize_model_grads_func, grad_scale_func


def _hooks_body(num_microbatches: int):
    events = []

    @contextlib.contextmanager
    def no_sync():
        events.append('enter_no_sync')
        try:
            yield
        finally:
            events.append('exit_no_sync')

    def grad_sync(params):
        events.append('grad_sync')

    def param_sync(params):
        events.append('param_sync')

    def finalize(model, num_tokens):
        events.append(('finalize', len(model), num_tokens))

    config = _config(
        no_sync_func=no_sync,
        finalize_model_grads_func=finalize,
        grad_scale_func=lambda loss: loss * 4.0,
    )
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        config.param_sync_func = param_sync
        config.grad_sync_func = grad_sync
    chunks = _build_chunks(config)
    batches = _batches(num_microbatches)

    def forward_step_func(data_iterator, model):
        events.append('forward')
        return _forward_step_func(data_iterator, model)

    data_iterators = [iter(batches) for _ in chunks]
    config_before = dataclasses.asdict(config)
    get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterators if len(chunks) > 1 else data_iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    assert dataclasses.asdict(config) == config_before, "the schedule mutated the config"
    grads = {}
    for chunk in chunks:
        grads.update(chunk.global_named_grads())
    return {'events': events, 'grads': grads}


@pytest.mark.parametrize('world_size,vpp', [(1, None), (2, None), (2, 2)])
def test_schedule_hooks(world_size, vpp):
    num_microbatches = 4
    outs = run_distributed(
        _hooks_body, world_size, pp=world_size, vpp=vpp, args=(num_microbatches,)
    )
    _, ref_grads = _serial_reference(num_microbatches)
    for rank, out in enumerate(outs):
        events = out['events']
        finals = [e for e in events if isinstance(e, tuple)]
        assert finals == [('finalize', vpp or 1, None)], events
        assert events[-1] == finals[0], "finalize_model_grads_func must run last"
        # All forwards but the last one's backward run inside no_sync: the context is entered at
        # the start and left before the final backward; without a grad_sync_func it stays closed.
        assert events[0] == 'enter_no_sync'
        if vpp is None:
            forwards_before_exit = events[: events.index('exit_no_sync')].count('forward')
            if world_size == 1:
                assert forwards_before_exit == num_microbatches - 1
            assert events.count('enter_no_sync') == 1 and events.count('exit_no_sync') == 1
        else:
            assert events.count('param_sync') >= 2  # the first two chunks synced up front
            assert events.count('grad_sync') == vpp  # every chunk's grads synced exactly once
        # grad_scale_func multiplies the loss by 4 before backward on the last stage.
        for name, grad in out['grads'].items():
            torch.testing.assert_close(grad, 4.0 * ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------------
# validation and failures


def _validation_body(case: str):
    if case == 'layers':
        config = _config(num_layers=6)
        num_microbatches = 4
    else:
        config = _config()
        num_microbatches = 3
    chunks = _build_chunks(config, num_layers=8)
    try:
        get_forward_backward_func()(
            forward_step_func=_forward_step_func,
            data_iterator=[iter(_batches(num_microbatches)) for _ in chunks],
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
    except ValueError as exc:
        return str(exc)
    return None


def test_impossible_settings_raise_value_error_before_communication():
    # Each rank raises on its own (no communication happened, so nobody blocks).
    msgs = run_distributed(_validation_body, 2, pp=2, vpp=2, args=('layers',), timeout=60)
    for msg in msgs:
        assert msg is not None and 'num_layers (6)' in msg and '= 4' in msg, msg
    msgs = run_distributed(_validation_body, 2, pp=2, vpp=2, args=('microbatches',), timeout=60)
    for msg in msgs:
        assert msg is not None and 'microbatches (3)' in msg and '(2)' in msg, msg


def _tensor_shapes_body():
    out = {}
    config = _config()
    for model_type in (ModelType.encoder_or_decoder, ModelType.encoder_and_decoder):
        out[model_type.name] = [
            schedules.get_tensor_shapes(
                rank=rank,
                model_type=model_type,
                seq_length=16,
                micro_batch_size=MBS,
                decoder_seq_length=8,
                config=config,
            )
            for rank in range(2)
        ]
    return out


def test_tensor_shapes_for_encoder_decoder_split():
    # pp=2 with the split at rank 1: rank 0 runs the encoder, rank 1 the decoder.
    out = run_distributed(_tensor_shapes_body, 2, pp=2, split_rank=1)[0]
    assert out['encoder_or_decoder'] == [[(16, MBS, HIDDEN)]] * 2
    assert out['encoder_and_decoder'] == [
        [(16, MBS, HIDDEN)],
        [(8, MBS, HIDDEN), (16, MBS, HIDDEN)],
    ]


# ------------------------------------------------------------------------------------------------
# loss_func forms: (loss, num_tokens, dict), per-token normalisation, non-loss data


@dataclasses.dataclass
class PerTokenConfig(StageConfig):
    """StageConfig with TransformerConfig's per-token loss switch."""

    calculate_per_token_loss: bool = False


def _token_loss_body(num_microbatches: int, per_token: bool):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = PerTokenConfig(
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=(
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
        ),
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=per_token,
        finalize_model_grads_func=finalize_model_grads,
    )
    chunks = _build_chunks(config)

    def forward_step_func(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch['x'])

        def loss_func(out):
            loss_sum = ((out - batch['y']) ** 2).sum()
            num_tokens = torch.tensor(out.numel(), dtype=torch.int)
            return loss_sum, num_tokens, {'loss': loss_sum.detach() / out.numel()}

        return output, loss_func

    batches = _batches(num_microbatches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    grads = {}
    for chunk in chunks:
        grads.update(chunk.global_named_grads())
    return {'losses': [d['loss'] for d in losses], 'grads': grads}


@pytest.mark.parametrize('per_token', [False, True])
def test_three_tuple_loss_func_and_per_token_normalisation(per_token):
    # Every micro-batch has the same token count, so both normalisations equal the mean of means.
    outs = run_distributed(_token_loss_body, 2, pp=2, args=(4, per_token))
    _check_against_reference(outs, 4, forward_only=False)


def _non_loss_data_body():
    config = _config()
    chunks = _build_chunks(config)
    batches = _batches(4)

    def forward_step_func(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch['x'])

        def loss_func(out, non_loss_data=False):
            assert non_loss_data, (
                "collect_non_loss_data must call loss_func(out, non_loss_data=True)"
            )
            return out.detach().clone()

        return output, loss_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iter(batches),
        model=chunks[0],
        num_microbatches=4,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=True,
        collect_non_loss_data=True,
    )


def test_collect_non_loss_data_returns_last_stage_outputs():
    outs = run_distributed(_non_loss_data_body, 2, pp=2)
    assert outs[0] == []
    model = StageModel(None, True, True, 0, NUM_LAYERS)
    with torch.no_grad():
        expected = [model(batch['x']) for batch in _batches(4)]
    torch.testing.assert_close(torch.stack(outs[1]), torch.stack(expected), rtol=1e-5, atol=1e-6)


# A failing job kills its worker pool, so this runs last in the file.
def _raising_body():
    config = _config()
    chunks = _build_chunks(config)
    rank = parallel_state.get_pipeline_model_parallel_rank()

    def forward_step_func(data_iterator, model):
        if rank == 1:
            raise RuntimeError("stage 1 exploded on purpose")
        return _forward_step_func(data_iterator, model)

    get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iter(_batches(4)),
        model=chunks[0],
        num_microbatches=4,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )


def test_a_raising_rank_fails_with_its_message():
    with pytest.raises(RuntimeError, match="stage 1 exploded on purpose"):
        run_distributed(_raising_body, 2, pp=2, timeout=60)
