"""Non-persistent checkpoints through pretrain_gpt.py (pretrain() in a harness rank, tiny GPT,
mock data): a run that crashes after its newest non-persistent save resumes from it with the
uninterrupted run's losses bit for bit; the persistent checkpoints are never replaced or deleted
and only the newest non-persistent one is kept; a corrupt newest non-persistent checkpoint is
skipped for the persistent one; `local` checkpoints resume the same way; and a SIGTERM with
--exit-signal-handler still saves a persistent checkpoint between non-persistent ones."""

import os

from tests.functional_tests.test_resume import RESUME_ARGS, _hex_losses
from tests.unit_tests.dist_utils import run_distributed

ITERS = ['--train-iters', '8']


def _crashing_forward_step(data_iterator, model):
    """pretrain_gpt's forward step, but the process 'dies' in iteration 8 (or on SIGTERM
    in iteration 3 with CRASH=sigterm)."""
    import signal

    import pretrain_gpt
    from megatron.training.global_vars import get_args

    iteration = get_args().curr_iteration
    if os.environ.get('CRASH') == 'sigterm' and iteration == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    elif os.environ.get('CRASH') == 'raise' and iteration == 7:
        raise KeyboardInterrupt('simulated crash')
    return pretrain_gpt.forward_step(data_iterator, model)


def _pretrain(args_list, crash=None):
    import sys

    from tests.functional_tests.test_resume import REPO

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    os.environ['CRASH'] = crash or ''
    try:
        result = pretrain(
            pretrain_gpt.train_valid_test_datasets_provider,
            pretrain_gpt.model_provider,
            ModelType.encoder_or_decoder,
            _crashing_forward_step,
            args_list=RESUME_ARGS + list(args_list),
        )
        return _hex_losses(result['train_losses'])
    except KeyboardInterrupt:
        return 'crashed'
    finally:
        os.environ.pop('CRASH', None)
        destroy_global_vars()


def _listing(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(('iter_', 'latest')))


def _crash_and_resume(work, np_args, corrupt_newest):
    """A run crashing in iteration 8 and the same command resumed; with `corrupt_newest`, the
    newest non-persistent model file truncated before resuming."""
    save = os.path.join(work, 'run')
    common = ITERS + ['--save-interval', '4', '--non-persistent-save-interval', '3'] + np_args
    common += ['--save', save, '--load', save]
    crashed = _pretrain(common, crash='raise')
    np_dir = os.path.join(save, 'non_persistent')
    if '--non-persistent-local-ckpt-dir' in np_args:
        np_dir = np_args[np_args.index('--non-persistent-local-ckpt-dir') + 1]
    listing = {'persistent': _listing(save), 'non_persistent': _listing(np_dir)}
    if corrupt_newest:
        name = os.path.join(np_dir, 'iter_0000006', 'mp_rank_00', 'model_optim_rng.pt')
        with open(name, 'r+b') as f:
            f.truncate(os.path.getsize(name) // 2)
    resumed = _pretrain(common)
    with open(os.path.join(save, 'latest_checkpointed_iteration.txt')) as f:
        final = f.read()
    return crashed, listing, resumed, final


def _all_cases(work):
    local = os.path.join(work, 'local', 'np')
    return {
        'reference': _pretrain(ITERS),
        'global': _crash_and_resume(
            os.path.join(work, 'global'), ['--non-persistent-ckpt-type', 'global'], False
        ),
        'corrupt': _crash_and_resume(
            os.path.join(work, 'corrupt'), ['--non-persistent-ckpt-type', 'global'], True
        ),
        # Persistent torch_dist checkpoints beside local (torch format) ones.
        'local': _crash_and_resume(
            os.path.join(work, 'local'),
            ['--non-persistent-ckpt-type', 'local', '--non-persistent-local-ckpt-dir', local]
            + ['--use-dist-ckpt'],
            False,
        ),
    }


def test_non_persistent_resume_is_exact_and_keeps_the_persistent_ones(tmp_path):
    (cases,) = run_distributed(_all_cases, world_size=1, args=(str(tmp_path),))
    reference = cases['reference']
    expected_listing = {
        # Iteration 4 only (the crash came before the final save) ...
        'persistent': ['iter_0000004', 'latest_checkpointed_iteration.txt'],
        # ... and only the newest non-persistent one (3 was removed when 6 was saved).
        'non_persistent': ['iter_0000006', 'latest_checkpointed_iteration.txt'],
    }
    for kind in ('global', 'local'):
        crashed, listing, resumed, final = cases[kind]
        assert crashed == 'crashed'
        assert listing == expected_listing, kind
        assert resumed == {7: reference[7], 8: reference[8]}, kind
        assert final == '8'
    # The corrupt newest (6) is skipped: resumed from the persistent 4.
    crashed, listing, resumed, final = cases['corrupt']
    assert resumed == {it: reference[it] for it in (5, 6, 7, 8)}


def _sigterm_run(save):
    args = ITERS + ['--save', save, '--save-interval', '100', '--exit-signal-handler']
    args += ['--non-persistent-save-interval', '1', '--non-persistent-ckpt-type', 'global']
    losses = _pretrain(args, crash='sigterm')
    return losses, _listing(save), _listing(os.path.join(save, 'non_persistent'))


def test_sigterm_saves_a_persistent_checkpoint_beside_the_non_persistent_ones(tmp_path):
    # Two ranks: each non-persistent save after the first replaces the previous one.
    save = str(tmp_path / 'run')
    outs = run_distributed(_sigterm_run, world_size=2, args=(save,))
    losses, persistent, non_persistent = outs[0]
    assert sorted(losses) == [1, 2, 3]
    assert persistent == ['iter_0000003', 'latest_checkpointed_iteration.txt']
    assert non_persistent == ['iter_0000002', 'latest_checkpointed_iteration.txt']
