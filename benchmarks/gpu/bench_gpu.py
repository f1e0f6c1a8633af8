"""GPU figures, each against a reference measured in the same run (benchmarks/gpu/run_all.sh).

Sections (all in this process, one after the other; a failing section prints FAILED and the
others still run):

- peak: the device's achieved bf16 matmul FLOP/s (8192^3 GEMMs), what MFU is measured against;
- train bf16: a ~1.3B GPT (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304, TP1) through
  the real training layer (initialize_megatron, setup_model_and_optimizer, train_step with the
  Megatron optimizer, fp32 main params, clip 1.0): ms/step, tokens/s, model TFLOP/s (Megatron's
  FLOP formula), MFU; then the same model in plain PyTorch (SDPA is_causal, bf16 autocast, fused
  AdamW, clip 1.0) on the same batches: the ratio ours/plain (goal >= 1.0); and peak memory
  measured (torch.cuda.max_memory_allocated) against Megatron's theoretical weight+optimizer
  (+ activation) memory;
- train fp16: the same model with --fp16 and dynamic loss scaling on the same batches from the
  same initialization: finite losses, skipped iterations, and the largest relative difference of
  its loss curve from bf16's (within --loss-rtol);
- generate: a GPT-2-architecture model of the same size, random weights, built in Hugging Face
  transformers and converted to this package's GPTModel (hf_weight_mapping): greedy generation
  tokens/s of ours (KV cache) and of `transformers` generate, batch 1 and 8, and the share of
  identical generated tokens.

`--dry-run`: tiny sizes on whatever device there is (the CPU in CI), a few seconds: every code
path runs, the figures mean nothing.

Lines starting with `RESULT ` are the summary run_all.sh prints at the end.
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

FULL = dict(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304, mbs=4, steps=10, warmup=3)
TINY = dict(layers=2, hidden=64, heads=4, seq=32, vocab=512, mbs=2, steps=3, warmup=1)


def result(name, text):
    print(f'RESULT {name}: {text}', flush=True)


def _device():
    return torch.device('cuda' if torch.cuda.is_available() else 'cpu')


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_peak(dry_run):
    """Best achieved FLOP/s of a square bf16 GEMM (fp32 on the CPU)."""
    device = _device()
    n = 8192 if device.type == 'cuda' and not dry_run else 256
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(3 if dry_run else 20):
        _sync()
        t = time.perf_counter()
        torch.mm(a, b)
        _sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best, f'{dtype} {n}x{n} matmul'


def _init_megatron(flags):
    from megatron.core import parallel_state
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.initialize import initialize_megatron

    os.environ.setdefault('RANK', '0')
    os.environ.setdefault('WORLD_SIZE', '1')
    os.environ.setdefault('LOCAL_RANK', '0')
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', str(29500 + os.getpid() % 1000))
    destroy_global_vars()
    parallel_state.destroy_model_parallel()
    backend = 'nccl' if torch.cuda.is_available() else 'gloo'
    initialize_megatron(args_list=flags + ['--distributed-backend', backend])


def _model_flags(cfg):
    return [
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
        '--attention-dropout',
        '0',
        '--hidden-dropout',
        '0',
        '--transformer-impl',
        'local',
    ]


def _batches(cfg, n=4):
    """Fixed random token batches on the device, as the dataloader's dicts and (tokens, labels)."""
    from megatron.training.utils import get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        seq = torch.randint(0, cfg['vocab'] - 64, (cfg['mbs'], cfg['seq'] + 1), generator=g)
        tokens, labels = seq[:, :-1].to(_device()), seq[:, 1:].to(_device())
        mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, -1, False, False, False
        )
        out.append(
            dict(
                tokens=tokens,
                labels=labels,
                loss_mask=loss_mask,
                attention_mask=mask,
                position_ids=position_ids,
            )
        )
    return out


