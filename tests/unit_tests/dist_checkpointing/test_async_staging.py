"""An asynchronous torch_dist save whose snapshot is taken in the background equals the
synchronous save of the same state bitwise, even when training takes its next optimizer step
right after the save call.

Two gloo ranks (DP2, distributed optimizer) build a tiny GPT through the training layer, take
one optimizer step, save synchronously into one directory and asynchronously into another,
then at once take another step. The snapshot is slowed down (a sleep before the copy) so that
the step would overwrite the parameters and Adam moments before they are copied unless the
step waits for the staging, as it must. The save call itself does not plan: the planning
exchange runs in the writer thread.
"""

import os
import threading
import time

import torch

from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

#: Seconds the snapshot sleeps before copying (far longer than an optimizer step here).
STAGING_DELAY = 1.0


def _step(model, optimizer, seed):
    gen = torch.Generator().manual_seed(seed)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for chunk in model:
        for param in chunk.parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=gen))
    optimizer.step()


def _save_sync_then_async_and_step(save_root):
    import sys

    sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing import load_plain_tensors
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from megatron.core.enums import ModelType
    from megatron.training import checkpointing
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    mpu.destroy_model_parallel()
    initialize_megatron(
        args_list=(
            '--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 '
            '--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 2 '
            '--tokenizer-type NullTokenizer --vocab-size 64 --distributed-backend gloo '
            '--use-distributed-optimizer --ckpt-format torch_dist --lr 1e-2 --train-iters 4 '
            f'--save {save_root} --save-interval 1'
        ).split()
    )
    model, optimizer, scheduler = setup_model_and_optimizer(
        pretrain_gpt.model_provider, ModelType.encoder_or_decoder
    )
    args = get_args()
    _step(model, optimizer, seed=1)
    sync_dir, async_dir = os.path.join(save_root, 'sync'), os.path.join(save_root, 'async')

    args.save, args.async_save = sync_dir, False
    checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)

    stage_all = torch_strategy._stage_all
    plan = torch_strategy.TorchDistSaveShardedStrategy._plan
    planned_in = []  # per planning exchange: whether it ran on the main thread

    def slow_stage_all(*stage_args):
        time.sleep(STAGING_DELAY)
        return stage_all(*stage_args)

    def recorded_plan(*plan_args, **kwargs):
        planned_in.append(threading.current_thread() is threading.main_thread())
        return plan(*plan_args, **kwargs)

    torch_strategy._stage_all = slow_stage_all
    torch_strategy.TorchDistSaveShardedStrategy._plan = recorded_plan
    try:
        args.save, args.async_save = async_dir, True
        before = [p.detach().clone() for chunk in model for p in chunk.parameters()]
        checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
        _step(model, optimizer, seed=2)  # training continues at once
        changed = any(
            not torch.equal(a, p)
            for a, p in zip(before, [p for chunk in model for p in chunk.parameters()])
        )
        checkpointing.maybe_finalize_async_save(blocking=True)
    finally:
        torch_strategy._stage_all = stage_all
        torch_strategy.TorchDistSaveShardedStrategy._plan = plan
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        return None
    sync = load_plain_tensors(os.path.join(sync_dir, 'iter_0000001'))
    written = load_plain_tensors(os.path.join(async_dir, 'iter_0000001'))
    differing = sorted(k for k in sync if k not in written or not torch.equal(sync[k], written[k]))
    with open(os.path.join(async_dir, 'latest_checkpointed_iteration.txt')) as f:
        tracker = f.read()
    return {
        'keys': len(sync),
        'same_keys': sorted(sync) == sorted(written),
        'differing': differing,
        'params_changed': changed,
        'tracker': tracker,
        'planned_in_main_thread': planned_in,
    }


def test_async_save_with_background_staging_equals_sync_save(tmp_path):
    out = run_distributed(_save_sync_then_async_and_step, world_size=2, args=(str(tmp_path),))[0]
    assert out['params_changed']  # the step after the save call did update the parameters
    assert out['keys'] > 10 and out['same_keys']
    assert out['differing'] == [], out['differing'][:5]
    assert out['tracker'] == '1'
    assert out['planned_in_main_thread'] == [False]  # the async save planned in its writer
