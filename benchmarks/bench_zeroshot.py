"""WikiText perplexity evaluation throughput (tokens/s) of tasks/zeroshot_gpt against
transformers on the same weights and the same windows, in one run.

A random GPT-2-small-sized model (~125M parameters) is built with transformers, saved, imported
with tools/checkpoint/convert.py (hf -> mcore), and evaluated by our `evaluate()` of
tasks/zeroshot_gpt/evaluate.py over the WikiText-layout fixture of tasks/make_fixture_data.py
(--overlapping-eval windows). transformers' GPT2LMHeadModel then scores the same window batches
(the same per-token NLL sum). Tokens/s counts window positions fed to the model (windows x
seq_length); both totals are printed so they can be compared.

Usage:
    python benchmarks/bench_zeroshot.py                           # ~125M, seq 1024, stride 512
    python benchmarks/bench_zeroshot.py --num-layers 2 --hidden-size 128 --seq-length 64 \
        --overlapping-eval 32 --wiki-paragraphs 12                # quick
Figures from a shared, busy CPU machine are noisy: compare the ratio within one run.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO)


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--num-layers', type=int, default=12)
    parser.add_argument('--hidden-size', type=int, default=768)
    parser.add_argument('--num-attention-heads', type=int, default=12)
    parser.add_argument('--seq-length', type=int, default=1024)
    parser.add_argument('--overlapping-eval', type=int, default=512)
    parser.add_argument('--micro-batch-size', type=int, default=4)
    parser.add_argument('--wiki-paragraphs', type=int, default=200)
    return parser.parse_args()


def _hf_checkpoint(args, work):
    import transformers

    config = transformers.GPT2Config(
        vocab_size=50257,
        n_positions=args.seq_length,
        n_embd=args.hidden_size,
        n_layer=args.num_layers,
        n_head=args.num_attention_heads,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf_dir, ours = os.path.join(work, 'hf'), os.path.join(work, 'ours')
    hf.save_pretrained(hf_dir, safe_serialization=True)
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, 'tools', 'checkpoint', 'convert.py'),
            '--model-type',
            'GPT',
            '--loader',
            'hf',
            '--saver',
            'mcore',
            '--load-dir',
            hf_dir,
            '--save-dir',
            ours,
        ],
        check=True,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    return hf, ours


def main():
    args = _parse()
    from tasks.make_fixture_data import build_all

    work = tempfile.mkdtemp(prefix='bench_zeroshot_')
    data = build_all(
        os.path.join(work, 'data'),
        n_train=3,
        n_dev=3,
        race_train_docs=3,
        race_dev_docs=3,
        lambada=0,
        wiki_paragraphs=args.wiki_paragraphs,
    )
    wiki = os.path.join(data, 'wiki.test.tokens')
    hf, ours = _hf_checkpoint(args, work)

    for key, value in (
        ('RANK', '0'),
        ('WORLD_SIZE', '1'),
        ('LOCAL_RANK', '0'),
        ('MASTER_ADDR', '127.0.0.1'),
        ('MASTER_PORT', str(29500 + os.getpid() % 1000)),
    ):
        os.environ.setdefault(key, value)
    from megatron.core.enums import ModelType
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import get_args, get_tokenizer
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model
    from tasks.finetune_utils import build_data_loader
    from tasks.main import get_tasks_args
    from tasks.zeroshot_gpt import evaluate as ev
    from tasks.zeroshot_gpt.datasets import build_dataset

    initialize_megatron(
        extra_args_provider=get_tasks_args,
        args_list=[
            '--task',
            'WIKITEXT103',
            '--valid-data',
            wiki,
            '--load',
            ours,
            '--use-checkpoint-args',
            '--tokenizer-type',
            'GPT2BPETokenizer',
            '--vocab-file',
            os.path.join(REPO, 'data', 'gpt2', 'gpt2-vocab.json'),
            '--merge-file',
            os.path.join(REPO, 'data', 'gpt2', 'gpt2-merges.txt'),
            '--micro-batch-size',
            str(args.micro_batch_size),
            '--num-workers',
            '0',
            '--overlapping-eval',
            str(args.overlapping_eval),
            '--no-load-optim',
            '--no-load-rng',
            '--log-interval',
            '1000000',
        ],
    )
    margs = get_args()
    dataset = build_dataset('WIKITEXT103', margs, get_tokenizer())
    model = get_model(ev.get_model_provider(), ModelType.encoder_or_decoder, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    loader = build_data_loader(dataset, margs.micro_batch_size, 0, drop_last=False)
    batches = list(loader)
    tokens = len(dataset) * margs.seq_length

    ev.evaluate(batches[:1], model, 'loss')  # warm-up
    start = time.time()
    ours_total = ev.evaluate(batches, model, 'loss')
    ours_time = time.time() - start

    with torch.no_grad():
        hf(batches[0]['text'][:, :-1].long())  # warm-up
        start = time.time()
        hf_total = 0.0
        for batch in batches:
            text = batch['text'].long()
            logits = hf(text[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), text[:, 1:], reduction='none'
            )
            hf_total += float((nll * batch['pad_mask'].float()).sum())
        hf_time = time.time() - start

    params = sum(p.numel() for p in hf.parameters())
    print(
        f'model: {params / 1e6:.1f}M parameters, {len(dataset)} windows of {margs.seq_length} '
        f'(stride {margs.overlapping_eval}), micro batch {margs.micro_batch_size}, '
        f'{torch.get_num_threads()} threads'
    )
    print(
        f'NLL sum: ours {ours_total:.4f}  transformers {hf_total:.4f} (ours includes the '
        f'padded-vocabulary rows in the softmax)'
    )
    print(f'ours (tasks/zeroshot_gpt):  {tokens / ours_time:10.1f} tokens/s  ({ours_time:.2f} s)')
    print(f'transformers GPT2LMHead:    {tokens / hf_time:10.1f} tokens/s  ({hf_time:.2f} s)')
    print(f'ratio ours / transformers:  {hf_time / ours_time:.3f}')


if __name__ == '__main__':
    main()
