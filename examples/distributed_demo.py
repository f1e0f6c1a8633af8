"""A short tensor-parallel demo on CPU (gloo): a TP=2 model matches its serial reference.

Run either way:

    python examples/distributed_demo.py                      # spawns 2 processes itself
    torchrun --nproc-per-node 2 examples/distributed_demo.py

The model is embedding -> ColumnParallelLinear -> gelu -> RowParallelLinear -> vocab-parallel
cross entropy against the output of a tied (vocab-parallel) output projection. Each rank builds
its shards with CPU initialization, so the shards are exact slices of the serial model's
weights; rank 0 then checks the loss and every gradient against plain torch.
"""

import argparse
import os
import socket
import sys

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.utils import init_method_normal

SEQ, BATCH, HIDDEN, FFN, VOCAB = 16, 4, 32, 64, 128


def _gather(t, dim):
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def run(sequence_parallel: bool) -> bool:
    """Build the TP model, run forward/backward, compare with the serial model; True if equal."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
    )
    init = init_method_normal(0.05)
    torch.manual_seed(42)  # the same master weights on every rank
    embedding = tensor_parallel.VocabParallelEmbedding(
        VOCAB, HIDDEN, init_method=init, config=config, reduce_scatter_embeddings=sequence_parallel
    )
    fc1 = tensor_parallel.ColumnParallelLinear(
        HIDDEN, FFN, config=config, init_method=init, bias=True
    )
    fc2 = tensor_parallel.RowParallelLinear(
        FFN,
        HIDDEN,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    head = tensor_parallel.ColumnParallelLinear(
        HIDDEN, VOCAB, config=config, init_method=init, bias=False
    )

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)  # [b, s]
    labels = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)  # [s, b]

    # Tensor parallel forward / backward.
    h = embedding(tokens)  # [b, s, h], or [s/tp, b, h] with sequence parallel
    if not sequence_parallel:
        h = h.transpose(0, 1).contiguous()  # [s, b, h]
    h = h + fc2(F.gelu(fc1(h)[0]))[0]
    logits, _ = head(h)  # [s, b, v/tp]
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels).mean()
    loss.backward()

    # Serial reference with the full weights (gathered from the shards).
    full = {
        'emb': _gather(embedding.weight.detach(), 0),
        'w1': _gather(fc1.weight.detach(), 0),
        'b1': _gather(fc1.bias.detach(), 0),
        'w2': _gather(fc2.weight.detach(), 1),
        'b2': fc2.bias.detach().clone(),
        'head': _gather(head.weight.detach(), 0),
    }
    ref = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    x = F.embedding(tokens, ref['emb']).transpose(0, 1)  # [s, b, h]
    x = x + F.linear(F.gelu(F.linear(x, ref['w1'], ref['b1'])), ref['w2'], ref['b2'])
    ref_loss = F.cross_entropy(F.linear(x, ref['head']).reshape(-1, VOCAB), labels.reshape(-1))
    ref_loss.backward()

    bias2_grad = fc2.bias.grad.clone()
    if sequence_parallel:  # each rank holds its sequence chunk's share (finalize_model_grads sums)
        torch.distributed.all_reduce(
            bias2_grad, group=parallel_state.get_tensor_model_parallel_group()
        )
    grads = {
        'emb': _gather(embedding.weight.grad, 0),
        'w1': _gather(fc1.weight.grad, 0),
        'b1': _gather(fc1.bias.grad, 0),
        'w2': _gather(fc2.weight.grad, 1),
        'b2': bias2_grad,
        'head': _gather(head.weight.grad, 0),
    }
    ok = torch.allclose(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    worst = 0.0
    for name, grad in grads.items():
        diff = (grad - ref[name].grad).abs().max().item()
        worst = max(worst, diff)
        ok = ok and torch.allclose(grad, ref[name].grad, rtol=1e-4, atol=1e-6)
    if torch.distributed.get_rank() == 0:
        print(
            f"TP={tp} sequence_parallel={sequence_parallel}: loss {loss.item():.6f} "
            f"(serial {ref_loss.item():.6f}), max |grad diff| {worst:.2e} -> "
            f"{'MATCH' if ok else 'MISMATCH'}",
            flush=True,
        )
    return ok


def main_worker(tp: int) -> int:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(backend='gloo')
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    results = [run(sequence_parallel=False), run(sequence_parallel=True)]
    ok = torch.tensor([int(all(results))])
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return 0 if ok.item() == 1 else 1


def _spawned(rank: int, world_size: int, port: int, tp: int, codes):
    os.environ.update(
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    codes[rank] = main_worker(tp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument(
        '--nproc', type=int, default=2, help='processes to spawn (without torchrun)'
    )
    parser.add_argument(
        '--tensor-model-parallel-size',
        type=int,
        default=None,
        help='TP size (default: all processes)',
    )
    args = parser.parse_args()
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:  # launched by torchrun
        world_size = int(os.environ['WORLD_SIZE'])
        return main_worker(args.tensor_model_parallel_size or world_size)
    tp = args.tensor_model_parallel_size or args.nproc
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    ctx = torch.multiprocessing.get_context('spawn')
    codes = ctx.Manager().list([1] * args.nproc)
    procs = [
        ctx.Process(target=_spawned, args=(r, args.nproc, port, tp, codes))
        for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rc = max([p.exitcode for p in procs] + list(codes))
    print('distributed demo: ' + ('OK' if rc == 0 else 'FAILED'))
    return rc


if __name__ == '__main__':
    sys.exit(main())
