"""The rerun state machine in pretrain_gpt.py's training loop (pretrain() in a harness rank, tiny
GPT, mock data): a validate_results run survives an injected transient fault of a non-fatal
check with the losses of an uninjected run; a fatal transient fault exits 17; a reproducible one
saves a checkpoint of the iteration before the step (with each rank's machine state) and exits
16, and the resumed job, on the same device, exits 16 again."""

import os

from tests.functional_tests.test_resume import RESUME_ARGS, _hex_losses
from tests.unit_tests.dist_utils import run_distributed

ITERS = ['--train-iters', '4']
VALIDATE = ['--rerun-mode', 'validate_results']


def _pretrain(args_list):
    """pretrain() on this rank; (exit code or None, hex losses)."""
    import sys

    from tests.functional_tests.test_resume import REPO

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    try:
        result = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_gpt.forward_step,
            args_list=RESUME_ARGS + list(args_list),
        )
        return None, _hex_losses(result['train_losses'])
    except SystemExit as stop:
        return stop.code, {}
    finally:
        destroy_global_vars()


def _jobs(jobs):
    return [_pretrain(args) for args in jobs]


def test_transient_fault_survived_with_the_same_losses(tmp_path):
    spiky = ITERS + ['--check-for-spiky-loss', '--no-check-for-nan-in-loss-and-grad']
    ((plain, injected),) = run_distributed(
        _jobs,
        world_size=1,
        args=([spiky, spiky + VALIDATE + ['--error-injection-rate', '1']],),
    )
    assert plain[0] is None and injected[0] is None
    assert sorted(plain[1]) == [1, 2, 3, 4]
    assert injected[1] == plain[1]


def test_fatal_faults_exit_16_and_17(tmp_path):
    save = str(tmp_path / 'ckpt')
    tracker = str(tmp_path / 'rejected.txt')
    persistent = ITERS + VALIDATE + ['--error-injection-rate', '1', '--save', save, '--load', save]
    persistent += ['--error-injection-type', 'persistent_error']
    persistent += ['--result-rejected-tracker-filename', tracker]
    transient = ITERS + VALIDATE + ['--error-injection-rate', '1']
    ((first, resumed, fatal),) = run_distributed(
        _jobs, world_size=1, args=([persistent, persistent, transient],)
    )
    assert first[0] == 16 and resumed[0] == 16 and fatal[0] == 17
    # Step 2 failed (step 1 is never validated): the checkpoint is of iteration 1.
    with open(os.path.join(save, 'latest_checkpointed_iteration.txt')) as f:
        assert f.read() == '1'
    state_file = os.path.join(save, 'iter_0000001', 'rerun_state_machine', 'rank_00000.pt')
    assert os.path.isfile(state_file)
    with open(tracker) as f:
        statuses = [line.split(' status=')[1].split()[0] for line in f]
    assert statuses == ['initial_run', 'first_rerun_reproducible']
