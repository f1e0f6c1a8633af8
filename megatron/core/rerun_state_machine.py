"""The rerun state machine (later Megatron's `megatron/core/rerun_state_machine.py`, v0.10+).

A training step whose loss or gradients look wrong (NaN, Inf, a spike) is run again in place,
on the same data and from the same random state, to attribute the fault:

- the rerun gives another result: a transient fault (exit `EXIT_CODE_FAILED_ON_RESULT_VALIDATION`
  = 17 when the check is fatal; a non-fatal check carries on with the rerun's gradients);
- the rerun gives the same result: a checkpoint is saved (optimizer not stepped) and the job exits
  with `EXIT_CODE_RESUME_TO_DISAMBIGUATE` = 16, to be resumed on another device; there, another
  result means a persistent fault of the first device, the same result a correct (if unexpected)
  result; both exit 17. Resumed on the same node and device, it exits 16 again.

The step loop of the training layer drives it::

    while machine.should_run_forward_backward(data_iterator):
        zero the gradients; forward and backward (loss functions call validate_result)
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()

Unlike Megatron's, nothing here needs CUDA: the random state saved per step is Python's, NumPy's,
torch's CPU generator, the CUDA generators when CUDA is in use, and the tensor-parallel RNG
tracker's states; the any-rank agreement is an all-reduce on the device of
`megatron.core.device`'s policy (CPU with gloo). The device of a rank is
`torch.cuda.current_device()` on a GPU and its local rank otherwise. The machine's own state
(`state_dict`) holds only plain containers, strings, numbers and tensors, so it loads with
`torch.load(weights_only=True)`.
"""

import datetime
import logging
import math
import os
import random
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: Exit code when the job must be resumed (on another device) to tell a persistent fault from a
#: correct result.
EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16
#: Exit code when a fatal validation failed and its attribution is complete.
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17

#: Comparison values meaning "the same" and "different" (relative difference).
COMPARISON_MATCH: float = 0.0
COMPARISON_MISMATCH: float = math.inf


class RerunDiagnostic(str, Enum):
    """What a failed validation was attributed to."""

    CORRECT_RESULT = 'correct_result'  # reproduced on another device: the input's true result
    TRANSIENT_ERROR = 'transient_error'  # not reproduced on the same device
    PERSISTENT_ERROR = 'persistent_error'  # reproduced on the same device, not on another one


class RerunMode(str, Enum):
    """Operating modes (`--rerun-mode`)."""

    DISABLED = 'disabled'
    VALIDATE_RESULTS = 'validate_results'
    REPORT_DETERMINISM_STATS = 'report_determinism_stats'


class RerunState(Enum):
    """Where the machine is within a step (and across a resume)."""

    NOT_RUNNING_YET = 0  # between steps
    INITIAL_RUN = 1  # first forward-backward of the step
    RERUNNING_IN_PLACE = 2  # a validation failed: the same step again on the same device
    WILL_RERUN_FROM_CHECKPOINT = 3  # reproduced: checkpoint, exit 16, resume elsewhere
    RERUNNING_FROM_CHECKPOINT = 4  # the resumed job's run of that step
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5  # resumed on the same device: exit 16 again


class RerunValidationStatus(str, Enum):
    """The status written to the `--result-rejected-tracker-filename` lines."""

    RERUN_DISABLED = 'rerun_disabled'
    INITIAL_RUN = 'initial_run'
    FIRST_RERUN_NOT_REPRODUCIBLE = 'first_rerun_not_reproducible'
    FIRST_RERUN_REPRODUCIBLE = 'first_rerun_reproducible'
    SECOND_RERUN_NOT_REPRODUCIBLE = 'second_rerun_not_reproducible'
    SECOND_RERUN_REPRODUCIBLE = 'second_rerun_reproducible'


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _log_rank_0(level: int, message: str) -> None:
    if _rank() == 0:
        logger.log(level, message)


def current_device_id() -> int:
    """The index identifying this rank's device: the CUDA device, else the local rank."""
    from megatron.core.device import uses_cuda

    if uses_cuda():
        return torch.cuda.current_device()
    return int(os.environ.get('LOCAL_RANK', 0))


