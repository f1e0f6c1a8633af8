"""BERT training throughput and MFU: megatron-core BertModel against the same model as Hugging Face
`MegatronBertForPreTraining`, in one process, alternating steps.

Both models have the same architecture and the same weights (HF's are mapped from ours with
megatron/core/models/bert/hf_weight_mapping.py), the same exact-GeLU MLP, dropout 0.1, the same
batch (random ids, 15 % masked positions, random sentence-order labels), the same loss (masked-LM
mean over the masked positions + sentence-order cross entropy) and the same optimizer
(torch.optim.AdamW, lr 1e-4, weight decay 0.01). Steps alternate ours / HF so that both see the
same machine load; the median step time of each gives tokens/s and the ratio.

MFU = model FLOPs per second / peak FLOPs. Model FLOPs per step (forward + backward = 3 x forward
matmuls): 3 * (L * (24 b s h^2 + 4 b s^2 h) + 2 b s h^2 [LM-head dense] + 2 b s h V [logits]).
The peak is --peak-tflops when given, else the fp32 (or bf16) matmul throughput measured in this
process on a large square GEMM (an achievable peak, not the datasheet one).

Usage:
    python benchmarks/bench_bert.py                  # ~110M BERT-base: 12 x 768, seq 128, batch 8
    python benchmarks/bench_bert.py --small          # 2 x 128, seq 64, batch 4: a quick check
"""

import argparse
import statistics
import time

import torch


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--num-layers', type=int, default=12)
    parser.add_argument('--hidden-size', type=int, default=768)
    parser.add_argument('--num-attention-heads', type=int, default=12)
    parser.add_argument('--vocab-size', type=int, default=30592, help='padded vocabulary')
    parser.add_argument('--seq-length', type=int, default=128)
    parser.add_argument('--micro-batch-size', type=int, default=8)
    parser.add_argument('--steps', type=int, default=4, help='measured steps per model')
    parser.add_argument('--warmup', type=int, default=1, help='unmeasured steps per model')
    parser.add_argument('--bf16', action='store_true', help='autocast to bf16 (both models)')
    parser.add_argument(
        '--peak-tflops',
        type=float,
        default=None,
        help='peak TFLOP/s for MFU (default: measured GEMM throughput)',
    )
    parser.add_argument('--threads', type=int, default=0, help='torch threads on CPU (0 = default)')
    parser.add_argument('--small', action='store_true', help='tiny model for a quick check')
    args = parser.parse_args()
    if args.small:
        args.num_layers, args.hidden_size, args.num_attention_heads = 2, 128, 4
        args.seq_length, args.micro_batch_size, args.steps = 64, 4, 3
    return args


def _init_single_process():
    import socket

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group(
        backend='nccl' if torch.cuda.is_available() else 'gloo',
        init_method=f'tcp://127.0.0.1:{port}',
        rank=0,
        world_size=1,
    )
    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def _build_models(args, device):
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.bert.hf_weight_mapping import mcore_to_megatron_bert_hf_state_dict
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    ours = BertModel(
        config=config,
        num_tokentypes=2,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        share_embeddings_and_output_weights=True,
        add_binary_head=True,
    ).to(device)
    hf_config = MegatronBertConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=args.seq_length,
        type_vocab_size=2,
        hidden_act='gelu',
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    hf = MegatronBertForPreTraining(hf_config).to(device)
    missing, unexpected = hf.load_state_dict(
        mcore_to_megatron_bert_hf_state_dict(ours.state_dict(), config), strict=False
    )
    assert not unexpected and not [k for k in missing if 'position_ids' not in k], missing
    return ours, hf


def _batch(args, device, seed):
    g = torch.Generator().manual_seed(seed)
    b, s, v = args.micro_batch_size, args.seq_length, args.vocab_size
    ids = torch.randint(1000, v - 100, (b, s), generator=g)
    types = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous()
    padding = torch.ones(b, s, dtype=torch.long)
    loss_mask = (torch.rand(b, s, generator=g) < 0.15).float()
    labels = torch.where(loss_mask.bool(), ids, torch.full_like(ids, -1))
    is_random = torch.randint(0, 2, (b,), generator=g)
    return {
        k: t.to(device)
        for k, t in dict(
            ids=ids,
            types=types,
            padding=padding,
            loss_mask=loss_mask,
            labels=labels,
            is_random=is_random,
        ).items()
    }


