"""Start-up rules of the resilience flags (one-line errors naming the flag and value), the r0.8
flags this round accepts (non-persistent checkpoints, --decrease-batch-size-if-needed,
--lazy-mpu-init) and what they do."""

import re

import pytest
import torch

from megatron.training.arguments import parse_args, validate_args
from megatron.training.cli.arguments_unsupported import UNSUPPORTED_FLAGS
from tests.unit_tests.dist_utils import run_distributed

BASE = '--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 '
BASE += '--max-position-embeddings 16 --micro-batch-size 2 --train-iters 4 --lr 1e-3'

SAVE = ' --save /tmp/x --save-interval 5'


def _validate(extra, world_size=1):
    args = parse_args(args_list=BASE.split() + extra.split())
    args.world_size, args.rank = world_size, 0
    return validate_args(args, {})


@pytest.mark.parametrize(
    'extra, message',
    [
        ('--error-injection-rate -1', '--error-injection-rate must be >= 0'),
        (
            '--error-injection-rate 4',
            '--error-injection-rate 4 needs --rerun-mode validate_results',
        ),
        (
            '--rerun-mode validate_results --error-injection-rate 4 '
            '--no-check-for-nan-in-loss-and-grad',
            '--error-injection-rate needs a check to inject into',
        ),
        ('--non-persistent-save-interval 0', '--non-persistent-save-interval must be positive'),
        (
            '--non-persistent-save-interval 2' + SAVE,
            '--non-persistent-save-interval 2 needs --non-persistent-ckpt-type',
        ),
        (
            '--non-persistent-save-interval 2 --non-persistent-ckpt-type in_memory' + SAVE,
            'Currently only global and local checkpoints are supported',
        ),
        (
            '--non-persistent-save-interval 2 --non-persistent-ckpt-type global',
            '--non-persistent-save-interval 2 needs --save',
        ),
        (
            '--non-persistent-save-interval 2 --non-persistent-ckpt-type local' + SAVE,
            'without specifying --non-persistent-local-ckpt-dir',
        ),
        ('--optimizer-offload-fraction 1.5', '--optimizer-offload-fraction must be in [0, 1]'),
        # Every float flag is checked for finiteness first (argument_validation_floats.py).
        (
            '--optimizer-offload-fraction nan',
            '--optimizer-offload-fraction must be a finite number',
        ),
        ('--optimizer-cpu-offload', '--optimizer-cpu-offload needs --use-distributed-optimizer'),
        (
            '--global-batch-size 1 --decrease-batch-size-if-needed',
            '--decrease-batch-size-if-needed: --global-batch-size (1) is below',
        ),
    ],
)
def test_bad_combinations_stop_start_up(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        _validate(extra)
    assert '\n' not in str(err.value)


def test_accepted_r08_flags_are_out_of_the_refusal_table():
    for flag in (
        '--non-persistent-save-interval',
        '--non-persistent-ckpt-type',
        '--non-persistent-global-ckpt-dir',
        '--decrease-batch-size-if-needed',
        '--lazy-mpu-init',
    ):
        assert flag not in UNSUPPORTED_FLAGS
    args = _validate(
        '--non-persistent-save-interval 2 --non-persistent-ckpt-type global' + SAVE + ' '
        '--rerun-mode report_stats --check-for-spiky-loss --check-for-large-grads'
    )
    assert args.non_persistent_save_interval == 2 and args.check_for_nan_in_loss_and_grad
    assert _validate('--no-check-for-nan-in-loss-and-grad').check_for_nan_in_loss_and_grad is False


def test_decrease_batch_size_if_needed(capsys):
    # 7 samples at micro batch 2 x DP 2: trains on 4, as later Megatron does.
    args = _validate('--global-batch-size 7 --decrease-batch-size-if-needed', world_size=2)
    assert args.global_batch_size == 4
    assert 'decreasing batch size from 7 to 4' in capsys.readouterr().out
    with pytest.raises(ValueError, match='is not divisible by'):
        _validate('--global-batch-size 7', world_size=2)


def _lazy_init():
    from megatron.core import parallel_state as ps
    from megatron.training.global_vars import destroy_global_vars, get_args
    from megatron.training.initialize import initialize_megatron

    ps.destroy_model_parallel()
    destroy_global_vars()
    finish = initialize_megatron(
        args_list=(
            BASE + ' --lazy-mpu-init True --tensor-model-parallel-size 2 '
            '--tokenizer-type NullTokenizer --vocab-size 64 --distributed-backend gloo'
        ).split()
    )
    before = (
        callable(finish),
        ps.model_parallel_is_initialized(),
        get_args().use_cpu_initialization,
    )
    finish()
    after = (ps.model_parallel_is_initialized(), ps.get_tensor_model_parallel_rank())
    destroy_global_vars()
    return before, after, torch.distributed.get_rank()


def test_lazy_mpu_init_returns_the_rest_of_the_initialization():
    for before, after, rank in run_distributed(_lazy_init, world_size=2, tp=2):
        assert before == (True, False, True)
        assert after == (True, rank)
