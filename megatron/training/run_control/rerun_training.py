"""The rerun state machine in the training loop (later Megatron's `--rerun-mode` wiring).

- `initialize_rerun_state_machine_from_args`: the machine of the run (`--rerun-mode`,
  `--error-injection-rate`, `--error-injection-type`, `--result-rejected-tracker-filename`).
- `wrap_train_data_iterators`: training iterators record each step's micro-batches, so that a
  rerun replays them (evaluation runs with the machine disabled).
- `run_forward_backward`: the step's forward-backward inside the machine's while loop, and its
  (should_checkpoint, should_exit, exit_code) verdict, taken before the optimizer steps.
- `validate_loss`: the loss checks of the loss functions: NaN and Inf (fatal, with
  `--check-for-nan-in-loss-and-grad`, on by default) and spikes (`--check-for-spiky-loss`,
  non-fatal).
- `save_rerun_state` / `load_rerun_state`: each rank's machine state in
  `iter_XXXXXXX/rerun_state_machine/rank_XXXXX.pt` of a checkpoint the machine asked for, read
  back on resume (both checkpoint formats; Megatron keeps it in torch_dist only).
"""

import os
from functools import partial

import torch

from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)

#: Megatron's `--rerun-mode` choice that its enum spells `report_determinism_stats`.
_MODE_ALIASES = {'report_stats': RerunMode.REPORT_DETERMINISM_STATS.value}

#: A loss at least this many times the largest of the first 100 losses is a spike.
SPIKY_LOSS_FACTOR = 10


def rerun_mode(args) -> RerunMode:
    """The RerunMode of `--rerun-mode` (both spellings of the statistics mode)."""
    return RerunMode(_MODE_ALIASES.get(args.rerun_mode, args.rerun_mode))


def initialize_rerun_state_machine_from_args(args) -> None:
    """(Re)create the process's machine from the run's flags."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    initialize_rerun_state_machine(
        mode=rerun_mode(args),
        error_injector=RerunErrorInjector(
            error_injection_rate=args.error_injection_rate,
            error_injection_type=RerunDiagnostic(args.error_injection_type),
            seed=args.seed + rank,
        ),
        result_rejected_tracker_filename=args.result_rejected_tracker_filename,
    )


def wrap_train_data_iterators(iterators):
    """The training iterator(s) wrapped in RerunDataIterator (None and a list of them stay so)."""
    if isinstance(iterators, list):
        return [None if it is None else RerunDataIterator(it) for it in iterators]
    return None if iterators is None else RerunDataIterator(iterators)


def run_forward_backward(run_once, data_iterator):
    """`run_once()` (zero the gradients, forward and backward of every micro-batch, returning
    the micro-batch losses) until the machine is satisfied.

    Returns:
        (losses of the last run, should_checkpoint, should_exit, exit_code).
    """
    machine = get_rerun_state_machine()
    losses = None
    while machine.should_run_forward_backward(data_iterator):
        losses = run_once()
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    return losses, should_checkpoint, should_exit, exit_code


def validate_loss(args, loss: torch.Tensor) -> None:
    """The loss function's checks of this rank's loss (before any data-parallel reduction)."""
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        machine.validate_result(
            result=loss,
            rejection_func=torch.isnan,
            message='found NaN in local forward loss calculation',
            tolerance=0.0,
            fatal=True,
        )
        machine.validate_result(
            result=loss,
            rejection_func=torch.isinf,
            message='found Inf in local forward loss calculation',
            tolerance=0.0,
            fatal=True,
        )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context='loss'
            ),
            message='Spiky loss',
            tolerance=0.0,
            fatal=False,
        )


class evaluation_without_reruns:
    """Context: the machine disabled (evaluation steps are not validated), mode restored."""

    def __enter__(self):
        machine = get_rerun_state_machine()
        self._mode = machine.get_mode()
        machine.set_mode(RerunMode.DISABLED)
        return self

    def __exit__(self, *exc):
        get_rerun_state_machine().set_mode(self._mode)
        return False


def _state_file(checkpoint_dir: str, iteration: int) -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return os.path.join(
        checkpoint_dir,
        'iter_{:07d}'.format(iteration),
        'rerun_state_machine',
        f'rank_{rank:05d}.pt',
    )


def save_rerun_state(save_dir: str, iteration: int) -> None:
    """Write this rank's machine state next to the checkpoint of `iteration` (a checkpoint the
    machine asked for; nothing between steps)."""
    state = get_rerun_state_machine().state_dict()
    if state is None:
        return
    path = _state_file(save_dir, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + '.tmp'
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_rerun_state(load_dir: str, iteration: int) -> bool:
    """Take over the machine state saved with the checkpoint of `iteration`, if any.

    Returns:
        True when a saved state was found (the resumed job reruns that step).
    """
    path = _state_file(load_dir, iteration)
    if not os.path.isfile(path):
        return False
    state = torch.load(path, map_location='cpu', weights_only=True)
    machine = get_rerun_state_machine()
    machine.load_state_dict(state)
    return machine.state != RerunState.NOT_RUNNING_YET


class RerunExit(Exception):
    """Raised by the training step when the machine ends the job (before the optimizer step);
    the training loop saves the checkpoint it asks for and exits with its code."""

    def __init__(self, should_checkpoint: bool, exit_code: int):
        super().__init__(f'rerun state machine exit {exit_code}')
        self.should_checkpoint = should_checkpoint
        self.exit_code = exit_code


def start_training_loop(iteration: int) -> None:
    """Number the machine's steps like the training loop's (the next step is iteration + 1),
    unless a checkpointed machine state already carries its own count."""
    machine = get_rerun_state_machine()
    if machine.state == RerunState.NOT_RUNNING_YET:
        machine.current_iteration = iteration
