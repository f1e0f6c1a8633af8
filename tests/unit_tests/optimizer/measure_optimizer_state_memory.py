"""Measure optimizer-state bytes per rank with and without the distributed optimizer.

Builds the real thing: a module with the parameter shapes of a ~125M GPT (GPT-3 Small / GPT-2
small: 12 layers, hidden 768, 12 heads, FFN 3072, vocab 50257 padded to 50304, 1024 positions, tied
output layer), wrapped in DistributedDataParallel and given to get_megatron_optimizer, on DP gloo
ranks spawned by the test harness. One optimizer step on zero gradients materializes Adam's
state; then each rank counts the bytes of its optimizer state tensors (exp_avg, exp_avg_sq) plus
the fp32 main params that are separate copies (fp16/bf16 models; for fp32 models the main params
are the model params themselves), and reports its DDP grad/param buffer sizes.

Run:  python tests/unit_tests/optimizer/measure_optimizer_state_memory.py [--dtypes bf16,fp32]
      [--dp 2,4] (needs about 2.3 GB per rank for the plain optimizer, 1.2 GB with the distributed
      one, for bf16).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..')))

from tests.unit_tests.dist_utils import run_distributed  # noqa: E402

VOCAB, HIDDEN, LAYERS, FFN, POSITIONS = 50304, 768, 12, 3072, 1024


class GPTShapes(torch.nn.Module):
    """Only the parameters (with Megatron mcore names) of a 125M GPT; no forward pass needed."""

    def __init__(self, dtype):
        super().__init__()

        def p(*shape):
            return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))

        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Module()
        self.embedding.word_embeddings.weight = p(VOCAB, HIDDEN)
        self.embedding.position_embeddings = torch.nn.Module()
        self.embedding.position_embeddings.weight = p(POSITIONS, HIDDEN)
        self.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            layer = torch.nn.Module()
            for name, shape in [
                ('input_layernorm_weight', (HIDDEN,)),
                ('input_layernorm_bias', (HIDDEN,)),
                ('linear_qkv_weight', (3 * HIDDEN, HIDDEN)),
                ('linear_qkv_bias', (3 * HIDDEN,)),
                ('linear_proj_weight', (HIDDEN, HIDDEN)),
                ('linear_proj_bias', (HIDDEN,)),
                ('pre_mlp_layernorm_weight', (HIDDEN,)),
                ('pre_mlp_layernorm_bias', (HIDDEN,)),
                ('linear_fc1_weight', (FFN, HIDDEN)),
                ('linear_fc1_bias', (FFN,)),
                ('linear_fc2_weight', (HIDDEN, FFN)),
                ('linear_fc2_bias', (HIDDEN,)),
            ]:
                layer.register_parameter(name, p(*shape))
            self.layers.append(layer)
        self.final_layernorm_weight = p(HIDDEN)
        self.final_layernorm_bias = p(HIDDEN)


def _measure(dtype_name, use_distributed_optimizer):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = {'bf16': torch.bfloat16, 'fp32': torch.float32}[dtype_name]
    model = GPTShapes(dtype)
    numel = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(
        ModelParallelConfig(),
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
        ),
        model,
    )
    config = OptimizerConfig(
        lr=1e-4, bf16=dtype == torch.bfloat16, use_distributed_optimizer=use_distributed_optimizer
    )
    optimizer = get_megatron_optimizer(config, [ddp])
    ddp.zero_grad_buffer()
    ddp.finish_grad_sync()
    start = time.perf_counter()
    success, _, _ = optimizer.step()
    step_s = time.perf_counter() - start
    assert success

    state_bytes = 0
    for state in optimizer.optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                state_bytes += value.numel() * value.element_size()
    main_groups = getattr(optimizer, 'shard_fp32_from_float16_groups', None)
    if main_groups is None:
        main_groups = getattr(optimizer, 'fp32_from_float16_groups', [])
    main_bytes = sum(p.numel() * p.element_size() for g in main_groups for p in g)
    grad_buffer_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)
    param_buffer_bytes = sum(
        b.param_data.numel() * b.param_data.element_size()
        for b in ddp.buffers
        if b.param_data is not None
    )
    return {
        'model_params': numel,
        'optimizer_type': type(optimizer).__name__,
        'adam_state_bytes': state_bytes,
        'fp32_main_param_bytes': main_bytes,
        'optimizer_state_bytes': state_bytes + main_bytes,
        'grad_buffer_bytes': grad_buffer_bytes,
        'param_buffer_bytes': param_buffer_bytes,
        'step_seconds': step_s,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dtypes', default='bf16')
    parser.add_argument('--dp', default='2,4')
    parser.add_argument('--json', default=None, help='also write the results here')
    args = parser.parse_args()
    results = []
    for dtype_name in args.dtypes.split(','):
        for dp in [int(x) for x in args.dp.split(',')]:
            for dist in (False, True):
                outs = run_distributed(_measure, dp, args=(dtype_name, dist), timeout=1200)
                per_rank = [o['optimizer_state_bytes'] for o in outs]
                row = {
                    'dtype': dtype_name,
                    'dp': dp,
                    'distributed_optimizer': dist,
                    **outs[0],
                    'optimizer_state_bytes_per_rank': per_rank,
                }
                results.append(row)
                print(
                    f"{dtype_name} DP={dp} {outs[0]['optimizer_type']:<34} "
                    f"params={outs[0]['model_params']:,} optimizer state per rank: "
                    f"{', '.join(f'{b / 2**20:.1f} MiB' for b in per_rank)} (grad buffer "
                    f"{outs[0]['grad_buffer_bytes'] / 2**20:.1f} MiB, param buffer "
                    f"{outs[0]['param_buffer_bytes'] / 2**20:.1f} MiB)",
                    flush=True,
                )
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(results, f, indent=1)


if __name__ == '__main__':
    main()
