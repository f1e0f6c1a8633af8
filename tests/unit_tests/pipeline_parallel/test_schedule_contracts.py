"""The interleaved schedule as Megatron r0.8's callers use it: one data iterator shared by every
model chunk (a step function that reads data only on the first and last virtual stage consumes it
exactly as the per-chunk lists do), and layout errors raised before the iterator check as errors
that are also RuntimeErrors."""

import pytest

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.pipeline_parallel.test_p2p_and_schedules import (
    MBS,
    SEQ,
    _batches,
    _build_chunks,
    _check_against_reference,
    _config,
    _loss_func,
)


def _reads_at_the_ends(data_iterator, model):
    # Megatron's get_batch: only the first and last virtual stage draw a batch.
    batch = next(data_iterator) if (model.pre_process or model.post_process) else None
    output = model(batch['x'] if batch is not None else None)
    return output, lambda out: _loss_func(batch, out)


def _shared_iterator_body(num_microbatches):
    chunks = _build_chunks(_config())
    rank = parallel_state.get_pipeline_model_parallel_rank()
    # Rank 0 reads only in chunk 0, the last rank only in its last chunk: one iterator each.
    losses = get_forward_backward_func()(
        forward_step_func=_reads_at_the_ends,
        data_iterator=iter(_batches(num_microbatches)),
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MBS,
    )
    grads = {}
    for chunk in chunks:
        grads.update(chunk.global_named_grads())
    return {'losses': [d['loss'] for d in losses], 'grads': grads, 'rank': rank}


def test_one_iterator_for_every_chunk_matches_the_serial_reference():
    outs = run_distributed(_shared_iterator_body, 2, pp=2, vpp=2, args=(4,), timeout=90)
    _check_against_reference(outs, 4, forward_only=False)


def _short_iterator_list(num_microbatches):
    chunks = _build_chunks(_config())
    try:
        get_forward_backward_func()(
            forward_step_func=_reads_at_the_ends,
            data_iterator=[iter(_batches(4))],  # one list entry for two chunks
            model=chunks,
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
    except RuntimeError as exc:  # also a ValueError
        return type(exc).__name__, isinstance(exc, ValueError), str(exc)
    return None


def test_layout_error_comes_first_and_is_a_runtime_error():
    # 3 micro-batches on 2 stages is the error raised, not the short iterator list.
    for name, is_value_error, msg in run_distributed(
        _short_iterator_list, 2, pp=2, vpp=2, args=(3,), timeout=60
    ):
        assert name == 'PipelineScheduleError' and is_value_error
        assert 'number of microbatches (3)' in msg
    for _, _, msg in run_distributed(_short_iterator_list, 2, pp=2, vpp=2, args=(4,), timeout=60):
        assert 'got 1 data iterators for 2 model chunks' in msg


def test_non_list_model_is_refused():
    from megatron.core.pipeline_parallel.interleaved_schedule import (
        forward_backward_pipelining_with_interleaving,
    )

    with pytest.raises(RuntimeError, match='list of model chunks'):
        forward_backward_pipelining_with_interleaving(
            forward_step_func=None,
            data_iterator=None,
            model=object(),
            num_microbatches=2,
            seq_length=SEQ,
            micro_batch_size=MBS,
        )
