"""MoE training step: GPTModel with MoE layers vs Hugging Face MixtralForCausalLM, and MoE variants.

Parts (each prints ours, the reference and the ratio from one run; the two sides of a comparison
alternate step by step in the same process(es), so load from other processes hits both alike; the
figure is the median over the timed steps, and the ratio of the best steps, which a loaded
shared machine disturbs least):

1. `hf`: training step (forward, backward, AdamW) of a Mixtral-style model (8 experts, top-2,
   SwiGLU experts, RMSNorm, RoPE, GQA, untied output; ~100M parameters with the default shape) in
   GPTModel (local spec, `get_megatron_optimizer`: torch's fused AdamW) vs MixtralForCausalLM with
   the same config and weights' shapes and `torch.optim.AdamW` (its defaults); both compute the
   load-balancing loss (coefficient 1e-2). Ratio = tokens/s ours / HF.
2. `grouped`: `--moe-grouped-gemm` experts vs sequential experts (same model otherwise).
3. `ep` (CPU only, 2 gloo processes x 1 thread): data parallel 2 with expert parallel 2 vs expert
   parallel 1 (gradients all-reduced over the data-parallel ranks as DDP does, experts over their
   expert-data-parallel group), and the share of the step the token dispatcher (permutation and
   unpermutation, forward) takes, for the allgather and alltoall dispatchers.

`--device cuda --dtype bf16` runs parts 1 and 2 on one GPU in bf16 (NCCL process group of one rank)
and prints MFU: model FLOPs (6 x active parameters per token + attention) over the step time and
`--peak-tflops` (default 989, H100 SXM bf16 dense).

Usage: python benchmarks/bench_moe.py [--parts hf grouped ep] [--steps 3] [--threads 2]
       [--layers 4 --hidden 512 --ffn 1792 --experts 8 --topk 2 --seq 256 --mbs 4 --vocab 8192]
       [--device cuda --dtype bf16 [--peak-tflops 989]]
"""

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _init(cli, rank=0, world_size=1, port=None):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    backend = 'nccl' if cli.device == 'cuda' else 'gloo'
    port = port or _free_port()
    torch.distributed.init_process_group(
        backend, init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size
    )
    if cli.device == 'cuda':
        torch.cuda.set_device(rank)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=cli.ep)
    model_parallel_cuda_manual_seed(0)


