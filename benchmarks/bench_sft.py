"""Supervised fine-tuning throughput on the bundled chat set: packed conversations vs one row or one
conversation per sample, and vs a plain Hugging Face Trainer-style loop with padding.

One tiny Llama (examples/sft/make_tiny_llama.py: hidden 128, 2 layers, GQA, vocab 1024, random
weights) is written as a Hugging Face directory and imported with tools/checkpoint/convert.py, so
both sides train the same model from the same weights on the same conversations (the whole of
data/sft/chat.jsonl, ChatML template, loss on the answers only):

- ours, through the real training layer (initialize_megatron, setup_model_and_optimizer,
  train_step with pretrain_gpt.forward_step and --sft), micro-batches of `--micro-batch-size`
  samples of `--seq-length` tokens, three ways of filling the samples: conversations packed
  across rows (the default), one row per sample (Megatron's --sft packing) and one conversation
  per sample;
- the plain loop: transformers' LlamaForCausalLM, batches of B conversations in file order padded
  to the longest (what DataCollatorWithPadding gives a Trainer), labels -100 off the answers,
  torch.optim.AdamW and gradient clipping at 1.0. B is the mean number of conversations in one
  packed micro-batch, so both sides see the same conversations per step.

Useful tokens are the conversations' own tokens (no padding). Printed: the share of non-padding
tokens, the median step time, useful and answer tokens per second (the mean tokens of the timed
steps over the median step time, robust to other processes' load), and the ratios.

Usage: python benchmarks/bench_sft.py [--steps 20] [--seq-length 256] [--micro-batch-size 4]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
CHAT = os.path.join(REPO, 'data', 'sft', 'chat.jsonl')


def write_one_conversation_per_row(path):
    """The chat set with every conversation on its own row (for one conversation per sample)."""
    import json

    from megatron.core.datasets.sft_packing import split_conversations

    with open(CHAT, encoding='utf-8') as f, open(path, 'w', encoding='utf-8') as g:
        for line in f:
            for conversation in split_conversations(json.loads(line)['messages']):
                g.write(json.dumps({'messages': conversation}, ensure_ascii=False) + '\n')
    return path


def prepare_model(work):
    """A tiny random HF Llama (with its tokenizer) and its import at TP1."""
    hf = os.path.join(work, 'hf')
    subprocess.run(
        [sys.executable, 'examples/sft/make_tiny_llama.py', '--output', hf],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    ckpt = os.path.join(work, 'imported')
    subprocess.run(
        [sys.executable, 'tools/checkpoint/convert.py', '--model-type', 'GPT', '--loader', 'hf']
        + ['--saver', 'mcore', '--load-dir', hf, '--save-dir', ckpt],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    return hf, ckpt


def build_ours(hf, ckpt, work, cli):
    """step functions of our three sample layouts, and their statistics."""
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', str(29500 + os.getpid() % 1000))
    os.environ.setdefault('RANK', '0')
    os.environ.setdefault('WORLD_SIZE', '1')
    import pretrain_gpt
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training.datasets.sft_dataset import SFTDataset, SFTDatasetConfig
    from megatron.training.global_vars import get_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer, train_step

    initialize_megatron(
        args_list=['--sft', '--tokenizer-type', 'SFTTokenizer', '--tokenizer-model', hf]
        + ['--sft-tokenizer-prompt-format', 'default', '--data-path', CHAT, '--split', '1']
        + ['--load', ckpt, '--use-checkpoint-args', '--finetune', '--no-load-optim']
        + ['--seq-length', str(cli.seq_length), '--micro-batch-size', str(cli.micro_batch_size)]
        + ['--global-batch-size', str(cli.micro_batch_size), '--train-iters', '100000']
        + ['--lr', '1e-4', '--weight-decay', '0.01', '--clip-grad', '1.0', '--log-interval', '1']
        + ['--attention-dropout', '0', '--hidden-dropout', '0', '--distributed-backend', 'gloo'],
        args_defaults={},
    )
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(
        pretrain_gpt.model_provider, ModelType.encoder_or_decoder
    )
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads

    one_per_row = write_one_conversation_per_row(os.path.join(work, 'one_per_row.jsonl'))
    variants = {
        'ours, packed across rows': (CHAT, False),
        "ours, one row per sample (Megatron's)": (CHAT, True),
        'ours, one conversation per sample': (one_per_row, True),
    }
    steps, stats = {}, {}
    for name, (path, one_row) in variants.items():
        ds_config = pretrain_gpt.core_gpt_dataset_config_from_args(args, SFTDatasetConfig)
        ds_config.blend, ds_config.one_row_per_sample = ([path], None), one_row
        ds_config.path_to_cache = os.path.join(work, 'cache')
        dataset = BlendedMegatronDatasetBuilder(
            SFTDataset, [None] * 3, lambda: True, ds_config
        ).build()[0]
        batches = list(
            torch.utils.data.DataLoader(dataset, batch_size=cli.micro_batch_size, drop_last=True)
        )
        useful = [_useful_tokens(dataset, k) for k in range(len(dataset))]
        stats[name] = _stats(dataset, useful, batches, cli)

        def step(i, batches=batches):
            args.curr_iteration = i
            train_step(
                pretrain_gpt.forward_step,
                iter([batches[i % len(batches)]]),
                model,
                optimizer,
                scheduler,
                config,
            )

        steps[name] = step
    return steps, stats


def _useful_tokens(dataset, k):
    """Tokens of the conversations of pack k (with CP padding; here none)."""
    items = dataset.pack_items[dataset.pack_offsets[k] : dataset.pack_offsets[k + 1]]
    from megatron.core.datasets.sft_packing import check_row

    total = 0
    for row, c in items.tolist():
        conversation = check_row(dataset.dataset[row])[c]
        ids = dataset.config.tokenizer.tokenize_conversation(conversation, return_target=False)
        total += min(len(ids), dataset.config.sequence_length + 1)
    return total


def _stats(dataset, useful, batches, cli):
    samples = len(dataset)
    capacity = cli.seq_length + 1
    per_step_useful = [
        sum(useful[j] for j in range(i * cli.micro_batch_size, (i + 1) * cli.micro_batch_size))
        for i in range(len(batches))
    ]
    per_step_answer = [int(b['loss_mask'].sum()) for b in batches]
    return dict(
        samples=samples,
        conversations=int(dataset.pack_items.shape[0]),
        efficiency=sum(useful) / (samples * capacity),
        useful=per_step_useful,
        answer=per_step_answer,
    )


def build_hf(hf, cli, conversations_per_step):
    """The plain Trainer-style loop: padded batches of conversations, labels -100 off answers."""
    import transformers

    from megatron.core.datasets.sft_packing import split_conversations
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer

    tokenizer = SFTTokenizer(hf, 'default')
    import json

    examples = []
    with open(CHAT, encoding='utf-8') as f:
        for line in f:
            for conversation in split_conversations(json.loads(line)['messages']):
                ids, targets = tokenizer.tokenize_conversation(conversation)
                examples.append((ids[: cli.seq_length], targets[: cli.seq_length]))
    batches = []
    for i in range(0, len(examples), conversations_per_step):
        chunk = examples[i : i + conversations_per_step]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, (ids, targets) in enumerate(chunk):
            input_ids[r, : len(ids)] = torch.from_numpy(ids)
            labels[r, : len(ids)] = torch.from_numpy(targets)
            attention_mask[r, : len(ids)] = 1
        batches.append((input_ids, labels, attention_mask))
    model = transformers.LlamaForCausalLM.from_pretrained(hf, local_files_only=True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(i):
        input_ids, labels, attention_mask = batches[i % len(batches)]
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    stats = dict(
        samples=len(batches),
        conversations=len(examples),
        efficiency=sum(int(b[2].sum()) for b in batches) / sum(b[0].numel() for b in batches),
        useful=[int(b[2].sum()) for b in batches],
        answer=[int((b[1][:, 1:] != -100).sum()) for b in batches],
    )
    return step, stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--steps', type=int, default=20, help='timed steps per variant')
    parser.add_argument('--seq-length', type=int, default=256)
    parser.add_argument('--micro-batch-size', type=int, default=4)
    parser.add_argument('--threads', type=int, default=0, help='torch threads (0: default)')
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    work = tempfile.mkdtemp(prefix='bench_sft_')
    hf, ckpt = prepare_model(work)
    steps, stats = build_ours(hf, ckpt, work, cli)
    packed = stats['ours, packed across rows']
    per_step = round(packed['conversations'] / packed['samples'] * cli.micro_batch_size)
    steps['plain HF Trainer-style loop, padded'], stats['plain HF Trainer-style loop, padded'] = (
        build_hf(hf, cli, per_step)
    )

    # Alternate the variants so that load from other processes hits all alike; one warm-up step
    # each, then the median over the timed steps.
    times = {name: [] for name in steps}
    for i in range(cli.steps + 1):
        for name, step in steps.items():
            start = time.perf_counter()
            step(i)
            if i > 0:
                times[name].append((i, time.perf_counter() - start))
    print(
        f'bench_sft: data/sft/chat.jsonl, tiny Llama (hidden 128, 2 layers, vocab 1024), seq '
        f'{cli.seq_length}, micro-batch {cli.micro_batch_size}; plain loop {per_step} '
        f'conversations per step; {cli.steps} timed steps; torch {torch.__version__}, '
        f'{torch.get_num_threads()} threads'
    )
    header = (
        f"{'variant':42s} {'samples':>7s} {'non-pad %':>9s} {'step ms':>8s} "
        f"{'useful tok/s':>12s} {'answer tok/s':>12s}"
    )
    print(header)
    rates = {}
    for name, measured in times.items():
        s = stats[name]
        median = statistics.median(t for _, t in measured)
        useful = statistics.mean(s['useful'][i % len(s['useful'])] for i, _ in measured)
        answer = statistics.mean(s['answer'][i % len(s['answer'])] for i, _ in measured)
        rates[name] = useful / median
        print(
            f"{name:42s} {s['samples']:7d} {100 * s['efficiency']:9.1f} {1000 * median:8.1f} "
            f'{useful / median:12.0f} {answer / median:12.0f}'
        )
    base = rates['ours, packed across rows']
    for name in list(rates)[1:]:
        print(f'useful tokens/s, packed / {name}: {base / rates[name]:.2f}x')


if __name__ == '__main__':
    main()