def _time_steps(step, cfg):
    """Median seconds of `cfg['steps']` calls of step(i) after `cfg['warmup']` calls."""
    times = []
    for i in range(cfg['warmup'] + cfg['steps']):
        _sync()
        t = time.perf_counter()
        step(i)
        _sync()
        if i >= cfg['warmup']:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def train_ours(cfg, dtype):
    """(median s/step, per-step losses, model FLOPs/step, theoretical memory MB, peak MB)."""
    import pretrain_gpt
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_args
    from megatron.training.theoretical_memory_usage import (
        compute_activation_memory,
        compute_weight_and_optimizer_memory,
    )
    from megatron.training.training import setup_model_and_optimizer, train_step
    from megatron.training.utils import num_floating_point_operations

    precision = ['--bf16'] if dtype == 'bf16' else ['--fp16', '--initial-loss-scale', '4096']
    _init_megatron(
        _model_flags(cfg)
        + precision
        + [
            '--micro-batch-size',
            str(cfg['mbs']),
            '--global-batch-size',
            str(cfg['mbs']),
            '--train-iters',
            '1000',
            '--lr',
            '1e-4',
            '--min-lr',
            '1e-4',
            '--tokenizer-type',
            'NullTokenizer',
            '--vocab-size',
            str(cfg['vocab'] - 1),
            '--make-vocab-size-divisible-by',
            '128',
            '--clip-grad',
            '1.0',
            '--seed',
            '1234',
        ]
    )
    args = get_args()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    model, optimizer, scheduler = setup_model_and_optimizer(
        pretrain_gpt.model_provider, ModelType.encoder_or_decoder
    )
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    batches = _batches(cfg)
    losses, skipped = [], []

    def step(i):
        args.curr_iteration = i
        loss_dict, skip, _, _ = train_step(
            pretrain_gpt.forward_step,
            iter([batches[i % len(batches)]]),
            model,
            optimizer,
            scheduler,
            config,
        )
        losses.append(float(loss_dict['lm loss']))
        skipped.append(skip)

    seconds = _time_steps(step, cfg)
    flops = num_floating_point_operations(args, cfg['mbs'])
    theory = compute_weight_and_optimizer_memory(args) / 2**20
    activation = compute_activation_memory(args, num_microbatches=1) / 2**20
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return dict(
        seconds=seconds,
        losses=losses,
        skipped=sum(skipped),
        flops=flops,
        theory_weights_mb=theory,
        theory_activation_mb=activation,
        peak_mb=peak,
    )


