"""The rerun state machine: verdicts and exit codes for each injected fault type and for real
NaNs, the rerun replaying the same data and random state, the non-fatal path continuing with the
same gradients as an uninjected step, the disabled and statistics modes, and its checkpointed
state (plain values, loadable with weights_only)."""

import io
import math

import pytest
import torch

from megatron.core import rerun_state_machine as rsm
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
)

NAN_MESSAGE = 'found NaN in local forward loss calculation'


def _machine(mode=RerunMode.VALIDATE_RESULTS, rate=0, kind=RerunDiagnostic.TRANSIENT_ERROR):
    rsm.initialize_rerun_state_machine(
        mode=mode, error_injector=RerunErrorInjector(rate, kind, seed=0)
    )
    return rsm.get_rerun_state_machine()


def _batches(n, nan_at=None):
    gen = torch.Generator().manual_seed(0)
    out = [torch.randn(4, 8, generator=gen) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][0, 0] = math.nan
    return iter(out)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        # Dropout draws from torch's CPU generator: a rerun must restore it to match.
        return torch.nn.functional.dropout(self.lin(x), p=0.5, training=True).sum()


def _step(machine, model, iterator, spiky=False, fatal=True):
    """One training step through the machine; returns (verdict, [loss of each run], grad)."""
    losses = []
    while machine.should_run_forward_backward(iterator):
        model.zero_grad()
        loss = model(next(iterator))
        losses.append(loss.item())
        if spiky:
            machine.validate_result(
                loss.detach(),
                rejection_func=lambda v: False,
                message='Spiky loss',
                fatal=False,
            )
        else:
            machine.validate_result(loss.detach(), torch.isnan, NAN_MESSAGE, fatal=fatal)
        loss.backward()
    return machine.should_checkpoint_and_exit(), losses, model.lin.weight.grad.clone()


def test_transient_fault_exits_17_after_an_identical_rerun():
    machine = _machine(rate=1)
    model, it = _Model(), RerunDataIterator(_batches(4))
    verdict, losses, _ = _step(machine, model, it)
    assert verdict == (False, False, 0) and len(losses) == 1  # first step never validated
    verdict, losses, _ = _step(machine, model, it)
    assert verdict == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert machine.diagnostic == RerunDiagnostic.TRANSIENT_ERROR
    # The rerun had the same micro-batch and the same dropout mask.
    assert len(losses) == 2 and losses[0] == losses[1]


def test_non_fatal_fault_continues_with_the_uninjected_gradients():
    reference = _machine(rate=0)
    model, it = _Model(), RerunDataIterator(_batches(4))
    expected = [_step(reference, model, it, spiky=True)[2] for _ in range(3)]
    machine = _machine(rate=1)
    model, it = _Model(), RerunDataIterator(_batches(4))
    for step in range(3):
        verdict, losses, grad = _step(machine, model, it, spiky=True)
        assert verdict == (False, False, 0)
        assert len(losses) == (1 if step == 0 else 2)
        torch.testing.assert_close(grad, expected[step], rtol=0, atol=0)
    assert machine.diagnostic == RerunDiagnostic.TRANSIENT_ERROR


def _resume(saved, other_device):
    """A new job taking over `saved` (a state_dict through torch.save / weights_only load)."""
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    if other_device:
        state['suspicious_device'] = state['suspicious_device'] + 1
    machine = _machine(rate=0)
    machine.load_state_dict(state)
    return machine


