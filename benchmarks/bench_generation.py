"""Generated tokens/s of Megatron text generation against transformers' generate on the same
weights, in one run: a GPT-2-small-sized model (~125M parameters, random weights built here),
greedy decoding of a fixed number of new tokens, batch 1 and 8.

Rows:
- ours, KV cache: `generate_tokens_probs_and_return_on_first_stage` (the server's path), with
  early termination off so every run produces exactly --new-tokens tokens;
- ours, no cache: the same model re-running the whole prefix at every step;
- HF generate: `GPT2LMHeadModel.generate(do_sample=False, use_cache=True)`.
Time to first token: the prompt forward plus the first sample (ours: measured at the first step
of the loop; HF: generate with max_new_tokens=1).

Usage:
    python benchmarks/bench_generation.py                       # ~125M, prompt 32, 32 new tokens
    python benchmarks/bench_generation.py --num-layers 2 --hidden-size 128 --new-tokens 8  # quick
Figures on a shared CPU machine are noisy: compare the ratio within one run.
"""

import argparse
import os
import sys
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO)


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per row (best kept)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    return parser.parse_args()


def _init(args):
    """One-rank Megatron set-up (gloo) with the GPT-2 tokenizer and this model size."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from megatron.training.initialize import initialize_megatron

    seq = args.prompt_length + args.new_tokens
    initialize_megatron(
        args_list=[
            "--num-layers",
            str(args.num_layers),
            "--hidden-size",
            str(args.hidden_size),
            "--num-attention-heads",
            str(args.num_attention_heads),
            "--seq-length",
            "1024",
            "--max-position-embeddings",
            "1024",
            "--micro-batch-size",
            "1",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            os.path.join(REPO, "data", "gpt2", "gpt2-vocab.json"),
            "--merge-file",
            os.path.join(REPO, "data", "gpt2", "gpt2-merges.txt"),
            "--make-vocab-size-divisible-by",
            "1",
            "--openai-gelu",
            "--no-bias-gelu-fusion",
            "--attention-dropout",
            "0.0",
            "--hidden-dropout",
            "0.0",
            "--distributed-backend",
            "gloo",
            "--transformer-impl",
            "local",
            "--max-tokens-to-oom",
            str(max(args.batch_sizes) * seq),
        ]
    )


def _build_models(args):
    """A random HF GPT-2 of this size and our GPTModel holding the same weights."""
    import importlib.util

    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron.core.models.gpt import hf_weight_mapping as hfm
    from megatron.training.training import get_model

    spec = importlib.util.spec_from_file_location(
        "run_text_generation_server", os.path.join(REPO, "tools", "run_text_generation_server.py")
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    torch.manual_seed(0)
    hf_config = GPT2Config(
        n_layer=args.num_layers,
        n_embd=args.hidden_size,
        n_head=args.num_attention_heads,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = GPT2LMHeadModel(hf_config).eval()
    model = get_model(tool.model_provider, wrap_with_ddp=False)[0]
    sd = hfm.gpt2_hf_to_mcore_state_dict(hf.state_dict(), model.config)
    model.load_state_dict(sd, strict=False)
    model.eval()
    return hf, model


def _time(fn, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _ours(model, prompts, new_tokens, repeats):
    """(seconds, first-token seconds, tokens) of the KV-cached generation loop."""
    from megatron.inference.text_generation.generation import (
        generate_tokens_probs_and_return_on_first_stage,
    )

    batch, width = prompts.shape
    first = []

    def run():
        tokens = torch.cat([prompts, prompts.new_zeros(batch, new_tokens)], dim=1)
        lengths = torch.full((batch,), width, dtype=torch.long)
        start = time.perf_counter()

        def on_step(_tokens, context_length):
            if context_length == width:
                first.append(time.perf_counter() - start)

        return generate_tokens_probs_and_return_on_first_stage(
            model,
            tokens,
            lengths,
            top_k=1,
            use_eod_token_for_early_termination=False,
            prevent_newline_after_colon=False,
            step_callback=on_step,
        )[0]

    seconds, tokens = _time(run, repeats)
    return seconds, min(first), tokens


def _ours_no_cache(model, prompts, new_tokens, repeats):
    def run():
        tokens = prompts
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = model(tokens, None, None)  # [b, s, v], the whole prefix again
                tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens

    return _time(run, repeats)


def _hf(hf, prompts, new_tokens, repeats):
    def run(n):
        with torch.no_grad():
            return hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                use_cache=True,
                pad_token_id=50256,
            )

    seconds, tokens = _time(lambda: run(new_tokens), repeats)
    first, _ = _time(lambda: run(1), repeats)
    return seconds, first, tokens


def main():
    args = _parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    _init(args)
    hf, model = _build_models(args)
    params = sum(p.numel() for p in hf.parameters())
    print(
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, {params / 1e6:.1f}M "
        f"parameters; prompt {args.prompt_length} tokens, {args.new_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'batch':>5} {'implementation':<16} {'tokens/s':>10} {'first token ms':>15} "
        f"{'vs HF':>7}"
    )
    g = torch.Generator().manual_seed(1)
    # Warm-up (allocator, kernels) before anything is timed.
    warm = torch.randint(0, 50257, (1, 4), generator=g)
    _hf(hf, warm, 2, 1), _ours(model, warm, 2, 1), _ours_no_cache(model, warm, 2, 1)
    for batch in args.batch_sizes:
        prompts = torch.randint(0, 50257, (batch, args.prompt_length), generator=g)
        generated = batch * args.new_tokens
        t_hf, ft_hf, hf_tokens = _hf(hf, prompts, args.new_tokens, args.repeats)
        t_kv, ft_kv, kv_tokens = _ours(model, prompts, args.new_tokens, args.repeats)
        t_nc, nc_tokens = _ours_no_cache(model, prompts, args.new_tokens, args.repeats)
        same = torch.equal(kv_tokens, hf_tokens) and torch.equal(nc_tokens, hf_tokens)
        rows = [
            ("ours, KV cache", t_kv, ft_kv),
            ("ours, no cache", t_nc, None),
            ("HF generate", t_hf, ft_hf),
        ]
        for name, seconds, first in rows:
            first_ms = f"{first * 1e3:.1f}" if first is not None else "-"
            print(
                f"{batch:>5} {name:<16} {generated / seconds:>10.1f} {first_ms:>15} "
                f"{t_hf / seconds:>6.2f}x"
            )
        print(f"{batch:>5} same tokens as HF: {same}")


if __name__ == "__main__":
    main()