class _PlainGPT(torch.nn.Module):
    """The same GPT in plain PyTorch: pre-LN blocks, SDPA is_causal, tied output layer."""

    def __init__(self, cfg):
        super().__init__()
        h, self.heads = cfg['hidden'], cfg['heads']
        self.wte = torch.nn.Embedding(cfg['vocab'], h)
        self.wpe = torch.nn.Embedding(cfg['seq'], h)
        self.blocks = torch.nn.ModuleList()
        for _ in range(cfg['layers']):
            block = torch.nn.ModuleDict(
                dict(
                    ln1=torch.nn.LayerNorm(h),
                    qkv=torch.nn.Linear(h, 3 * h),
                    proj=torch.nn.Linear(h, h),
                    ln2=torch.nn.LayerNorm(h),
                    fc1=torch.nn.Linear(h, 4 * h),
                    fc2=torch.nn.Linear(4 * h, h),
                )
            )
            self.blocks.append(block)
        self.lnf = torch.nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        b, s = tokens.shape
        x = self.wte(tokens) + self.wpe(torch.arange(s, device=tokens.device))
        for blk in self.blocks:
            q, k, v = blk['qkv'](blk['ln1'](x)).split(x.shape[-1], dim=-1)
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, np, s, hn]
            x = x + blk['proj'](a.transpose(1, 2).reshape(b, s, -1))
            x = x + blk['fc2'](F.gelu(blk['fc1'](blk['ln2'](x)), approximate='tanh'))
        logits = self.lnf(x) @ self.wte.weight.t()  # [b, s, v]
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def train_plain(cfg):
    """Median s/step of the plain model (bf16 autocast on the GPU, fused AdamW, clip 1.0)."""
    device = _device()
    model = _PlainGPT(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    fused = {'fused': True} if device.type == 'cuda' else {}
    opt = torch.optim.AdamW(
        [{'params': decay, 'weight_decay': 0.01}, {'params': no_decay, 'weight_decay': 0.0}],
        lr=1e-4,
        **fused,
    )
    batches = _batches(cfg)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == 'cuda')

    def step(i):
        opt.zero_grad(set_to_none=True)
        batch = batches[i % len(batches)]
        with autocast:
            loss = model(batch['tokens'], batch['labels'])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    seconds = _time_steps(step, cfg)
    return seconds


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_train(cfg, peak, out_dir, loss_rtol):
    tokens = cfg['mbs'] * cfg['seq']
    ours = train_ours(cfg, 'bf16')
    _free()
    plain = train_plain(cfg)
    _free()
    achieved = ours['flops'] / ours['seconds']
    result(
        'train bf16',
        f"{ours['seconds'] * 1e3:.1f} ms/step, {tokens / ours['seconds']:.0f} tokens/s, "
        f"{achieved / 1e12:.1f} TFLOP/s, MFU {100 * achieved / peak:.1f}% of the measured peak",
    )
    result(
        'train bf16 vs plain PyTorch+SDPA',
        f"plain {plain * 1e3:.1f} ms/step, {tokens / plain:.0f} tokens/s; ratio ours/plain "
        f'(tokens/s) {plain / ours["seconds"]:.3f} (goal >= 1.0)',
    )
    theory = ours['theory_weights_mb'] + ours['theory_activation_mb']
    measured = 'n/a (no CUDA allocator on the CPU)'
    if ours['peak_mb'] is not None:
        measured = f"{ours['peak_mb']:.0f} MB ({ours['peak_mb'] / theory:.2f}x the theory)"
    result(
        'memory',
        f"measured peak {measured}; theoretical weight+optimizer {ours['theory_weights_mb']:.0f}"
        f" MB + activation {ours['theory_activation_mb']:.0f} MB = {theory:.0f} MB",
    )
    fp16 = train_ours(cfg, 'fp16')
    _free()
    finite = all(math.isfinite(v) for v in fp16['losses'])
    rel = max(abs(a - b) / abs(b) for a, b in zip(fp16['losses'], ours['losses']))
    verdict = 'OK' if finite and rel <= loss_rtol else 'MISMATCH'
    result(
        'train fp16 (dynamic loss scale)',
        f"{fp16['seconds'] * 1e3:.1f} ms/step, {tokens / fp16['seconds']:.0f} tokens/s, "
        f'finite: {finite}, skipped iterations: {fp16["skipped"]}, largest relative loss '
        f'difference from bf16 over {len(fp16["losses"])} steps: {rel:.2e} (tolerance '
        f'{loss_rtol:g}): {verdict}',
    )
    with open(os.path.join(out_dir, 'train_losses.json'), 'w') as f:
        json.dump({'bf16': ours['losses'], 'fp16': fp16['losses']}, f)
    return verdict == 'OK'


