"""Asynchronous torch_dist saves: a job killed (SIGKILL) while its background writer is busy
keeps the previous checkpoint as the latest, intact; the tracker is never ahead of complete
files.

A one-process gloo job saves iteration 1 and moves the tracker (the trainer's finalize step),
then schedules an asynchronous save of iteration 2 whose writer has written its `.distcp` files
but not returned (a slow file system). While the job keeps "training" (polling the queue, which
must not finalize), the test kills it.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

JOB = r'''
import os, socket, sys, threading, time, torch
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
torch.distributed.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.training.checkpointing import _write_tracker_atomically

save_dir = sys.argv[1]
queue = AsyncCallsQueue()

def save(iteration, value, hold):
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    os.makedirs(path)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 64), value), (0, 0, 1))}
    request = dist_checkpointing.save(sd, path, async_sharded_save=True)
    request.add_finalize_fn(lambda: _write_tracker_atomically(save_dir, iteration))
    if hold:
        write = request.async_fn
        def slow_write():
            result = write()
            print("WRITTEN", flush=True)
            threading.Event().wait()  # the writer never returns: a stalled file system
            return result
        request.async_fn = slow_write
    queue.schedule_async_request(request)
    return request

save(1, 1.0, hold=False)
queue.maybe_finalize_async_calls(blocking=True)
save(2, 2.0, hold=True)
while True:  # training continues; nothing may be finalized
    assert queue.maybe_finalize_async_calls(blocking=False) == []
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        print("TRACKER", f.read(), flush=True)
    time.sleep(0.05)
'''


def test_sigkill_during_async_write_keeps_previous_checkpoint(tmp_path):
    from megatron.core import dist_checkpointing

    save_dir = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    proc = subprocess.Popen(
        [sys.executable, '-c', JOB, save_dir],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, trackers = [], []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            trackers = [line.split()[1] for line in list(lines) if line.startswith('TRACKER')]
            if any('WRITTEN' in line for line in list(lines)) and len(trackers) >= 3:
                break
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
    assert trackers and set(trackers) == {'1'}, ''.join(lines)[-3000:]

    with open(os.path.join(save_dir, 'latest_checkpointed_iteration.txt')) as f:
        assert f.read() == '1'
    pending = os.path.join(save_dir, 'iter_0000002')
    assert any(name.endswith('.distcp') for name in os.listdir(pending))  # it was writing
    assert not dist_checkpointing.check_is_distributed_checkpoint(pending)
    previous = dist_checkpointing.load_plain_tensors(os.path.join(save_dir, 'iter_0000001'))
    assert torch.equal(previous['w'], torch.full((64, 64), 1.0))
