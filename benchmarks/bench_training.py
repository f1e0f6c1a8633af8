"""Training-step throughput of a ~125M GPT: this framework vs the same model in plain PyTorch.

Both run in this process on the same device with the same shapes (12 layers, hidden 768, 12 heads,
seq 256, GPT-2 padded vocab 50304, tied embeddings), the same batch, AdamW with the same
hyper-parameters and weight-decay groups, and gradient clipping at 1.0. The framework side goes
through the real training layer: initialize_megatron, setup_model_and_optimizer (GPTModel, DDP,
Megatron optimizer, scheduler) and train_step (get_forward_backward_func). Model FLOPs come from
Megatron's formula (`num_floating_point_operations`); MFU divides the achieved model FLOP/s by the
measured peak of a large fp32 matmul on this device (stated in the output).

The plain side uses torch.optim.AdamW with its defaults (the per-tensor loop on the CPU);
`--plain-fused-adamw` adds a plain run with `fused=True`, the kernel this framework's optimizer
uses.

Usage: python benchmarks/bench_training.py [--steps 3] [--micro-batch-size 2] [--seq-length 256]
       [--torch-compile] [--plain-fused-adamw]
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def matmul_peak_flops(n=2048, repeats=5):
    """Achieved FLOP/s of an n x n fp32 matmul: the practical peak MFU is measured against."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)
    best = float('inf')
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


class PlainBlock(torch.nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(h, eps=1e-5)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.proj = torch.nn.Linear(h, h)
        self.ln2 = torch.nn.LayerNorm(h, eps=1e-5)
        self.fc1 = torch.nn.Linear(h, 4 * h)
        self.fc2 = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (
            t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # [b, np, s, hn]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(torch.nn.Module):
    """The same GPT written in plain PyTorch (pre-LN, learned positions, tied output layer)."""

    def __init__(self, vocab, seq, h, heads, layers):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, h)
        self.wpe = torch.nn.Embedding(seq, h)
        self.blocks = torch.nn.ModuleList([PlainBlock(h, heads) for _ in range(layers)])
        self.lnf = torch.nn.LayerNorm(h, eps=1e-5)
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


def build_plain(batches, cfg, fused_adamw=False):
    """Returns (step(i), number of parameters) for the plain PyTorch model (torch.optim.AdamW
    with its defaults, or with `fused=True`)."""
    model = PlainGPT(cfg['vocab'], cfg['seq'], cfg['hidden'], cfg['heads'], cfg['layers'])
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{'params': decay, 'weight_decay': 0.01}, {'params': no_decay, 'weight_decay': 0.0}],
        lr=1e-4,
        betas=(0.9, 0.999),
        eps=1e-8,
        **({'fused': True} if fused_adamw else {}),
    )

    def step(i):
        opt.zero_grad(set_to_none=True)
        tokens, labels = batches[i % len(batches)]
        loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, sum(p.numel() for p in model.parameters())


def build_megatron(batches, cfg, compile_too):
    """Returns (step(i), number of parameters, model FLOPs per step) for the framework."""
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', str(29500 + os.getpid() % 1000))
    os.environ.setdefault('RANK', '0')
    os.environ.setdefault('WORLD_SIZE', '1')
    import pretrain_gpt
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer, train_step, training_log
    from megatron.training.utils import num_floating_point_operations

    initialize_megatron(
        args_list=[
            '--num-layers',
            str(cfg['layers']),
            '--hidden-size',
            str(cfg['hidden']),
            '--num-attention-heads',
            str(cfg['heads']),
            '--seq-length',
            str(cfg['seq']),
            '--max-position-embeddings',
            str(cfg['seq']),
            '--micro-batch-size',
            str(cfg['mbs']),
            '--global-batch-size',
            str(cfg['mbs']),
            '--train-iters',
            '1000',
            '--lr',
            '1e-4',
            '--tokenizer-type',
            'NullTokenizer',
            '--vocab-size',
            str(cfg['vocab'] - 1),
            '--make-vocab-size-divisible-by',
            '128',
            '--attention-dropout',
            '0',
            '--hidden-dropout',
            '0',
            '--weight-decay',
            '0.01',
            '--clip-grad',
            '1.0',
            '--log-interval',
            '1',
            '--log-throughput',
        ],
        args_defaults={},
    )
    from megatron.training.global_vars import get_timers

    get_timers()('interval-time', log_level=0).start(barrier=True)
    args = get_args()
    assert args.padded_vocab_size == cfg['vocab'], args.padded_vocab_size
    steps = {}
    for name, compiled in (('megatron', False), ('megatron --torch-compile', True)):
        if compiled and not compile_too:
            continue
        args.torch_compile = compiled
        model, optimizer, scheduler = setup_model_and_optimizer(
            pretrain_gpt.model_provider, ModelType.encoder_or_decoder
        )
        steps[name] = _megatron_step(
            model,
            optimizer,
            scheduler,
            batches,
            args,
            train_step,
            training_log,
            pretrain_gpt.forward_step,
        )
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    n_params = sum(p.numel() for p in model[0].parameters())
    return steps, n_params, num_floating_point_operations(args, cfg['mbs'])