def section_generate(cfg, new_tokens, prompt_length):
    """Our KV-cached greedy generation vs transformers' generate on the same converted weights."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        result('generate', 'skipped: transformers is not installed')
        return True
    import importlib.util

    from megatron.core.models.gpt import hf_weight_mapping as hfm
    from megatron.inference.text_generation.generation import (
        generate_tokens_probs_and_return_on_first_stage,
    )
    from megatron.training.training import get_model

    device = _device()
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    _init_megatron(
        _model_flags(cfg)
        + (['--bf16'] if dtype == torch.bfloat16 else [])
        + [
            '--micro-batch-size',
            '1',
            '--tokenizer-type',
            'GPT2BPETokenizer',
            '--vocab-file',
            os.path.join(REPO, 'data', 'gpt2', 'gpt2-vocab.json'),
            '--merge-file',
            os.path.join(REPO, 'data', 'gpt2', 'gpt2-merges.txt'),
            '--make-vocab-size-divisible-by',
            '1',
            '--max-tokens-to-oom',
            '100000',
        ]
    )
    spec = importlib.util.spec_from_file_location(
        'run_text_generation_server', os.path.join(REPO, 'tools', 'run_text_generation_server.py')
    )
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    hf_config = GPT2Config(
        n_layer=cfg['layers'],
        n_embd=cfg['hidden'],
        n_head=cfg['heads'],
        n_positions=cfg['seq'],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    with torch.device(device):
        hf = GPT2LMHeadModel(hf_config)
    hf = hf.to(dtype).eval()
    model = get_model(server.model_provider, wrap_with_ddp=False)[0]
    inner = model.module if hasattr(model, 'module') else model  # Float16Module in bf16
    inner.load_state_dict(
        hfm.gpt2_hf_to_mcore_state_dict(hf.state_dict(), inner.config), strict=False
    )
    model.eval()

    def ours(prompts):
        tokens = torch.cat([prompts, prompts.new_zeros(prompts.shape[0], new_tokens)], dim=1)
        lengths = torch.full((prompts.shape[0],), prompts.shape[1], dtype=torch.long)
        return generate_tokens_probs_and_return_on_first_stage(
            model,
            tokens,
            lengths,
            top_k=1,
            use_eod_token_for_early_termination=False,
            prevent_newline_after_colon=False,
        )[0]

    def theirs(prompts):
        return hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=50256,
        )

    g = torch.Generator().manual_seed(1)
    for batch in (1, 8):
        prompts = torch.randint(0, 50000, (batch, prompt_length), generator=g).to(device)
        seconds = {}
        outputs = {}
        with torch.no_grad():
            for name, fn in (('ours', ours), ('hf', theirs), ('ours', ours), ('hf', theirs)):
                _sync()
                t = time.perf_counter()
                outputs[name] = fn(prompts)
                _sync()
                seconds[name] = time.perf_counter() - t  # the second (warm) run counts
        generated = outputs['ours'][:, prompt_length:].cpu()
        same = (generated == outputs['hf'][:, prompt_length:].cpu()).float().mean().item()
        rate = {k: batch * new_tokens / v for k, v in seconds.items()}
        result(
            f'generate batch {batch}',
            f"ours {rate['ours']:.0f} tokens/s, transformers generate {rate['hf']:.0f} tokens/s, "
            f"ratio {rate['ours'] / rate['hf']:.2f}; identical greedy tokens {100 * same:.0f}%",
        )
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dry-run', action='store_true', help='tiny sizes, any device')
    parser.add_argument('--out-dir', default='/tmp/megatron_gpu_bench')
    parser.add_argument('--micro-batch-size', type=int, default=None)
    parser.add_argument('--loss-rtol', type=float, default=2e-2)
    parser.add_argument('--sections', nargs='+', default=['train', 'generate'])
    cli = parser.parse_args()
    cfg = dict(TINY if cli.dry_run else FULL)
    if cli.micro_batch_size:
        cfg['mbs'] = cli.micro_batch_size
    os.makedirs(cli.out_dir, exist_ok=True)
    if not cli.dry_run and not torch.cuda.is_available():
        print('error: no CUDA device (use --dry-run for the CPU check)', file=sys.stderr)
        return 2
    import importlib.util

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'
    missing = [
        m
        for m in ('transformers', 'regex', 'tiktoken', 'tensorboard', 'pytest')
        if importlib.util.find_spec(m) is None
    ]
    result(
        'environment',
        f'torch {torch.__version__}, CUDA device: {name}, missing optional packages: '
        f'{missing or "none"}; model {cfg}',
    )
    peak, what = matmul_peak(cli.dry_run)
    result('peak', f'{peak / 1e12:.1f} TFLOP/s ({what}, best of the runs)')
    ok = True
    for section in cli.sections:
        try:
            if section == 'train':
                ok &= section_train(cfg, peak, cli.out_dir, cli.loss_rtol)
            elif section == 'generate':
                gen = dict(cfg, seq=1024 if not cli.dry_run else 64)
                ok &= section_generate(gen, 8 if cli.dry_run else 128, 4 if cli.dry_run else 128)
        except Exception:
            traceback.print_exc()
            result(section, 'FAILED (traceback above)')
            ok = False
        _free()
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
