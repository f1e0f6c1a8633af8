"""megatron.core.utils.StragglerDetector (Megatron's context-manager API) and
check_param_hashes_across_dp_replicas, on gloo ranks."""

import logging
import time

import pytest
import torch

from megatron.core.utils import StragglerDetector, check_param_hashes_across_dp_replicas
from tests.unit_tests.dist_utils import run_distributed


def test_singleton_and_no_op_until_enabled():
    stimer = StragglerDetector()
    assert StragglerDetector() is stimer
    stimer.configure(1, 0, port=None, enabled=False)
    with stimer:
        time.sleep(0.01)
    assert stimer.elapsed() == (0.0, 0.0)
    assert stimer.report(1e12, 1) is False


def test_compute_and_data_sections_are_timed_apart(caplog):
    stimer = StragglerDetector()
    stimer.configure(1, 0, port=None, enabled=True)
    try:
        with stimer(bdata=True):
            time.sleep(0.02)
        with stimer:
            time.sleep(0.05)
        compute_ms, data_ms = stimer.elapsed()
        assert 45 <= compute_ms < 1000 and 15 <= data_ms < 1000
        with caplog.at_level(logging.INFO, logger='megatron.core.utils'):
            assert stimer.report(total_flops=2e12, log_interval=2) is True
        line = caplog.records[-1].getMessage()
        # 1e12 flops per iteration in ~25 ms per iteration: about 40 TFLOP/s on rank 0.
        etpt = float(line.split('MnEtpt/Rnk: ')[1].split('TF/')[0])
        assert etpt == pytest.approx(1e12 / (compute_ms / 2 * 1e9), rel=1e-2)
        assert line.split('MnRtt/Rnk: ')[1].startswith(f'{compute_ms / 2:.2f}ms/0')
        assert stimer.elapsed() == (0.0, 0.0)  # report() starts a new interval
    finally:
        stimer.configure(1, 0, port=None, enabled=False)


def _straggler_body():
    rank = torch.distributed.get_rank()
    stimer = StragglerDetector()
    stimer.configure(2, rank, mmcnt=2, port=None, enabled=True)
    with stimer:
        time.sleep(0.02 if rank == 0 else 0.12)  # rank 1 is the straggler
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger('megatron.core.utils')
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        reported = stimer.report(total_flops=1e12, log_interval=1)
    finally:
        logger.removeHandler(handler)
        stimer.configure(1, 0, port=None, enabled=False)
    return reported, lines


def test_report_names_the_slow_rank():
    (rep0, lines0), (rep1, lines1) = run_distributed(_straggler_body, world_size=2)
    assert rep0 and rep1 and lines1 == []
    line = lines0[0]
    assert line.split('MxRtt/Rnk: ')[1].split(' |')[0].endswith('ms/1')
    assert line.split('MnRtt/Rnk: ')[1].split(' |')[0].endswith('ms/0')
    assert line.split('MnEtpt/Rnk: ')[1].split(' |')[0].endswith('TF/1')
    assert lines0[1].startswith('^^^^ Bottom 2 Ranks with lowest  Etpt(TF): ')
    assert lines0[1].split(': ')[1].split(' | ')[0].endswith('TF/1')


def _hash_body(perturb_rank):
    model = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    torch.manual_seed(7)
    for chunk in model:
        for p in chunk.parameters():
            p.data.copy_(torch.randn_like(p))
    if torch.distributed.get_rank() == perturb_rank:
        with torch.no_grad():
            model[1].bias[0] += 1e-6
    return check_param_hashes_across_dp_replicas(model)


def test_weight_hashes_match_only_for_identical_replicas():
    assert run_distributed(_hash_body, world_size=2, args=(-1,)) == [True, True]
    # Rank 1 differs from DP rank 0 by one ulp-scale change in one bias.
    assert run_distributed(_hash_body, world_size=2, args=(1,)) == [True, False]


def _toggle_body():
    import socket

    from megatron.core.utils import StragglerDetector

    rank = torch.distributed.get_rank()
    detector = StragglerDetector()
    detector.configure(2, rank, port=0, enabled=True)
    try:
        if rank == 0:
            with socket.create_connection(('127.0.0.1', detector.controller.port), timeout=5) as c:
                c.sendall(b'GET / HTTP/1.0\r\n\r\n')
                c.settimeout(5)
                reply = c.recv(1024).decode()
        else:
            reply = None
            assert detector.controller is None  # only rank 0 listens
        torch.distributed.barrier()
        before = detector.enabled
        detector.report(1.0, 1)  # rank 0's flip is broadcast: both switch off together
        return reply, before, detector.enabled
    finally:
        detector.stop_controller()
        detector.configure(1, 0, port=None)


def test_controller_flip_reaches_every_rank_at_the_same_report():
    (reply, before0, after0), (_, before1, after1) = run_distributed(_toggle_body, world_size=2)
    assert 'Will turn StragglerDetector OFF' in reply
    assert (before0, after0, before1, after1) == (True, False, True, False)