def _config(cli, **overrides):
    import torch.nn.functional as F

    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=cli.layers,
        hidden_size=cli.hidden,
        num_attention_heads=cli.heads,
        num_query_groups=cli.groups,
        ffn_hidden_size=cli.ffn,
        num_moe_experts=cli.experts,
        moe_router_topk=cli.topk,
        moe_aux_loss_coeff=1e-2,
        normalization='RMSNorm',
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=cli.dtype == 'bf16',
        params_dtype=DTYPES[cli.dtype],
        expert_model_parallel_size=cli.ep,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_ours(cli, batches, pg_collection=None, **overrides):
    """step(i) of GPTModel + get_megatron_optimizer on one micro-batch; step.model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    config = _config(cli, **overrides)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(cli.experts, config.moe_grouped_gemm),
        vocab_size=cli.vocab,
        max_sequence_length=cli.seq,
        position_embedding_type='rope',
        rotary_base=1000000,
        share_embeddings_and_output_weights=False,
        pg_collection=pg_collection,
    ).to(device=_device(cli), dtype=DTYPES[cli.dtype])
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer='adam',
            lr=1e-4,
            weight_decay=0.01,
            clip_grad=0.0,
            bf16=cli.dtype == 'bf16',
            params_dtype=DTYPES[cli.dtype],
        ),
        [model],
    )
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=_device(cli)))
    position_ids = torch.arange(cli.seq, device=_device(cli)).unsqueeze(0).expand(cli.mbs, -1)

    def step(i, reduce_grads=None):
        opt.zero_grad(set_to_none=True)
        tokens, labels = batches[i % len(batches)]
        losses = model(tokens, position_ids, None, labels=labels)  # [b, s]
        losses.float().mean().backward()
        if reduce_grads is not None:
            reduce_grads(model)
        opt.step()

    step.model = model
    return step


def build_hf(cli, batches):
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=cli.vocab,
        hidden_size=cli.hidden,
        intermediate_size=cli.ffn,
        num_hidden_layers=cli.layers,
        num_attention_heads=cli.heads,
        num_key_value_heads=cli.groups,
        num_local_experts=cli.experts,
        num_experts_per_tok=cli.topk,
        max_position_embeddings=cli.seq,
        rope_theta=1e6,
        output_router_logits=True,
        router_aux_loss_coef=1e-2,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM(config).to(device=_device(cli), dtype=DTYPES[cli.dtype])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(i):
        opt.zero_grad(set_to_none=True)
        tokens, labels = batches[i % len(batches)]
        out = model(input_ids=tokens)
        loss = torch.nn.functional.cross_entropy(
            out.logits.float().view(-1, cli.vocab), labels.reshape(-1)
        )
        (loss + out.aux_loss * config.router_aux_loss_coef).backward()
        opt.step()

    step.model = model
    return step


def _device(cli):
    return torch.device('cuda', torch.cuda.current_device()) if cli.device == 'cuda' else 'cpu'


def _batches(cli, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        seq = torch.randint(0, cli.vocab, (cli.mbs, cli.seq + 1), generator=g)
        out.append(
            (seq[:, :-1].contiguous().to(_device(cli)), seq[:, 1:].contiguous().to(_device(cli)))
        )
    return out


def _sync(cli):
    if cli.device == 'cuda':
        torch.cuda.synchronize()


def _alternate(cli, steps):
    """Median seconds per step of each named step function, run alternately."""
    times = {name: [] for name in steps}
    for i in range(cli.steps + 1):
        for name, step in steps.items():
            _sync(cli)
            t = time.perf_counter()
            step(i)
            _sync(cli)
            if i > 0:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}, times


def _flops_per_token(cli):
    """6 x active parameters + attention scores (Megatron's convention, causal not halved)."""
    h, f, layers = cli.hidden, cli.ffn, cli.layers
    kv = h // cli.heads * cli.groups
    attention = 2 * h * h + 2 * h * kv
    experts = cli.topk * 3 * h * f
    router = cli.experts * h
    dense = layers * (attention + experts + router) + cli.vocab * h
    return 6 * dense + 12 * layers * cli.seq * h


def run_single_process(cli):
    cli.ep = 1
    _init(cli)
    batches = _batches(cli)
    tokens = cli.mbs * cli.seq
    print(
        f'shape: layers {cli.layers}, hidden {cli.hidden}, ffn {cli.ffn} x {cli.experts} experts '
        f'(top-{cli.topk}), heads {cli.heads} / {cli.groups} kv, seq {cli.seq}, micro batch '
        f'{cli.mbs}, vocab {cli.vocab}; device {cli.device}, {cli.dtype}, threads '
        f'{torch.get_num_threads()}'
    )
    if 'hf' in cli.parts:
        steps = {'ours': build_ours(cli, batches), 'hf': build_hf(cli, batches)}
        n = {k: sum(p.numel() for p in s.model.parameters()) for k, s in steps.items()}
        print(f'parameters: ours {n["ours"] / 1e6:.1f}M, hf {n["hf"] / 1e6:.1f}M')
        med, times = _alternate(cli, steps)
        _report(cli, med, times, tokens, 'ours', 'hf', 'ours / HF Mixtral')
        del steps
    if 'grouped' in cli.parts:
        steps = {
            'grouped': build_ours(cli, batches, moe_grouped_gemm=True),
            'sequential': build_ours(cli, batches),
        }
        med, times = _alternate(cli, steps)
        _report(cli, med, times, tokens, 'grouped', 'sequential', 'grouped / sequential')
    torch.distributed.destroy_process_group()


def _report(cli, med, times, tokens, a, b, label):
    for name in (a, b):
        line = (
            f'{name:>10}: {med[name] * 1000:9.1f} ms/step  {tokens / med[name]:9.1f} tokens/s  '
            f'(min {min(times[name]) * 1000:.1f}, max {max(times[name]) * 1000:.1f} ms)'
        )
        if cli.device == 'cuda':
            mfu = _flops_per_token(cli) * tokens / med[name] / (cli.peak_tflops * 1e12)
            line += f'  MFU {100 * mfu:.1f}%'
        print(line)
    best = min(times[b]) / min(times[a])
    print(f'ratio {label} (tokens/s): {med[b] / med[a]:.3f} (median), {best:.3f} (best steps)')
    # One summary line per comparison for benchmarks/gpu/run_all.sh, which collects RESULT lines.
    summary = f'RESULT bench_moe {cli.device} {cli.dtype}: {label} tokens/s {med[b] / med[a]:.3f}'
    if cli.device == 'cuda':
        mfu = _flops_per_token(cli) * tokens / med[a] / (cli.peak_tflops * 1e12)
        summary += f', MFU {a} {100 * mfu:.1f}%'
    print(summary)


# ---------------------------------------------------------------------------------------------
# expert parallelism (2 gloo processes)


def _reduce_grads(model, expert_parallel):
    """DDP's reduction: dense gradients averaged over data parallel; experts (with ep > 1) summed
    over their expert-data-parallel group and scaled 1/dp."""
    from megatron.core import parallel_state

    dp = torch.distributed.get_world_size()
    dense, experts = [], []
    for p in model.parameters():
        if p.grad is not None:
            (experts if expert_parallel and not getattr(p, 'allreduce', True) else dense).append(
                p.grad
            )
    for grads, group in (
        (dense, None),
        (experts, parallel_state.get_data_modulo_expert_parallel_group(with_context_parallel=True)),
    ):
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads]) / dp
        if torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _dispatch_timer(model):
    """Wrap every dispatcher's permutation / unpermutation with a wall-clock accumulator."""
    total = [0.0]
    for module in model.modules():
        dispatcher = getattr(module, 'token_dispatcher', None)
        if dispatcher is None:
            continue
        for name in ('token_permutation', 'token_unpermutation'):
            original = getattr(dispatcher, name)

            def timed(*args, _original=original, **kwargs):
                t = time.perf_counter()
                out = _original(*args, **kwargs)
                total[0] += time.perf_counter() - t
                return out

            setattr(dispatcher, name, timed)
    return total