def _megatron_step(
    model, optimizer, scheduler, batches, args, train_step, training_log, forward_step
):
    """step(i): train_step on the dataloader-shaped batch (with its causal mask), then the log
    line, as pretrain() runs an iteration with --log-interval 1."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config
    from megatron.training.utils import get_ltor_masks_and_position_ids

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    prepared = []
    for tokens, labels in batches:
        mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, -1, False, False, False
        )
        prepared.append(
            {
                'tokens': tokens,
                'labels': labels,
                'loss_mask': loss_mask,
                'attention_mask': mask,
                'position_ids': position_ids,
            }
        )
    total_loss_dict = {}

    def step(i):
        args.curr_iteration = i
        loss_dict, skipped, grad_norm, num_zeros = train_step(
            forward_step, iter([prepared[i % len(prepared)]]), model, optimizer, scheduler, config
        )
        training_log(
            loss_dict,
            total_loss_dict,
            optimizer.param_groups[0]['lr'],
            i + 1,
            optimizer.get_loss_scale().item(),
            False,
            skipped,
            grad_norm,
            None,
            num_zeros,
        )

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=3, help='timed steps (after one warm-up step)')
    parser.add_argument('--micro-batch-size', type=int, default=2)
    parser.add_argument('--seq-length', type=int, default=256)
    parser.add_argument('--layers', type=int, default=12)
    parser.add_argument('--hidden', type=int, default=768)
    parser.add_argument('--heads', type=int, default=12)
    parser.add_argument(
        '--vocab', type=int, default=50304, help='padded vocabulary (multiple of 128)'
    )
    parser.add_argument('--threads', type=int, default=0, help='torch threads (0: default)')
    parser.add_argument(
        '--torch-compile',
        action='store_true',
        help='also time the --torch-compile path (compilation in the warm-up step)',
    )
    parser.add_argument(
        '--plain-fused-adamw',
        action='store_true',
        help='also time the plain model with torch.optim.AdamW(fused=True)',
    )
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    cfg = dict(
        layers=cli.layers,
        hidden=cli.hidden,
        heads=cli.heads,
        seq=cli.seq_length,
        mbs=cli.micro_batch_size,
        vocab=cli.vocab,
    )
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        seq = torch.randint(0, cfg['vocab'] - 47, (cfg['mbs'], cfg['seq'] + 1), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    tokens_per_step = cfg['mbs'] * cfg['seq']

    peak = matmul_peak_flops()
    steps, n_meg, flops = build_megatron(batches, cfg, cli.torch_compile)
    step_plain, n_plain = build_plain(batches, cfg)
    if cli.plain_fused_adamw:
        steps['plain pytorch, fused AdamW'] = build_plain(batches, cfg, fused_adamw=True)[0]
    steps['plain pytorch'] = step_plain
    # Alternate them so that load from other processes hits all alike; one warm-up step each,
    # then the median of the timed steps.
    times = {name: [] for name in steps}
    for i in range(cli.steps + 1):
        for name, step in steps.items():
            t = time.perf_counter()
            step(i)
            if i > 0:
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(t) for name, t in times.items()}
    peak = max(peak, matmul_peak_flops())

    print(
        f'device: {"cuda" if torch.cuda.is_available() else "cpu"},'
        f' torch threads: {torch.get_num_threads()}'
    )
    print(
        f'model: {cfg["layers"]} layers, hidden {cfg["hidden"]}, {cfg["heads"]} heads,'
        f' seq {cfg["seq"]}, '
        f'vocab {cfg["vocab"]}, micro batch {cfg["mbs"]};'
        f' params megatron {n_meg / 1e6:.1f}M, plain {n_plain / 1e6:.1f}M'
    )
    print(
        f'model FLOPs per step (Megatron formula): {flops / 1e9:.1f} GFLOP; '
        f'fp32 matmul peak measured: {peak / 1e9:.1f} GFLOP/s'
    )
    for name, t in med.items():
        achieved = flops / t
        print(
            f'{name:>24}: {t * 1000:8.1f} ms/step | {tokens_per_step / t:8.1f} tokens/s | '
            f'{achieved / 1e12:.4f} TFLOP/s | MFU {100 * achieved / peak:.1f}%'
        )
    for name, t in med.items():
        if name != 'plain pytorch':
            print(f'ratio {name} / plain (tokens/s): {med["plain pytorch"] / t:.3f}')
    if cli.plain_fused_adamw:
        fused = med['plain pytorch, fused AdamW']
        print(f'ratio megatron / plain with fused AdamW (tokens/s): {fused / med["megatron"]:.3f}')
    torch.distributed.destroy_process_group()


if __name__ == '__main__':
    main()
