"""p2p communication on a pipeline group passed in (`pp_group=`), not the global one.

Four gloo ranks with global pipeline size 1; pipelines [0, 2] and [1, 3] are new groups. Stage 0
of each sends an activation forward and stage 1 a gradient back, in the unbatched and the batched
paths; the receivers check they got their own pipeline's tensors. With the global (size-1) group
every rank would be both first and last stage and nothing would be exchanged.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

PIPELINES = ([0, 2], [1, 3])
SHAPE = [4, 2, 3]  # [s, b, h]


def _exchange(batch_p2p_comm):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    rank = torch.distributed.get_rank()
    groups = [torch.distributed.new_group(ranks) for ranks in PIPELINES]
    pp_group = groups[rank % 2]
    stage = pp_group.rank()
    config = ModelParallelConfig(pipeline_dtype=torch.float32, batch_p2p_comm=batch_p2p_comm)
    activation = torch.full(SHAPE, 10.0 + rank)
    grad = torch.full(SHAPE, 100.0 + rank)
    out = {"stage": stage}
    if stage == 0:
        p2p.send_forward(activation, config, pp_group=pp_group)
        out["grad"] = p2p.recv_backward(SHAPE, config, pp_group=pp_group)
        out["input"] = p2p.recv_forward(SHAPE, config, pp_group=pp_group)
    else:
        out["input"] = p2p.recv_forward(SHAPE, config, pp_group=pp_group)
        p2p.send_backward(grad, config, pp_group=pp_group)
        out["grad"] = p2p.recv_backward(SHAPE, config, pp_group=pp_group)
    # Both directions in one step.
    sent_act = activation if stage == 0 else None
    sent_grad = grad if stage == 1 else None
    out["both"] = p2p.send_forward_backward_recv_forward_backward(
        sent_act,
        sent_grad,
        recv_prev=stage == 1,
        recv_next=stage == 0,
        tensor_shape=SHAPE,
        config=config,
        pp_group=pp_group,
    )
    return out


@pytest.mark.parametrize("batch_p2p_comm", [True, False])
def test_p2p_on_explicit_pp_group(batch_p2p_comm):
    outs = run_distributed(_exchange, world_size=4, args=(batch_p2p_comm,))
    for rank, out in enumerate(outs):
        peer = PIPELINES[rank % 2][1 - out["stage"]]
        if out["stage"] == 0:
            assert out["input"] is None  # first stage receives nothing forward
            assert torch.equal(out["grad"], torch.full(SHAPE, 100.0 + peer))
            assert out["both"][0] is None
            assert torch.equal(out["both"][1], torch.full(SHAPE, 100.0 + peer))
        else:
            assert out["grad"] is None  # last stage receives nothing backward
            assert torch.equal(out["input"], torch.full(SHAPE, 10.0 + peer))
            assert torch.equal(out["both"][0], torch.full(SHAPE, 10.0 + peer))
            assert out["both"][1] is None
