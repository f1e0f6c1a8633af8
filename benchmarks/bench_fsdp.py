"""Fully sharded data parallel: step time and per-rank memory of FSDP2 (= Megatron-FSDP's
optim_grads_params), FSDP2 without reshard after forward (= optim_grads) and the distributed
optimizer (= optim), at DP2 on gloo, same model and batches.

One process per data-parallel rank, one torch thread each; a small Llama-style GPT (megatron.core
GPTModel, fp32, RoPE, SwiGLU) trained through the real schedule, finalize_model_grads and the
Megatron optimizer (Adam). Printed per layout: median ms per step over the timed steps, its ratio
to the distributed optimizer (goal <= 1.15), the bytes of parameters each rank holds (local
shards) and their ratio to the distributed optimizer's (goal <= 0.55), and parameters + grads +
optimizer state per rank.

Usage: python benchmarks/bench_fsdp.py [--steps 6] [--num-layers 4 --hidden-size 256
       --seq-length 128 --micro-batch-size 4 --vocab 2048]
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LAYOUTS = ('distributed-optimizer', 'fsdp2', 'fsdp2-no-reshard')


def _state_bytes(model, optimizer):
    from megatron.core.distributed.sharded_tensors import local_tensor

    seen, params, total = set(), 0, 0

    def add(tensor):
        if tensor is None:
            return 0
        tensor = local_tensor(tensor)
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or tensor.numel() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    for buffer in getattr(model, 'buffers', []) if hasattr(model, 'param_to_buffer') else []:
        params += add(buffer.param_data)
        total += add(buffer.grad_data)
    for param in model.parameters():
        params += add(param)
        total += add(param.grad) + add(getattr(param, 'main_grad', None))
    for opt in getattr(optimizer, 'chained_optimizers', [optimizer]):
        for group in opt.optimizer.param_groups:
            for param in group['params']:
                total += add(param)
                for value in opt.optimizer.state.get(param, {}).values():
                    if hasattr(value, 'numel') and value.numel() > 1:
                        total += add(value)
    return params, params + total


def _run_layout(layout, opts):
    import torch

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=opts.num_layers,
        hidden_size=opts.hidden_size,
        num_attention_heads=8,
        ffn_hidden_size=opts.hidden_size * 3,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization='RMSNorm',
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        finalize_model_grads_func=finalize_model_grads,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=opts.vocab,
        max_sequence_length=opts.seq_length,
        position_embedding_type='rope',
        share_embeddings_and_output_weights=False,
    )
    distributed_optimizer = layout == 'distributed-optimizer'
    if distributed_optimizer:
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        model = DistributedDataParallel(config, ddp_config, model)
    else:
        fsdp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=layout == 'fsdp2')
        model = TorchFullyShardedDataParallel(config, None, model, fsdp_config)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-3, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer),
        [model],
    )
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()
    mbs, seq = opts.micro_batch_size, opts.seq_length
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    tokens = torch.randint(0, opts.vocab, (mbs, seq + 1), generator=gen)
    position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)

    def forward_step(data_iterator, chunk):
        output = chunk(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
        return output, lambda out: (out.float().mean(), {})

    times = []
    for step in range(opts.steps + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=None,
            model=[model],
            num_microbatches=2,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        optimizer.step()
        torch.distributed.barrier()
        if step > 0:  # the first step builds optimizer state and caches
            times.append(time.perf_counter() - start)
    params, total = _state_bytes(model, optimizer)
    return {
        'ms_per_step': 1000 * statistics.median(times),
        'param_bytes': params,
        'state_bytes': total,
    }


def _worker(rank, world_size, port, opts, queue):
    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size
    )
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    results = {layout: _run_layout(layout, opts) for layout in LAYOUTS}
    if rank == 0:
        queue.put(results)
    torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=6)
    parser.add_argument('--num-layers', type=int, default=4)
    parser.add_argument('--hidden-size', type=int, default=256)
    parser.add_argument('--seq-length', type=int, default=128)
    parser.add_argument('--micro-batch-size', type=int, default=4)
    parser.add_argument('--vocab', type=int, default=2048)
    opts = parser.parse_args()

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context('spawn')
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, opts, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=1800)
    for proc in procs:
        proc.join(timeout=60)
    base = results['distributed-optimizer']
    for layout, row in results.items():
        row['step_ratio_vs_distopt'] = row['ms_per_step'] / base['ms_per_step']
        row['param_bytes_ratio_vs_distopt'] = row['param_bytes'] / base['param_bytes']
        print(
            f"{layout:24s} {row['ms_per_step']:8.1f} ms/step ({row['step_ratio_vs_distopt']:.2f}x)"
            f"  params/rank {row['param_bytes'] / 2**20:6.2f} MiB "
            f"({row['param_bytes_ratio_vs_distopt']:.2f}x)"
            f"  params+grads+optimizer/rank {row['state_bytes'] / 2**20:6.2f} MiB"
        )
    print(json.dumps(results))


if __name__ == '__main__':
    main()
