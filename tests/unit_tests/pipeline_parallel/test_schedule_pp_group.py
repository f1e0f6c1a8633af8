"""The 1F1B schedule on a pipeline group passed in (`pp_group=`), not the global one.

Four gloo ranks with global pipeline size 1; pipelines [0, 1] and [2, 3] are new groups. Each
pipeline runs the 2-stage stack of `test_p2p_and_schedules` (stage = pp_group.rank(), which decides
embed / layers / head) and must match the serial reference: losses on its last stage, each
parameter's gradient on exactly one stage. With the global (size-1) group every rank would be both
first and last stage, nothing would be exchanged and stage 0 would apply the loss to hidden states.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.pipeline_parallel.test_p2p_and_schedules import (
    MBS,
    NUM_LAYERS,
    SEQ,
    StageModel,
    _batches,
    _check_against_reference,
    _config,
    _forward_step_func,
)

PIPELINES = ([0, 1], [2, 3])


def _body(num_microbatches: int, forward_only: bool, batch_p2p_comm: bool):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    rank = torch.distributed.get_rank()
    groups = [torch.distributed.new_group(ranks) for ranks in PIPELINES]
    pp_group = groups[rank // 2]
    stage, pp_size = pp_group.rank(), pp_group.size()
    config = _config(pipeline_model_parallel_size=pp_size, batch_p2p_comm=batch_p2p_comm)
    per_stage = NUM_LAYERS // pp_size
    model = StageModel(config, stage == 0, stage == pp_size - 1, stage * per_stage, per_stage)
    losses = forward_backward_pipelining_without_interleaving(
        forward_step_func=_forward_step_func,
        data_iterator=iter(_batches(num_microbatches)),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
        pp_group=pp_group,
    )
    return {'losses': [d['loss'] for d in losses], 'grads': model.global_named_grads()}


@pytest.mark.parametrize(
    'num_microbatches,forward_only,batch_p2p_comm',
    [(4, False, True), (4, False, False), (1, False, True), (3, True, True)],
)
def test_1f1b_on_explicit_pp_group_matches_serial_reference(
    num_microbatches, forward_only, batch_p2p_comm
):
    outs = run_distributed(
        _body, 4, tp=1, pp=1, args=(num_microbatches, forward_only, batch_p2p_comm), timeout=60
    )
    for ranks in PIPELINES:
        _check_against_reference([outs[r] for r in ranks], num_microbatches, forward_only)


def _interleaved_body(num_microbatches: int, forward_only: bool, overrides: dict):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.interleaved_schedule import (
        forward_backward_pipelining_with_interleaving,
    )

    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    rank = torch.distributed.get_rank()
    groups = [torch.distributed.new_group(ranks) for ranks in PIPELINES]
    pp_group = groups[rank // 2]
    stage, pp_size, vp_size = pp_group.rank(), pp_group.size(), 2
    # The chunk index is global state the loss step reads, as in Megatron.
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp_size)
    config = _config(
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vp_size,
        **overrides,
    )
    per_chunk = NUM_LAYERS // (pp_size * vp_size)
    chunks = []
    for chunk in range(vp_size):
        virtual_stage = chunk * pp_size + stage  # chunk c of stage r: virtual stage c * pp + r
        first, last = virtual_stage == 0, virtual_stage == pp_size * vp_size - 1
        chunks.append(StageModel(config, first, last, virtual_stage * per_chunk, per_chunk))
    batches = _batches(num_microbatches)
    try:
        losses = forward_backward_pipelining_with_interleaving(
            forward_step_func=_forward_step_func,
            data_iterator=[iter(batches) for _ in chunks],
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=forward_only,
            pp_group=pp_group,
        )
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_rank(None)
    grads = {}
    for chunk in chunks:
        grads.update(chunk.global_named_grads())
    return {'losses': [d['loss'] for d in losses], 'grads': grads}


@pytest.mark.parametrize(
    'num_microbatches,forward_only,overrides',
    [
        (4, False, {}),
        (2, False, {}),  # num_microbatches == pp: every forward in warm-up
        (4, True, {}),
        (4, False, {'overlap_p2p_comm': True, 'batch_p2p_comm': False}),
    ],
)
def test_interleaved_on_explicit_pp_group_matches_serial_reference(
    num_microbatches, forward_only, overrides
):
    outs = run_distributed(
        _interleaved_body, 4, tp=1, pp=1, args=(num_microbatches, forward_only, overrides)
    )
    for ranks in PIPELINES:
        _check_against_reference([outs[r] for r in ranks], num_microbatches, forward_only)
