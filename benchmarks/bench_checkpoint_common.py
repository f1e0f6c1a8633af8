"""Pieces that both checkpoint benchmarks use (bench_checkpoint.py and bench_checkpoint_dist.py).

They live here so that neither benchmark imports the other at module level: bench_checkpoint.py
hands `--format torch_dist` to bench_checkpoint_dist.py, which takes the repository root, a free
port and the synthetic optimizer step from this module.
"""

import os
import socket

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _synthetic_step(model, optimizer, opt_param_scheduler, args):
    import torch

    gen = torch.Generator().manual_seed(0)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for chunk in model:
        for param in chunk.parameters():
            grad = torch.randn(param.shape, generator=gen) * 1e-3
            param.main_grad.copy_(grad.to(param.main_grad.device, param.main_grad.dtype))
    optimizer.step()
    opt_param_scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples += args.global_batch_size