def compare_floats(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two 0-dim results; NaN vs NaN and Inf vs Inf of a sign match,
    NaN or Inf against anything else is a mismatch."""
    x, y = float(a), float(b)
    if x == y or (math.isnan(x) and math.isnan(y)):
        return COMPARISON_MATCH
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return COMPARISON_MISMATCH
    return math.fabs(x - y) / max(math.fabs(x + y) / 2.0, 1e-30)


class RerunErrorInjector:
    """Pretends a validation failed, about once every `error_injection_rate` validations of a
    rank (at most once per step), and forces the reruns' comparisons to match the fault type.

    The draw uses a generator of its own (offset by the rank), so injecting does not change the
    training's random streams.
    """

    _NAMES = {
        RerunDiagnostic.CORRECT_RESULT: 'Expected result',
        RerunDiagnostic.TRANSIENT_ERROR: 'Transient error',
        RerunDiagnostic.PERSISTENT_ERROR: 'Persistent error',
    }

    def __init__(
        self,
        error_injection_rate: int = 0,
        error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR,
        seed: int = 0,
    ) -> None:
        assert error_injection_rate >= 0, error_injection_rate
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = RerunDiagnostic(error_injection_type)
        self.injected_error_type: Optional[RerunDiagnostic] = None
        self._generator = random.Random(seed)

    def maybe_inject(self) -> bool:
        """Whether this validation call is to be treated as failed."""
        if self.error_injection_rate <= 0 or self.injected_error_type is not None:
            return False
        draw = self._generator.randrange(self.error_injection_rate) + _rank()
        if draw % self.error_injection_rate != 0:
            return False
        self.injected_error_type = self.error_injection_type
        logger.warning(f'Injecting error type {self._NAMES[self.error_injection_type]}')
        return True

    def maybe_miscompare(
        self, comparison_func: Callable, initial_result: Any, result: Any, state: RerunState
    ) -> float:
        """The comparison of a rerun: forced when an error was injected, else measured."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        assert state == RerunState.RERUNNING_FROM_CHECKPOINT, state
        self.injected_error_type = None
        if injected == RerunDiagnostic.PERSISTENT_ERROR:
            return COMPARISON_MISMATCH
        return COMPARISON_MATCH

    def state_dict(self) -> Dict[str, Any]:
        """Plain values: the rate, the type and the pending injection (None: none)."""
        pending = self.injected_error_type
        return {
            'error_injection_rate': self.error_injection_rate,
            'error_injection_type': self.error_injection_type.value,
            'injected_error_type': None if pending is None else pending.value,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore `state_dict()`'s values."""
        self.error_injection_rate = state_dict['error_injection_rate']
        self.error_injection_type = RerunDiagnostic(state_dict['error_injection_type'])
        pending = state_dict['injected_error_type']
        self.injected_error_type = None if pending is None else RerunDiagnostic(pending)


class RerunDataIterator:
    """A data iterator that records the micro-batches of the current step, so that a rerun of
    the step replays exactly the same data (`rewind`), and forgets them at the next step
    (`advance`)."""

    def __init__(self, iterable) -> None:
        self.iterable = iterable
        self.saved_microbatches: List[Any] = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self.replaying:
            assert self.replay_pos < len(self.saved_microbatches), (
                'a rerun read more micro-batches than the step it repeats'
            )
            batch = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return batch
        batch = next(self.iterable)
        if get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            self.saved_microbatches.append(batch)
        return batch

    def rewind(self) -> None:
        """Replay the step's micro-batches from the first."""
        self.replaying = True
        self.replay_pos = 0

    def advance(self) -> None:
        """Drop the recorded micro-batches; the next step reads new data."""
        self.replaying = False
        self.saved_microbatches = []


class _DeterminismStats:
    """The relative differences between initial runs and reruns of one validation call."""

    def __init__(self) -> None:
        self.samples: List[float] = []
        self.identical = 0

    def record(self, diff: float) -> None:
        if diff == 0.0:
            self.identical += 1
        else:
            self.samples.append(diff)

    def describe(self) -> str:
        total = self.identical + len(self.samples)
        if not self.samples:
            return f'{total:,} samples, all identical'
        ordered = sorted([0.0] * self.identical + self.samples)
        pct = {p: ordered[min(int(total * p), total - 1)] for p in (0.5, 0.9, 0.99, 0.999)}
        return (
            f'{total:,}/{self.identical:,} total/identical samples, rel. variability: '
            f'avg= {sum(self.samples) / total:.3E}, p50= {pct[0.5]:.3E}, p90= {pct[0.9]:.3E}, '
            f'p99= {pct[0.99]:.3E}, p99.9= {pct[0.999]:.3E}, max: {ordered[-1]:.3E}'
        )


def _save_random_state() -> Dict[str, Any]:
    """Every random stream a step may draw from (dropout, sampling, data augmentation)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        'python': random.getstate(),
        'numpy': np.random.get_state(),
        'torch_cpu': torch.get_rng_state(),
        'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        'tracker': {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    return state


def _restore_random_state(state: Dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state['python'])
    np.random.set_state(state['numpy'])
    torch.set_rng_state(state['torch_cpu'])
    if state['cuda'] is not None:
        torch.cuda.set_rng_state_all(state['cuda'])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state['tracker'].items()})


class RerunStateMachine:
    """Validates results of a step and reruns the step to attribute a failed validation.

    One per process (`initialize_rerun_state_machine`, `get_rerun_state_machine`).

    Args:
        state_save_func: returns extra state a rerun must start from (random states are saved
            already); None: nothing more.
        state_restore_func: restores what `state_save_func` returned.
        mode: a RerunMode.
        error_injector: a RerunErrorInjector (default: injects nothing).
        result_rejected_tracker_filename: a file that gets one line per rejected result.
    """

    #: report_determinism_stats logs its statistics every this many iterations.
    REPORTING_INTERVAL_ITERATIONS: int = 2

    def __init__(
        self,
        state_save_func: Optional[Callable[[], Any]] = None,
        state_restore_func: Optional[Callable[[Any], None]] = None,
        mode: RerunMode = RerunMode.DISABLED,
        error_injector: Optional[RerunErrorInjector] = None,
        result_rejected_tracker_filename: Optional[str] = None,
    ) -> None:
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        # No step is validated before one optimizer step exists to checkpoint.
        self.first_iteration_complete = False
        # Per-rank requests, OR-reduced over the world at the decision points.
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.logged_sdc_enabled = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.validation_counts: Dict[str, int] = defaultdict(int)
        self.failed_validation_call: Optional[Tuple[str, int]] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        #: The attribution of the last failed validation (None: none concluded yet).
        self.diagnostic: Optional[RerunDiagnostic] = None
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        if result_rejected_tracker_filename is not None:
            try:
                with open(result_rejected_tracker_filename, 'a'):
                    pass
            except OSError as exc:
                raise RuntimeError(
                    f'RerunStateMachine result validation log cannot be appended to! ({exc})'
                ) from exc
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.saved_state: Optional[Dict[str, Any]] = None
        self.large_value_counts: Dict[str, int] = {}
        self.max_values: Dict[str, float] = {}
        self.saved_results: Dict[Tuple[str, int], Any] = {}
        self.stats: Dict[str, _DeterminismStats] = defaultdict(_DeterminismStats)
        _log_rank_0(logging.WARNING, f'RerunStateMachine initialized in mode {self.mode}')

    # -- mode -------------------------------------------------------------------------------

    def set_mode(self, mode: RerunMode) -> None:
        """Change the mode (evaluation runs with the machine disabled)."""
        self.mode = RerunMode(mode)

    def get_mode(self) -> RerunMode:
        """The current mode."""
        return self.mode

    # -- collectives and state ------------------------------------------------------------

    def _reduce_any(self, *flags: bool) -> Tuple[bool, ...]:
        """Each flag OR-ed over every rank of the world (one all-reduce)."""
        values = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from megatron.core.device import get_current_device

            values = values.to(get_current_device())
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return tuple(bool(v) for v in values.tolist())

    def _save_state(self) -> None:
        self.saved_state = {
            'rng': _save_random_state(),
            'other': self.state_save_func() if self.state_save_func else None,
        }

    def _restore_state(self) -> None:
        assert self.saved_state is not None, 'no step state was saved to restore'
        _restore_random_state(self.saved_state['rng'])
        if self.saved_state['other'] is not None and self.state_restore_func:
            self.state_restore_func(self.saved_state['other'])

    @staticmethod
    def _iterators(data_iterator) -> List[RerunDataIterator]:
        if data_iterator is None:
            return []
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        iterators = [d for d in iterators if d is not None]
        for d in iterators:
            assert isinstance(d, RerunDataIterator), (
                'the rerun state machine needs its data iterators wrapped in RerunDataIterator'
            )
        return iterators

    # -- the step loop --------------------------------------------------------------------

    def should_run_forward_backward(self, data_iterator) -> bool:
        """Whether the step's forward-backward is to run (again); call it as a while condition.

        Args:
            data_iterator: the step's RerunDataIterator, a list of them, or None.
        """
        self.validation_counts = defaultdict(int)
        iterators = self._iterators(data_iterator) if self.mode != RerunMode.DISABLED else []
        if self.state == RerunState.NOT_RUNNING_YET:
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            if self.mode == RerunMode.DISABLED:
                return True
            self._save_state()
            for d in iterators:
                d.advance()
            self.rerun_requested = self.checkpoint_requested = False
            self.restart_again_requested = self.continue_requested = False
            # A rerun that another rank asks for must not compare this rank's results with an
            # older step's failure.
            self.failed_validation_call = self.initial_result = None
            return True
        if self.state == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            (rerun,) = self._reduce_any(self.rerun_requested)
            if not rerun:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if self.mode == RerunMode.VALIDATE_RESULTS:
                _log_rank_0(
                    logging.WARNING, 'Need to rerun step to check reproducibility of initial result'
                )
            self.state = RerunState.RERUNNING_IN_PLACE
            self._restore_state()
            for d in iterators:
                d.rewind()
            return True
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
                self.state = RerunState.NOT_RUNNING_YET
                self._maybe_report_stats()
                self.saved_results = {}
                return False
            will_continue, will_checkpoint = self._reduce_any(
                self.continue_requested, self.checkpoint_requested
            )
            if will_continue:
                _log_rank_0(
                    logging.WARNING,
                    'Continuing normal execution because failed validation was not fatal',
                )
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if will_checkpoint:
                self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            # The checkpoint (or none) is of the state before the step.
            self._restore_state()
            for d in iterators:
                d.rewind()
            return False
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            return True
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            again, will_continue = self._reduce_any(
                self.restart_again_requested, self.continue_requested
            )
            if again:
                _log_rank_0(
                    logging.WARNING,
                    'Need to restart job from the same checkpoint because it was scheduled on '
                    'the same node/GPU',
                )
                self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif will_continue:
                _log_rank_0(
                    logging.WARNING,
                    'Continuing normal execution because failed validation was not fatal',
                )
                self.state = RerunState.NOT_RUNNING_YET
            return False
        raise AssertionError(f'should_run_forward_backward called in state {self.state}')

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(save a checkpoint now, exit now, exit code); call it after the step loop, before the
        optimizer step."""
        self.first_iteration_complete = True
        if self.mode != RerunMode.VALIDATE_RESULTS:
            return False, False, 0
        if self.state == RerunState.RERUNNING_IN_PLACE:
            _log_rank_0(
                logging.WARNING,
                'Exiting now. The job can be resumed from a previous checkpoint',
            )
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            _log_rank_0(
                logging.WARNING,
                'Saving a checkpoint and exiting now. Please resume the job from the checkpoint '
                'to rerun the last iteration and establish a diagnostic',
            )
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            _log_rank_0(
                logging.WARNING,
                'Exiting now. A checkpoint at the last iteration already exists if further '
                'examination is needed',
            )
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            _log_rank_0(
                logging.WARNING,
                'Exiting now. Please resume the job from the same checkpoint to rerun the last '
                'iteration and establish a diagnostic',
            )
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    # -- validation -----------------------------------------------------------------------

    def _where(self) -> str:
        return (
            f'Rank {_rank()}, node {os.uname()[1]}, device {current_device_id()}, '
            f'iteration #{self.current_iteration}'
        )

    def _log_failure(self, message: str, fatal: bool = True) -> None:
        logger.log(logging.ERROR if fatal else logging.WARNING, f'{self._where()}: {message}!')

    def validate_result(
        self,
        result: Any,
        rejection_func: Callable[[Any], bool],
        message: str,
        comparison_func: Optional[Callable[[Any, Any], float]] = None,
        tolerance: float = 0.0,
        fatal: bool = True,
    ) -> None:
        """Check a result of the step; a rejected one makes the step run again.

        Args:
            result: the value (a 0-dim tensor for the default comparison).
            rejection_func: result -> True when it fails validation (e.g. torch.isnan).
            message: names the check; a rerun's call is matched to the initial run's by message
                and by how many calls with that message preceded it in the step.
            comparison_func: (initial, rerun) -> relative difference (default `compare_floats`).
            tolerance: the largest difference that still counts as reproduced.
            fatal: whether the job stops once the fault is attributed (else it continues with
                the rerun's result).
        """
        if self.mode == RerunMode.DISABLED:
            if rejection_func(result):
                self._log_to_file(RerunValidationStatus.RERUN_DISABLED, result, message)
                text = (
                    f'Rank {_rank()}, node {os.uname()[1]}, device {current_device_id()}, '
                    f'iteration {self.current_iteration}: Unexpected result {result} '
                    f"(message='{message}')"
                )
                if fatal:
                    raise RuntimeError(text)
                logger.warning(text)
            return
        comparison_func = comparison_func or compare_floats
        assert self.state != RerunState.NOT_RUNNING_YET, (
            'validate_result is called inside the forward-backward loop only'
        )
        self.validation_counts[message] += 1
        call = (message, self.validation_counts[message])

        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.rerun_requested = True
                self.saved_results[call] = result
            elif self.state == RerunState.RERUNNING_IN_PLACE:
                assert call in self.saved_results, 'the rerun made a call the initial run did not'
                self.stats[message].record(comparison_func(self.saved_results[call], result))
            return

        if not self.logged_sdc_enabled:
            self.logged_sdc_enabled = True
            _log_rank_0(logging.WARNING, 'Result validation enabled')

        if self.state == RerunState.INITIAL_RUN:
            if self.rerun_requested or not self.first_iteration_complete:
                return
            if self.error_injector.maybe_inject() or rejection_func(result):
                self.failed_validation_call = call
                self.initial_result = result
                self.rerun_requested = True
                self._log_to_file(RerunValidationStatus.INITIAL_RUN, result, message)
                logger.error(
                    f'Unexpected result {result} on rank {_rank()} at iteration '
                    f"#{self.current_iteration} invocation #{call[1]} (message='{message}')"
                )
            return
        if call != self.failed_validation_call:
            return
        comparison = self.error_injector.maybe_miscompare(
            comparison_func, self.initial_result, result, self.state
        )
        if self.state == RerunState.RERUNNING_IN_PLACE:
            self._first_rerun_verdict(result, message, comparison > tolerance, fatal)
        elif self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            self._second_rerun_verdict(result, message, comparison > tolerance, fatal)

    def _first_rerun_verdict(self, result, message: str, differs: bool, fatal: bool) -> None:
        if differs:
            self.diagnostic = RerunDiagnostic.TRANSIENT_ERROR
            self.continue_requested = self.continue_requested or not fatal
            self._log_failure(
                'First rerun: unexpected result is not reproducible within the tolerance '
                f'({result} != {self.initial_result})',
                fatal=fatal,
            )
            self._log_to_file(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, result, message)
            self._log_failure('Possible transient error!', fatal=fatal)
            return
        if fatal:
            self.checkpoint_requested = True
        else:
            self.continue_requested = True
        self.suspicious_node = os.uname()[1]
        self.suspicious_device = current_device_id()
        self._log_to_file(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, result, message)
        self._log_failure(
            'First rerun: unexpected result is reproducible within the tolerance '
            f'({result} = {self.initial_result}). Need to rerun on a different GPU to verify '
            'correctness.',
            fatal=fatal,
        )

    def _second_rerun_verdict(self, result, message: str, differs: bool, fatal: bool) -> None:
        if os.uname()[1] == self.suspicious_node and current_device_id() == self.suspicious_device:
            logger.error(
                'Got rescheduled on the same GPU. Need to resume again from the same checkpoint '
                f'(node: {self.suspicious_node}, gpu: {self.suspicious_device})'
            )
            self.restart_again_requested = True
            return
        if differs:
            self.diagnostic = RerunDiagnostic.PERSISTENT_ERROR
            self._log_to_file(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, result, message)
            logger.warning(
                'Second rerun: unexpected result is not reproducible on a different GPU, '
                f'therefore was likely incorrect ({result} != {self.initial_result})'
            )
            self._log_failure('Possible persistent error!')
        else:
            self.diagnostic = RerunDiagnostic.CORRECT_RESULT
            self._log_to_file(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, result, message)
            logger.warning(
                'Second rerun: unexpected result is reproducible on a different GPU, therefore '
                f'it was likely correct ({result} = {self.initial_result})'
            )
            self._log_failure(f'Correct result (but possible Application error) ({message})')
        if not fatal:
            self.continue_requested = True

    def is_unexpectedly_large(
        self,
        result: torch.Tensor,
        threshold: float,
        context: str,
        num_samples: int = 100,
        resample: bool = False,
    ) -> bool:
        """A rejection function: True when |result| is at least `threshold` times the largest
        |value| of the first `num_samples` values seen under `context` (those only calibrate).
        NaN and Inf are left to their own checks (False)."""
        value = math.fabs(float(result))
        if math.isnan(value) or math.isinf(value):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if self.large_value_counts[context] == num_samples:
                logger.warning(f'Max value for {context}: {self.max_values[context]}')
            return False
        return value >= self.max_values[context] * threshold

    # -- reporting ------------------------------------------------------------------------

    def _log_to_file(self, status: RerunValidationStatus, result: Any, message: str) -> None:
        if self.result_rejected_tracker_filename is None:
            return
        try:
            with open(self.result_rejected_tracker_filename, 'a') as f:
                f.write(
                    f'ts={datetime.datetime.now()} node={os.uname()[1]} '
                    f'device={current_device_id()} jobID={os.getenv("SLURM_JOBID", "N/A")} '
                    f'rank={_rank()} iteration={self.current_iteration} status={status.value} '
                    f"result={result} message='{message}'\n"
                )
        except OSError as exc:
            logger.error(f'Could not log validation error! ({exc})')

    def _maybe_report_stats(self) -> None:
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        gathered = [dict(self.stats)]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, dict(self.stats))
        if _rank() != 0:
            return
        logger.info('Stats on computation determinism in validation calls')
        merged: Dict[str, _DeterminismStats] = defaultdict(_DeterminismStats)
        for per_rank in gathered:
            for message, stats in per_rank.items():
                merged[message].samples += stats.samples
                merged[message].identical += stats.identical
        for message, stats in sorted(merged.items()):
            logger.info(f'  {message}: {stats.describe()}')

    # -- checkpointing --------------------------------------------------------------------

    def state_dict(self, data_iterator=None, force: bool = False) -> Optional[Dict[str, Any]]:
        """This rank's state for a checkpoint, or None between steps (nothing to rerun).

        Plain values only: enums as their values, the failed call as [message, count]."""
        if not force and self.state == RerunState.NOT_RUNNING_YET:
            return None
        failed = self.failed_validation_call
        saved = {'mode': self.mode.value, 'state': self.state.name}
        saved.update((name, getattr(self, name)) for name in _COPIED_AS_IS)
        return {
            **saved,
            'error_injector_checkpoint': self.error_injector.state_dict(),
            'failed_validation_call': None if failed is None else [failed[0], failed[1]],
            'initial_result': self.initial_result,
            'suspicious_node': self.suspicious_node,
            'suspicious_device': self.suspicious_device,
            'large_value_counts': dict(self.large_value_counts),
            'max_values': dict(self.max_values),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take over a checkpoint's state (the resumed job reruns the saved step)."""
        if self.mode == RerunMode.DISABLED:
            _log_rank_0(
                logging.WARNING,
                'RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint',
            )
            return
        _log_rank_0(
            logging.WARNING, 'Getting RerunStateMachine state from checkpoint. Will rerun step.'
        )
        self.mode = RerunMode(state_dict['mode'])
        self.state = RerunState[state_dict['state']]
        for name in _COPIED_AS_IS:
            setattr(self, name, state_dict[name])
        self.error_injector.load_state_dict(state_dict['error_injector_checkpoint'])
        failed = state_dict['failed_validation_call']
        self.failed_validation_call = None if failed is None else (failed[0], int(failed[1]))
        self.initial_result = state_dict['initial_result']
        self.suspicious_node = state_dict['suspicious_node']
        self.suspicious_device = state_dict['suspicious_device']
        self.large_value_counts = dict(state_dict['large_value_counts'])
        self.max_values = dict(state_dict['max_values'])
        # The resumed job rerun is a step of a job whose first optimizer step exists.
        self.first_iteration_complete = True


# Checkpoint keys whose value is the attribute of the same name, unconverted.
_COPIED_AS_IS = (
    'current_iteration',
    'rerun_requested',
    'checkpoint_requested',
    'restart_again_requested',
    'continue_requested',
)

_GLOBAL_RERUN_STATE_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(**kwargs) -> None:
    """Create the process's machine (RerunStateMachine's arguments); replaces an older one."""
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine(**kwargs)


def destroy_rerun_state_machine() -> None:
    """Forget the process's machine."""
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = None


def get_rerun_state_machine() -> RerunStateMachine:
    """The process's machine (a disabled one when none was initialized)."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine()
    return _GLOBAL_RERUN_STATE_MACHINE