@pytest.mark.parametrize(
    'kind, diagnostic',
    [
        (RerunDiagnostic.PERSISTENT_ERROR, RerunDiagnostic.PERSISTENT_ERROR),
        (RerunDiagnostic.CORRECT_RESULT, RerunDiagnostic.CORRECT_RESULT),
    ],
)
def test_reproducible_fault_checkpoints_16_then_attributes_on_another_device(kind, diagnostic):
    machine = _machine(rate=1, kind=kind)
    model, it = _Model(), RerunDataIterator(_batches(4))
    _step(machine, model, it)
    verdict, losses, _ = _step(machine, model, it)
    assert verdict == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert machine.state == RerunState.WILL_RERUN_FROM_CHECKPOINT and machine.diagnostic is None
    saved = machine.state_dict()

    # Resumed on the same node and device: nothing can be concluded, exit 16 again.
    again = _resume(saved, other_device=False)
    verdict, _, _ = _step(again, _Model(), RerunDataIterator(_batches(4)))
    assert verdict == (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert again.diagnostic is None

    elsewhere = _resume(saved, other_device=True)
    verdict, _, _ = _step(elsewhere, _Model(), RerunDataIterator(_batches(4)))
    assert verdict == (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
    assert elsewhere.diagnostic == diagnostic


def test_real_nan_is_reproducible_and_asks_for_a_checkpoint():
    machine = _machine()
    model, it = _Model(), RerunDataIterator(_batches(4, nan_at=1))
    _step(machine, model, it)
    verdict, losses, _ = _step(machine, model, it)
    assert verdict == (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
    assert len(losses) == 2 and all(math.isnan(v) for v in losses)
    assert machine.state_dict()['failed_validation_call'] == [NAN_MESSAGE, 1]


def test_first_step_is_not_validated_and_disabled_mode_raises():
    machine = _machine()
    verdict, losses, _ = _step(machine, _Model(), RerunDataIterator(_batches(2, nan_at=0)))
    assert verdict == (False, False, 0) and len(losses) == 1
    machine = _machine(mode=RerunMode.DISABLED)
    with pytest.raises(RuntimeError, match="Unexpected result nan .message='found NaN"):
        _step(machine, _Model(), _batches(2, nan_at=0))


def test_determinism_stats_mode_runs_every_step_twice():
    machine = _machine(mode=RerunMode.REPORT_DETERMINISM_STATS)
    model, it = _Model(), RerunDataIterator(_batches(4))
    for _ in range(3):
        verdict, losses, _ = _step(machine, model, it)
        assert verdict == (False, False, 0) and len(losses) == 2 and losses[0] == losses[1]
    assert machine.stats[NAN_MESSAGE].identical == 3


def test_unexpectedly_large_calibrates_on_the_first_samples():
    machine = _machine()
    for v in (1.0, 3.0, 2.0):
        assert not machine.is_unexpectedly_large(torch.tensor(v), 10, 'loss', num_samples=3)
    assert not machine.is_unexpectedly_large(torch.tensor(29.0), 10, 'loss', num_samples=3)
    assert machine.is_unexpectedly_large(torch.tensor(30.0), 10, 'loss', num_samples=3)
    assert not machine.is_unexpectedly_large(torch.tensor(math.inf), 10, 'loss', num_samples=3)


def test_injection_rate_is_about_one_in_n():
    injector = RerunErrorInjector(4, RerunDiagnostic.TRANSIENT_ERROR, seed=0)
    hits = 0
    for _ in range(4000):
        hits += injector.maybe_inject()
        injector.injected_error_type = None  # a new step
    assert 0.22 < hits / 4000 < 0.28


def test_both_spellings_of_the_statistics_mode_parse():
    from megatron.training.cli.arguments_parser import get_args_parser
    from megatron.training.run_control.rerun_training import rerun_mode

    parser = get_args_parser()
    for spelling in ('report_stats', 'report_determinism_stats'):
        args = parser.parse_args(['--rerun-mode', spelling])
        assert rerun_mode(args) == RerunMode.REPORT_DETERMINISM_STATS


def test_rerun_asked_by_another_rank_gives_no_verdict_here(tmp_path):
    tracker = str(tmp_path / 'rejected.txt')
    rsm.initialize_rerun_state_machine(
        mode=RerunMode.VALIDATE_RESULTS,
        error_injector=RerunErrorInjector(1, RerunDiagnostic.TRANSIENT_ERROR, seed=0),
        result_rejected_tracker_filename=tracker,
    )
    machine = rsm.get_rerun_state_machine()
    model, it = _Model(), RerunDataIterator(_batches(4))
    _step(machine, model, it, spiky=True)
    _step(machine, model, it, spiky=True)  # this rank's own (injected) failure, attributed
    machine.error_injector.error_injection_rate = 0
    # Next step: only another rank failed; the world-wide OR makes this rank rerun too.
    machine._reduce_any = lambda *flags: (True,) * len(flags)
    verdict, losses, _ = _step(machine, model, it, spiky=True)
    assert verdict == (False, False, 0) and len(losses) == 2
    with open(tracker) as f:
        statuses = [line.split(' status=')[1].split()[0] for line in f]
    assert statuses == ['initial_run', 'first_rerun_not_reproducible']


def _nan_gradient_bucket(mode):
    """A DDP-wrapped linear layer whose gradient is NaN, through the bucket check."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.model_parallel_config import ModelParallelConfig

    machine = _machine(mode=mode)
    torch.manual_seed(0)
    chunk = DistributedDataParallel(
        ModelParallelConfig(),
        DistributedDataParallelConfig(check_for_nan_in_grad=True),
        torch.nn.Linear(4, 2),
    )
    it = RerunDataIterator(iter([torch.randn(3, 4), torch.full((3, 4), math.nan)] * 2))
    verdicts = []
    for _ in range(2):
        try:
            while machine.should_run_forward_backward(it):
                chunk.zero_grad_buffer()
                chunk(next(it)).sum().backward()
                chunk.finish_grad_sync()
        except RuntimeError as exc:
            return str(exc)
        verdicts.append(machine.should_checkpoint_and_exit())
    return verdicts


def test_nan_gradient_goes_through_the_machine():
    from tests.unit_tests.dist_utils import run_distributed

    (raised,) = run_distributed(_nan_gradient_bucket, world_size=1, args=(RerunMode.DISABLED,))
    assert "Unexpected result nan (message='found NaN in local grad norm for bucket" in raised
    (verdicts,) = run_distributed(
        _nan_gradient_bucket, world_size=1, args=(RerunMode.VALIDATE_RESULTS,)
    )
    # A NaN gradient reproduces: checkpoint and exit 16.
    assert verdicts == [(False, False, 0), (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)]