def _step_ours(model, optimizer, batch):
    lm_loss, sop_logits = model(
        batch['ids'], batch['padding'], tokentype_ids=batch['types'], lm_labels=batch['labels']
    )
    mask = batch['loss_mask']
    loss = (lm_loss * mask).sum() / mask.sum()
    loss = loss + torch.nn.functional.cross_entropy(sop_logits.float(), batch['is_random'])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step_hf(model, optimizer, batch):
    out = model(
        input_ids=batch['ids'], attention_mask=batch['padding'], token_type_ids=batch['types']
    )
    logits = out.prediction_logits.float()
    lm = torch.nn.functional.cross_entropy(
        logits.view(-1, logits.size(-1)), batch['labels'].clamp(min=0).view(-1), reduction='none'
    )
    mask = batch['loss_mask'].view(-1)
    loss = (lm * mask).sum() / mask.sum()
    loss = loss + torch.nn.functional.cross_entropy(
        out.seq_relationship_logits.float(), batch['is_random']
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _model_flops_per_step(args):
    b, s, h, n, v = (
        args.micro_batch_size,
        args.seq_length,
        args.hidden_size,
        args.num_layers,
        args.vocab_size,
    )
    forward = n * (24 * b * s * h * h + 4 * b * s * s * h) + 2 * b * s * h * h + 2 * b * s * h * v
    return 3 * forward


def _measured_peak_flops(device, dtype):
    n = 2048 if device.type == 'cuda' else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    bm = torch.randn(n, n, device=device, dtype=dtype)
    best = float('inf')
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ bm
        _sync(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * n**3 / best


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def main():
    args = _parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    _init_single_process()
    from megatron.core.utils import get_current_device

    device = get_current_device()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    ours, hf = _build_models(args, device)
    ours.train()
    hf.train()
    optimizers = {
        'ours': torch.optim.AdamW(ours.parameters(), lr=1e-4, weight_decay=0.01),
        'hf': torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.01),
    }
    models = {'ours': (ours, _step_ours), 'hf': (hf, _step_hf)}
    times = {'ours': [], 'hf': []}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    num_params = sum(p.numel() for p in ours.parameters())
    print(
        f'BERT training step: {num_params / 1e6:.1f}M params, layers {args.num_layers}, hidden '
        f'{args.hidden_size}, heads {args.num_attention_heads}, vocab {args.vocab_size}, seq '
        f'{args.seq_length}, micro batch {args.micro_batch_size}, {dtype}, device {device} '
        f'({torch.get_num_threads()} threads)',
        flush=True,
    )
    for i in range(args.warmup + args.steps):
        batch = _batch(args, device, seed=i)
        for name in ('ours', 'hf'):
            model, step = models[name]
            _sync(device)
            start = time.perf_counter()
            with autocast:
                step(model, optimizers[name], batch)
            _sync(device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
        if i >= args.warmup:
            print(
                f'  step {i + 1}/{args.warmup + args.steps}: ours {times["ours"][-1]:.3f}s, '
                f'hf {times["hf"][-1]:.3f}s',
                flush=True,
            )
        else:
            print(f'  step {i + 1}/{args.warmup + args.steps}: warm-up', flush=True)

    peak = args.peak_tflops * 1e12 if args.peak_tflops else _measured_peak_flops(device, dtype)
    flops = _model_flops_per_step(args)
    tokens = args.micro_batch_size * args.seq_length
    print(
        f"peak {'given' if args.peak_tflops else 'measured GEMM'}: {peak / 1e12:.3f} TFLOP/s; "
        f'model FLOPs per step {flops / 1e9:.1f} GFLOP'
    )
    print(f"{'model':<32} {'step (s)':>9} {'tokens/s':>10} {'MFU':>7}")
    rate = {}
    for name, label in (('ours', 'megatron BertModel'), ('hf', 'HF MegatronBertForPreTraining')):
        step_s = statistics.median(times[name])
        rate[name] = tokens / step_s
        print(f'{label:<32} {step_s:>9.3f} {rate[name]:>10.1f} {flops / step_s / peak:>7.1%}')
    print(f"ratio ours / HF (tokens/s): {rate['ours'] / rate['hf']:.3f}")
    torch.distributed.destroy_process_group()


if __name__ == '__main__':
    main()
