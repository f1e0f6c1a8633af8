"""Hybrid Mamba benchmarks (CPU by default; figures in docs/mamba.md and benchmarks/README.md).

1. `scan`: the chunked SSD scan against the sequential recurrence (forward + backward).
2. `length`: one Mamba mixer's forward + backward time at growing sequence lengths, and the
   exponent of time ~ length^k from a log-log fit (1 = linear).
3. `train`: a training step (forward, backward, AdamW) of a hybrid MambaModel against Hugging
   Face's NemotronHForCausalLM (torch path) with the same config and weights, alternated in one
   process; tokens/s ratio (ours / HF).

    python benchmarks/bench_mamba.py --threads 2 [--only scan,length,train]
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _time(fn, repeats):
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_scan(seq, repeats):
    from megatron.core.ssm.ssd_scan import ssd_chunked_scan, ssd_sequential_scan

    gen = torch.Generator().manual_seed(0)
    b, nh, p, g, n = 1, 8, 32, 2, 32
    inputs = [
        torch.randn(b, seq, nh, p, generator=gen),
        torch.rand(b, seq, nh, generator=gen) * 0.1,
        -torch.rand(nh, generator=gen) - 0.5,
        torch.randn(b, seq, g, n, generator=gen),
        torch.randn(b, seq, g, n, generator=gen),
    ]
    leaves = [t.requires_grad_(True) for t in inputs]

    def run(fn, **kw):
        def step():
            y, _ = fn(*leaves, **kw)
            y.sum().backward()

        return step

    chunked = _time(run(ssd_chunked_scan, chunk_size=128), repeats)
    sequential = _time(run(ssd_sequential_scan), max(1, repeats // 2))
    print(
        f'scan seq {seq}: chunked {seq / chunked:,.0f} tok/s, sequential '
        f'{seq / sequential:,.0f} tok/s, speedup {sequential / chunked:.1f}x'
    )


def bench_length(lengths, repeats):
    from megatron.core.ssm.layer_norm_linear import LayerNormColumnParallelLinear
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    config = _config(hidden=256, layers=1)
    mixer = MambaMixer(
        config,
        MambaMixerSubmodules(in_proj=LayerNormColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=256,
    )
    times = []
    for seq in lengths:
        x = torch.randn(seq, 1, 256, requires_grad=True)

        def step():
            out, _ = mixer(x)
            out.sum().backward()

        times.append(_time(step, repeats))
        print(f'mixer seq {seq}: {times[-1] * 1e3:.1f} ms fwd+bwd ({seq / times[-1]:,.0f} tok/s)')
    xs = [math.log(s) for s in lengths]
    ys = [math.log(t) for t in times]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    print(f'time ~ length^{slope:.2f} over {lengths[0]}-{lengths[-1]}')


def _config(hidden, layers, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=8,
        mamba_head_dim=32,
        mamba_num_groups=2,
        mamba_state_dim=32,
        normalization='RMSNorm',
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        **kw,
    )


def bench_train(hidden, seq, batch, rounds):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba import hf_weight_mapping as hfm
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    cfg = NemotronHConfig(
        vocab_size=8192, hidden_size=hidden,
        layers_block_type=['mamba', 'mlp', 'mamba', 'attention', 'mamba', 'mlp'],
        mamba_num_heads=2 * hidden // 32, mamba_head_dim=32, ssm_state_size=32, n_groups=2,
        chunk_size=128, num_attention_heads=8, num_key_value_heads=8, head_dim=hidden // 8,
        intermediate_size=4 * hidden, mlp_hidden_act='relu2', attn_implementation='sdpa',
    )  # fmt: skip
    hf = NemotronHForCausalLM(cfg)
    for module in hf.modules():
        if hasattr(module, 'time_step_limit'):
            module.time_step_limit = (0.0, float('inf'))
    kw = hfm.mamba_config_kwargs(cfg)
    from megatron.core.transformer.transformer_config import TransformerConfig

    ours = MambaModel(TransformerConfig(**kw['config'], use_cpu_initialization=True),
                      mamba_stack_spec, **kw['model'])  # fmt: skip
    pattern = kw['model']['hybrid_override_pattern']
    ours.load_state_dict(
        hfm.hf_to_mcore_state_dict(dict(hf.state_dict()), ours.config, pattern), strict=False
    )
    tokens = torch.randint(0, 8192, (batch, seq))
    labels = torch.randint(0, 8192, (batch, seq))
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)

    def step_hf():
        logits = hf(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, 8192), labels.view(-1))
        loss.backward()
        opt_hf.step()
        opt_hf.zero_grad()

    def step_ours():
        loss = ours(tokens, None, None, labels=labels).mean()
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad()

    step_hf(), step_ours()
    t_hf, t_ours = [], []
    for _ in range(rounds):
        t_hf.append(_time(step_hf, 1))
        t_ours.append(_time(step_ours, 1))
    hf_s, ours_s = statistics.median(t_hf), statistics.median(t_ours)
    params = sum(p.numel() for p in ours.parameters()) / 1e6
    print(
        f'train step ({params:.1f}M params, pattern {pattern}, b {batch} x s {seq}): ours '
        f'{batch * seq / ours_s:,.0f} tok/s, HF NemotronH {batch * seq / hf_s:,.0f} tok/s, '
        f'ratio {hf_s / ours_s:.2f}x'
    )


def _init_single_process():
    """One gloo rank on 127.0.0.1 and model-parallel groups of size 1."""
    import socket

    from megatron.core import parallel_state

    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group(
        'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--only', default='scan,length,train')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--lengths', default='1024,2048,4096,8192')
    parser.add_argument('--train-hidden', type=int, default=512)
    parser.add_argument('--train-seq', type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    _init_single_process()
    parts = set(args.only.split(','))
    if 'scan' in parts:
        bench_scan(1024, args.repeats)
    if 'length' in parts:
        bench_length([int(x) for x in args.lengths.split(',')], args.repeats)
    if 'train' in parts:
        bench_train(args.train_hidden, args.train_seq, 2, max(3, args.repeats))


if __name__ == '__main__':
    main()