def _ep_worker(rank, cli, port, results):
    torch.set_num_threads(1)
    cli.ep = 2
    _init(cli, rank, 2, port)
    batches = _batches(cli, seed=rank)
    steps, dispatch = {}, {}
    for dispatcher in ('allgather', 'alltoall'):
        step = build_ours(cli, batches, moe_token_dispatcher_type=dispatcher)
        dispatch[f'ep2 {dispatcher}'] = _dispatch_timer(step.model)
        steps[f'ep2 {dispatcher}'] = lambda i, s=step: s(
            i, reduce_grads=lambda m: _reduce_grads(m, True)
        )
    # Expert parallel 1 beside it: the MoE layers get one-rank expert groups.
    from megatron.core.process_groups_config import ProcessGroupCollection

    singles = [torch.distributed.new_group([r]) for r in range(2)]
    ep1_groups = ProcessGroupCollection(ep=singles[rank], tp_ep=singles[rank])
    ep1 = build_ours(
        cli,
        batches,
        pg_collection=ep1_groups,
        expert_model_parallel_size=1,
        moe_token_dispatcher_type='alltoall',
    )
    dispatch['ep1'] = _dispatch_timer(ep1.model)
    steps['ep1'] = lambda i: ep1(i, reduce_grads=lambda m: _reduce_grads(m, False))
    med, times = _alternate(cli, steps)
    calls = cli.steps + 1
    shares = {k: dispatch[k][0] / calls / med[k] for k in steps}
    if rank == 0:
        results.put((med, times, shares))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_expert_parallel(cli):
    port = _free_port()
    ctx = mp.get_context('spawn')
    results = ctx.Queue()
    procs = [ctx.Process(target=_ep_worker, args=(r, cli, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    med, times, shares = results.get()
    for p in procs:
        p.join()
    tokens = 2 * cli.mbs * cli.seq
    print(
        'expert parallelism: 2 gloo processes x 1 thread, data parallel 2 (global batch '
        f'{2 * cli.mbs} sequences)'
    )
    for name in med:
        print(
            f'{name:>14}: {med[name] * 1000:9.1f} ms/step  {tokens / med[name]:9.1f} tokens/s  '
            f'dispatcher (forward) {100 * shares[name]:.1f}% of the step'
        )
    print(f'ratio ep2 alltoall / ep1 (tokens/s): {med["ep1"] / med["ep2 alltoall"]:.3f}')
    print(f'ratio ep2 allgather / ep1 (tokens/s): {med["ep1"] / med["ep2 allgather"]:.3f}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        '--parts', nargs='+', default=['hf', 'grouped', 'ep'], choices=['hf', 'grouped', 'ep']
    )
    parser.add_argument('--steps', type=int, default=3, help='timed steps (after one warm-up)')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--hidden', type=int, default=512)
    parser.add_argument('--ffn', type=int, default=1792)
    parser.add_argument('--heads', type=int, default=8)
    parser.add_argument('--groups', type=int, default=4)
    parser.add_argument('--experts', type=int, default=8)
    parser.add_argument('--topk', type=int, default=2)
    parser.add_argument('--seq', type=int, default=256)
    parser.add_argument('--mbs', type=int, default=4)
    parser.add_argument('--vocab', type=int, default=8192)
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cpu')
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--peak-tflops', type=float, default=989.0)
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    if cli.device == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: no CUDA device')
    if any(p in cli.parts for p in ('hf', 'grouped')):
        run_single_process(cli)
    if 'ep' in cli.parts:
        if cli.device == 'cuda':
            print('ep: skipped on cuda (needs two devices; run on the CPU)')
        else:
            run_expert_parallel(cli)


if __name__ == '__main__':
    main()
