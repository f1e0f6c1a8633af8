"""GPT model step (forward, backward, AdamW) of GPTModel vs the same model in plain PyTorch.

The framework side is GPTModel with the local layer spec, called as pretrain_gpt.py calls it: with
the dataloader's explicit causal mask tensor ([b, 1, s, s] bool, True = masked out). Causal layers
ignore that mask and run torch's fused scaled_dot_product_attention; the plain side calls
`scaled_dot_product_attention(is_causal=True)`. No dropout, fp32, AdamW with the same
hyper-parameters on both sides. With `--optimizer framework` (the default) each side uses the AdamW
its user gets: the framework side `get_megatron_optimizer` (torch's fused AdamW kernel, as
pretrain_gpt.py runs it; no clipping here), the plain side `torch.optim.AdamW()` with its defaults.
`--optimizer same` gives both sides `torch.optim.AdamW()` with its defaults, so the ratio is the
model's forward and backward alone. The two alternate step by step in this process, so load from
other processes hits both alike; the figure is the median over the timed steps.

Shapes: `--preset issue` (4 layers, hidden 256, 8 heads, seq 256, vocab 8192, micro batch 8) or
`--preset 124m` (12 layers, hidden 768, 12 heads, seq 256, vocab 50304, micro batch 2).

Usage: python benchmarks/bench_model_step.py [--preset issue|124m] [--steps 5] [--threads 2]
       [--no-mask]   # pass attention_mask=None instead of the dataloader's mask
       [--optimizer framework|same]
"""

import argparse
import os
import socket
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'benchmarks'))

from bench_training import PlainGPT  # noqa: E402  (same plain model as the training benchmark)

PRESETS = {
    'issue': dict(layers=4, hidden=256, heads=8, seq=256, vocab=8192, mbs=8),
    '124m': dict(layers=12, hidden=768, heads=12, seq=256, vocab=50304, mbs=2),
}


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def build_megatron(cfg, batches, with_mask, framework_optimizer):
    """Returns step(i) training GPTModel one micro-batch with AdamW."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.utils import get_ltor_masks_and_position_ids

    torch.distributed.init_process_group(
        'gloo', init_method=f'tcp://127.0.0.1:{_free_port()}', rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=cfg['layers'],
        hidden_size=cfg['hidden'],
        num_attention_heads=cfg['heads'],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=cfg['vocab'],
        max_sequence_length=cfg['seq'],
        share_embeddings_and_output_weights=True,  # as pretrain_gpt.py (and the plain model)
    )
    if framework_optimizer:
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer='adam', lr=1e-4, weight_decay=0.01, clip_grad=0.0), [model]
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    inputs = []
    for tokens, labels in batches:
        mask, _, position_ids = get_ltor_masks_and_position_ids(tokens, -1, False, False, False)
        inputs.append((tokens, labels, mask if with_mask else None, position_ids))

    def step(i):
        opt.zero_grad(set_to_none=True)
        tokens, labels, mask, position_ids = inputs[i % len(inputs)]
        losses = model(tokens, position_ids, mask, labels=labels)  # [b, s] per-token losses
        losses.float().mean().backward()
        opt.step()

    step.params = list(model.parameters())
    return step


def build_plain(cfg, batches):
    model = PlainGPT(cfg['vocab'], cfg['seq'], cfg['hidden'], cfg['heads'], cfg['layers'])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)  # torch's defaults

    def step(i):
        opt.zero_grad(set_to_none=True)
        tokens, labels = batches[i % len(batches)]
        model(tokens, labels).backward()
        opt.step()

    step.params = list(model.parameters())
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--preset', choices=sorted(PRESETS), default='issue')
    parser.add_argument('--steps', type=int, default=5, help='timed steps (after one warm-up)')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--no-mask', action='store_true', help='attention_mask=None')
    parser.add_argument(
        '--optimizer',
        choices=('framework', 'same'),
        default='framework',
        help="framework: each side's own AdamW; same: torch.optim.AdamW defaults on both",
    )
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    cfg = PRESETS[cli.preset]
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        seq = torch.randint(0, cfg['vocab'], (cfg['mbs'], cfg['seq'] + 1), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    steps = {
        'megatron': build_megatron(cfg, batches, not cli.no_mask, cli.optimizer == 'framework'),
        'plain': build_plain(cfg, batches),
    }
    times = {name: [] for name in steps}
    for i in range(cli.steps + 1):
        for name, step in steps.items():
            t = time.perf_counter()
            step(i)
            if i > 0:
                times[name].append(time.perf_counter() - t)
    tokens = cfg['mbs'] * cfg['seq']
    n_meg = sum(p.numel() for p in steps['megatron'].params)
    n_plain = sum(p.numel() for p in steps['plain'].params)
    print(f'parameters: megatron {n_meg / 1e6:.2f}M, plain {n_plain / 1e6:.2f}M')
    print(
        f'preset {cli.preset}: {cfg}; torch threads {torch.get_num_threads()}; '
        f'attention mask {"None" if cli.no_mask else "dataloader causal mask tensor"}; '
        f'optimizer {cli.optimizer}'
    )
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, t in med.items():
        print(
            f'{name:>9}: {t * 1000:8.1f} ms/step  {tokens / t:8.1f} tokens/s  '
            f'(min {min(times[name]) * 1000:.1f}, max {max(times[name]) * 1000:.1f} ms)'
        )
    print(f'ratio megatron / plain (tokens/s): {med["plain"] / med["megatron"]:.3f}')
    torch.distributed.destroy_process_group()


if __name__ == '__main__':
    main()
