"""T5 training throughput against Hugging Face MBart, and the bubble of the encoder-decoder 1F1B
pipeline schedule.

1. Throughput (one process, fp32): our T5Model (local spec) and transformers'
   MBartForConditionalGeneration with the same architecture and the same weights (its two
   embedding LayerNorms replaced by identity, which makes the two models compute the same
   function), each trained with torch.optim.Adam on the same batches. Steps alternate (ours, HF,
   ours, HF, ...) so that both see the same machine load; tokens/s counts encoder + decoder tokens.
   Printed: ours, HF, and the ratio ours / HF.

2. Pipeline bubble (spawned gloo ranks, PP stages split at `--split-rank`): a T5-shaped stage
   stack whose layers sleep a fixed time in forward (twice that in backward), as if each stage had
   its own device; encoder stages send [s_enc, b, h], decoder stages send [s_dec, b, h] and pass
   the encoder output on. The bubble of a stage = time blocked in p2p / time of the whole
   forward_backward call, printed beside the theory (p - 1) / (m + p - 1) (and (p - 1) / m over
   ideal compute time).

Figures are from whatever machine runs this; on a busy shared CPU they are noisy.

Example:
    python benchmarks/bench_t5.py                      # both parts, small sizes
    python benchmarks/bench_t5.py --part throughput --hidden-size 256 --num-layers 4
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_pipeline import COMPUTE_TIMERS, P2P_TIMERS, AccumulatingTimers, SleepLayer  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402


def _free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# 1. Throughput against MBart


def _t5_and_mbart(args):
    from transformers import MBartConfig, MBartForConditionalGeneration

    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_local_block_spec,
        get_t5_encoder_with_local_block_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    h, heads, ffn = args.hidden_size, args.num_attention_heads, 4 * args.hidden_size
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=h,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    ours = T5Model(
        config,
        get_t5_encoder_with_local_block_spec(args.num_layers),
        get_t5_decoder_with_local_block_spec(args.num_layers),
        vocab_size=args.vocab_size,
        max_sequence_length=args.encoder_seq_length,
        share_embeddings_and_output_weights=True,
    )
    hf = MBartForConditionalGeneration(
        MBartConfig(
            vocab_size=args.vocab_size,
            d_model=h,
            encoder_layers=args.num_layers,
            decoder_layers=args.num_layers,
            encoder_attention_heads=heads,
            decoder_attention_heads=heads,
            encoder_ffn_dim=ffn,
            decoder_ffn_dim=ffn,
            max_position_embeddings=args.encoder_seq_length,
            activation_function='gelu',
            scale_embedding=False,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=args.vocab_size - 1,
        )
    )
    hf.model.encoder.layernorm_embedding = torch.nn.Identity()
    hf.model.decoder.layernorm_embedding = torch.nn.Identity()
    _copy_weights(ours, hf, args)
    return ours, hf


def _copy_weights(ours, hf, args):
    """Megatron -> MBart names (qkv rows per head [nh, 3, hd], kv rows [nh, 2, hd])."""
    nh, h = args.num_attention_heads, args.hidden_size
    sd = ours.state_dict()
    hp = dict(hf.named_parameters())

    def rows(weight, parts):
        w = weight.reshape(nh, parts, h // nh, *weight.shape[1:])  # [nh, parts, hd, ...]
        return [w[:, i].reshape(h, *weight.shape[1:]) for i in range(parts)]

    with torch.no_grad():
        hp['model.shared.weight'].copy_(sd['embedding.word_embeddings.weight'])
        for stack in ('encoder', 'decoder'):
            pos = hp[f'model.{stack}.embed_positions.weight']
            pos[2 : 2 + args.encoder_seq_length].copy_(sd['embedding.position_embeddings.weight'])
            for suffix in ('weight', 'bias'):
                hp[f'model.{stack}.layer_norm.{suffix}'].copy_(
                    sd[f'{stack}.final_layernorm.{suffix}']
                )
            for i in range(args.num_layers):
                o, t = f'{stack}.layers.{i}', f'model.{stack}.layers.{i}'
                for suffix in ('weight', 'bias'):
                    pairs = {
                        'input_layernorm': 'self_attn_layer_norm',
                        'self_attention.linear_proj': 'self_attn.out_proj',
                        'pre_mlp_layernorm': 'final_layer_norm',
                        'mlp.linear_fc1': 'fc1',
                        'mlp.linear_fc2': 'fc2',
                    }
                    if stack == 'decoder':
                        pairs.update(
                            {
                                'pre_cross_attn_layernorm': 'encoder_attn_layer_norm',
                                'cross_attention.linear_q': 'encoder_attn.q_proj',
                                'cross_attention.linear_proj': 'encoder_attn.out_proj',
                            }
                        )
                        for name, part in zip(
                            'kv', rows(sd[f'{o}.cross_attention.linear_kv.{suffix}'], 2)
                        ):
                            hp[f'{t}.encoder_attn.{name}_proj.{suffix}'].copy_(part)
                    for a, b in pairs.items():
                        hp[f'{t}.{b}.{suffix}'].copy_(sd[f'{o}.{a}.{suffix}'])
                    for name, part in zip(
                        'qkv', rows(sd[f'{o}.self_attention.linear_qkv.{suffix}'], 3)
                    ):
                        hp[f'{t}.self_attn.{name}_proj.{suffix}'].copy_(part)
        hf.final_logits_bias.copy_(sd['output_layer.bias'].view(1, -1))


def _batches(args, n):
    g = torch.Generator().manual_seed(0)
    out = []
    b, v = args.micro_batch_size, args.vocab_size
    se, sd = args.encoder_seq_length, args.decoder_seq_length
    causal = torch.ones(sd, sd, dtype=torch.bool).tril()
    for _ in range(n):
        out.append(
            {
                'enc': torch.randint(1, v - 1, (b, se), generator=g),
                'dec': torch.randint(1, v - 1, (b, sd), generator=g),
                'labels': torch.randint(1, v - 1, (b, sd), generator=g),
                # Megatron's masks: True = masked out (no padding in this benchmark).
                'enc_mask': torch.zeros(b, se, se, dtype=torch.bool),
                'dec_mask': (~causal).expand(b, sd, sd),
                'enc_dec_mask': torch.zeros(b, sd, se, dtype=torch.bool),
            }
        )
    return out


def run_throughput(args):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', str(_free_port()))
    torch.distributed.init_process_group('gloo', rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    ours, hf = _t5_and_mbart(args)
    ours.train()
    hf.train()
    opt_ours = torch.optim.Adam(ours.parameters(), lr=1e-4)
    opt_hf = torch.optim.Adam(hf.parameters(), lr=1e-4)

    def step_ours(batch):
        loss = ours(
            batch['enc'],
            batch['dec'],
            batch['enc_mask'],
            batch['dec_mask'],
            batch['enc_dec_mask'],
            lm_labels=batch['labels'],
        ).mean()
        opt_ours.zero_grad(set_to_none=True)
        loss.backward()
        opt_ours.step()
        return loss.item()

    def step_hf(batch):
        logits = hf(input_ids=batch['enc'], decoder_input_ids=batch['dec']).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch['labels'].reshape(-1)
        )
        opt_hf.zero_grad(set_to_none=True)
        loss.backward()
        opt_hf.step()
        return loss.item()

    batches = _batches(args, args.warmup_steps + args.steps)
    times = {'ours': 0.0, 'hf': 0.0}
    first = {}
    for i, batch in enumerate(batches):
        for name, fn in (('ours', step_ours), ('hf', step_hf)):
            start = time.perf_counter()
            loss = fn(batch)
            elapsed = time.perf_counter() - start
            first.setdefault(name, loss)
            if i >= args.warmup_steps:
                times[name] += elapsed
        print(f'  step {i + 1}/{len(batches)} done', file=sys.stderr, flush=True)
    seq = args.encoder_seq_length + args.decoder_seq_length
    tokens = args.steps * args.micro_batch_size * seq
    ours_tps, hf_tps = tokens / times['ours'], tokens / times['hf']
    n_params = sum(p.numel() for p in ours.parameters())
    print(
        f'T5 training throughput: {n_params / 1e6:.2f}M params, {args.num_layers}+'
        f'{args.num_layers} layers, hidden {args.hidden_size}, vocab {args.vocab_size}, seq '
        f'{args.encoder_seq_length}/{args.decoder_seq_length}, micro batch '
        f'{args.micro_batch_size}, {torch.get_num_threads()} threads, Adam, fp32'
    )
    print(
        f'  first-step loss: ours {first["ours"]:.6f}  HF MBart {first["hf"]:.6f} '
        '(same weights and batch)'
    )
    print(f'  ours (T5Model)     {ours_tps:10.1f} tokens/s')
    print(f'  HF MBart (patched) {hf_tps:10.1f} tokens/s')
    print(f'  ratio ours / HF    {ours_tps / hf_tps:10.3f}')
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# 2. Encoder-decoder pipeline bubble


class T5StageStack(torch.nn.Module):
    """Sleep layers of one encoder or decoder stage; decoder layers also read the encoder output
    (so its gradient crosses the split, as in T5)."""

    def __init__(self, config, add_encoder, pre_process, num_local, sleep_s):
        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_and_decoder
        self.add_encoder = add_encoder
        self.pre_process = pre_process
        self.layers = torch.nn.ModuleList(SleepLayer(sleep_s) for _ in range(num_local))
        self.cross = torch.nn.Parameter(torch.full((), 0.1))
        self.inputs = [None]

    def set_input_tensor(self, input_tensor):
        self.inputs = input_tensor if isinstance(input_tensor, list) else [input_tensor]

    def forward(self, enc_x, dec_x):
        if self.add_encoder:
            hidden = enc_x if self.pre_process else self.inputs[0]  # [s_enc, b, h]
            for layer in self.layers:
                hidden = hidden + layer(hidden)
            return hidden
        encoder_output = self.inputs[-1]  # [s_enc, b, h]
        hidden = dec_x if self.pre_process else self.inputs[0]  # [s_dec, b, h]
        for layer in self.layers:
            hidden = hidden + layer(hidden) + self.cross * encoder_output.mean(0, keepdim=True)
        return hidden


def _bubble_forward_step(data_iterator, model):
    enc_x, dec_x = next(data_iterator)
    out = model(enc_x, dec_x)

    def loss_func(output):
        loss = output.float().pow(2).mean()
        return loss, {'loss': loss.detach()}

    return out, loss_func


def _bubble_rank(rank, world_size, port, args, result_q):
    from megatron.core.model_parallel_config import ModelParallelConfig

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world_size
    )
    split = args.split_rank
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world_size, pipeline_model_parallel_split_rank=split
    )
    timers = AccumulatingTimers()
    config = ModelParallelConfig(
        pipeline_model_parallel_size=world_size,
        pipeline_dtype=torch.float32,
        timers=timers,
        deallocate_pipeline_outputs=True,
    )
    config.hidden_size = args.hidden_size
    add_encoder = rank < split
    num_local = args.num_layers // (split if add_encoder else world_size - split)
    model = T5StageStack(
        config, add_encoder, rank in (0, split), num_local, args.sleep_ms_per_layer / 1000.0
    )
    data = [
        (
            torch.randn(args.encoder_seq_length, args.micro_batch_size, args.hidden_size),
            torch.randn(args.decoder_seq_length, args.micro_batch_size, args.hidden_size),
        )
        for _ in range(args.num_microbatches)
    ]
    fb = get_forward_backward_func()
    p2p, compute, totals = [], [], []
    for step in range(args.warmup_steps + args.steps):
        timers.reset()
        torch.distributed.barrier()
        fb(
            forward_step_func=_bubble_forward_step,
            data_iterator=iter(data),
            model=model,
            num_microbatches=args.num_microbatches,
            seq_length=args.encoder_seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
        )
        if step >= args.warmup_steps:
            p2p.append(timers.total(P2P_TIMERS))
            compute.append(timers.total(COMPUTE_TIMERS))
            totals.append(timers.total(['forward-backward']))
    result_q.put((rank, {'p2p': p2p, 'compute': compute, 'total': totals}))
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run_bubble(args):
    p, m, r = args.pipeline_model_parallel_size, args.num_microbatches, args.split_rank
    if not 0 < r < p:
        raise SystemExit(f'--split-rank ({r}) must be in [1, {p - 1}]')
    if args.num_layers % r or args.num_layers % (p - r):
        raise SystemExit(
            f'--num-layers ({args.num_layers}) must divide over {r} encoder and '
            f'{p - r} decoder stages'
        )
    ctx = mp.get_context('spawn')
    result_q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_bubble_rank, args=(i, p, port, args, result_q)) for i in range(p)]
    for proc in procs:
        proc.start()
    results = dict(result_q.get(timeout=600) for _ in range(p))
    for proc in procs:
        proc.join()
    print(
        f'Encoder-decoder 1F1B bubble: PP={p}, split rank {r} ({args.num_layers} encoder + '
        f'{args.num_layers} decoder sleep layers, {args.sleep_ms_per_layer} ms fwd / '
        f'{2 * args.sleep_ms_per_layer} ms bwd each), m={m} micro-batches'
    )
    print(
        f'{"stage":>6} {"role":>8} {"p2p (s)":>10} {"compute (s)":>12} {"step (s)":>10} '
        f'{"idle/step":>10}'
    )
    fractions = []
    for rank in range(p):
        res = results[rank]
        p2p, comp, tot = (sum(res[k]) / len(res[k]) for k in ('p2p', 'compute', 'total'))
        fractions.append(p2p / tot)
        role = 'encoder' if rank < r else 'decoder'
        print(f'{rank:>6} {role:>8} {p2p:>10.3f} {comp:>12.3f} {tot:>10.3f} {p2p / tot:>10.3f}')
    measured = sum(fractions) / len(fractions)
    theory = (p - 1) / (m + p - 1)
    print(
        f'  mean idle/step {measured:.3f}   theory (p-1)/(m+p-1) = {theory:.3f}   ratio '
        f'{measured / theory:.3f}   [(p-1)/m = {(p - 1) / m:.3f}]'
    )
    print(
        '  (stages are unequal when encoder and decoder stages hold different layer counts or '
        'sequence lengths; the theory assumes equal stages)'
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--part', choices=('both', 'throughput', 'bubble'), default='both')
    parser.add_argument('--num-layers', type=int, default=2, help='per stack (encoder, decoder)')
    parser.add_argument('--hidden-size', type=int, default=128)
    parser.add_argument('--num-attention-heads', type=int, default=4)
    parser.add_argument('--vocab-size', type=int, default=8192)
    parser.add_argument('--encoder-seq-length', type=int, default=128)
    parser.add_argument('--decoder-seq-length', type=int, default=32)
    parser.add_argument('--micro-batch-size', type=int, default=8)
    parser.add_argument('--steps', type=int, default=4)
    parser.add_argument('--warmup-steps', type=int, default=1)
    parser.add_argument('--pipeline-model-parallel-size', type=int, default=4)
    parser.add_argument('--split-rank', type=int, default=2)
    parser.add_argument('--num-microbatches', type=int, default=8)
    parser.add_argument('--sleep-ms-per-layer', type=float, default=5.0)
    args = parser.parse_args()
    if args.part in ('both', 'throughput'):
        run_throughput(args)
    if args.part in ('both', 'bubble'):
        if args.part == 'both':
            args.num_layers = max(args.num_layers, 4)
        run_bubble(args)


if __name__ == '__main__':
    main()
