"""parallel_state, the micro-batch calculator, the inference Scheduler and FusedScaleMaskSoftmax
behave as Megatron r0.8's library users expect: initialize_model_parallel's errors are the types
r0.8 raises (AssertionError for no torch.distributed / a second call, RuntimeError for sizes,
checked first), every r0.8 order string, the ramp-up consistency error is an AssertionError,
the Scheduler takes its own active pool back, and a causal softmax asserts square scores."""

from collections import OrderedDict

import pytest
import torch

from megatron.core import parallel_state as ps
from tests.unit_tests.dist_utils import run_distributed


def test_initialize_without_torch_distributed_is_an_assertion_error():
    if torch.distributed.is_initialized():
        pytest.skip('this process already runs torch.distributed')
    with pytest.raises(AssertionError, match='needs torch.distributed'):
        ps.initialize_model_parallel()


def _second_call_and_orders():
    world = torch.distributed.get_world_size()
    out = {}
    try:  # the pool's layout already exists: a second call
        ps.initialize_model_parallel()
    except AssertionError as exc:
        out['second'] = (type(exc).__name__, isinstance(exc, RuntimeError), str(exc))
    try:  # a bad size is reported even though groups exist
        ps.initialize_model_parallel(tensor_model_parallel_size=2 * world)
    except RuntimeError as exc:
        out['size'] = (isinstance(exc, ValueError), str(exc))
    orders = {}
    for order in ('tp-cp-ep-dp-pp', 'tp-cp-pp-ep-dp', 'tp-pp-dp', 'tp-ep-dp-cp-pp'):
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order=order
        )
        orders[order] = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank(),
        )
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    out['orders'] = orders
    return out


def test_second_call_sizes_and_orders_as_megatron():
    outs = run_distributed(_second_call_and_orders, world_size=4, tp=2, pp=2)
    for rank, out in enumerate(outs):
        name, is_runtime, msg = out['second']
        assert name == 'ModelParallelInitError' and is_runtime and 'called twice' in msg
        is_value, msg = out['size']
        assert is_value and 'world_size (4) is not divisible' in msg
        # tp fastest: rank = tp + 2 * pp for tp-...-pp, tp + 2 * dp when pp is slowest.
        tp, pp, dp = out['orders']['tp-cp-ep-dp-pp']
        assert (tp, pp, dp) == (rank % 2, rank // 2, 0)
        assert out['orders']['tp-cp-pp-ep-dp'] == (rank % 2, rank // 2, 0)
        assert out['orders']['tp-pp-dp'] == (rank % 2, rank // 2, 0)
        assert out['orders']['tp-ep-dp-cp-pp'] == (rank % 2, rank // 2, 0)


def test_rampup_consistency_error_is_also_an_assertion_error():
    import megatron.core.num_microbatches_calculator as nmc

    nmc.reconfigure_num_microbatches_calculator(0, [16, 8, 96], 32, 8, 2)
    try:
        assert nmc.get_micro_batch_size() == 8
        with pytest.raises(AssertionError, match=r'current global batch size \(24\)') as err:
            nmc.update_num_microbatches(49, True)
        assert isinstance(err.value, ValueError)
        nmc.update_num_microbatches(49, False)  # no check: no raise
        assert nmc.get_current_global_batch_size() == 24 and nmc.get_num_microbatches() == 1
    finally:
        nmc.destroy_num_microbatches_calculator()


def test_scheduler_takes_its_own_active_pool_back():
    from megatron.core.inference.common_inference_params import CommonInferenceParams
    from megatron.core.inference.inference_request import Status
    from megatron.core.inference.scheduler import Scheduler

    scheduler = Scheduler(max_batch_size=4)
    for _ in range(5):
        scheduler.add_request('p', torch.arange(3), CommonInferenceParams())
    pool = scheduler.active_request_pool
    assert isinstance(pool, OrderedDict) and list(pool) == ['0', '1', '2', '3']
    for request_id, request in pool.items():
        if int(request_id) % 2 == 0:
            request.status = Status.COMPLETED
    scheduler.update_requests_pools(pool)  # the pool itself, as Megatron's callers pass it
    assert list(scheduler.completed_request_pool) == ['0', '2']
    assert list(scheduler.active_request_pool) == ['1', '3', '4']
    assert not scheduler.waiting_request_pool


def test_causal_softmax_asserts_square_scores_and_attention_masks_the_rest():
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax, causal_mask_for_queries
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(
        False, False, AttnMaskType.causal, False, attention_mask_func, True, None
    )
    with pytest.raises(AssertionError, match='causal mask is only for self attention'):
        softmax(torch.randn(1, 1, 4, 16), None)
    probs = softmax(torch.zeros(2, 1, 4, 4), None)
    expected = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5).view(-1, 1)
    torch.testing.assert_close(probs[1, 0], expected)
    assert softmax(torch.zeros(1, 1, 1, 5), None).allclose(torch.full((1, 1, 1, 5), 0.2))
    # Two queries after three cached keys: query i sees keys 0 .. 3 + i.
    mask = causal_mask_for_queries(2, 5, torch.device('cpu'))
    assert mask.tolist() == [[False] * 4 + [True], [False] * 5]
    probs = softmax(torch.zeros(1, 1, 2, 5), mask)
    torch.testing.assert_close(probs[0, 0, 0], torch.tensor([0.25] * 4 + [0.0]))
