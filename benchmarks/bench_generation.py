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
Ours and HF alternate within each repeat; tokens/s and first-token times are medians over the
repeats, "vs HF" the median of the per-repeat ratios (HF time / our time). Figures on a shared
CPU machine are noisy: compare the ratio within one run.
"""

import argparse
import os
import statistics
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
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per row (medians reported)"
    )
    parser.add_argument(
        "--skip-no-cache", action="store_true", help="leave out the no-cache row (slow)"
    )
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

    # GeLU: the bias-GeLU fusion computes the tanh approximation, GPT-2's "gelu_new".
    flags = (
        f"--num-layers {args.num_layers} --hidden-size {args.hidden_size} "
        f"--num-attention-heads {args.num_attention_heads} --seq-length 1024 "
        "--max-position-embeddings 1024 --micro-batch-size 1 --tokenizer-type GPT2BPETokenizer "
        "--make-vocab-size-divisible-by 1 --attention-dropout 0.0 --hidden-dropout 0.0 "
        "--distributed-backend gloo --transformer-impl local "
        f"--max-tokens-to-oom {max(args.batch_sizes) * 1024}"
    ).split()
    flags += ["--vocab-file", os.path.join(REPO, "data", "gpt2", "gpt2-vocab.json")]
    flags += ["--merge-file", os.path.join(REPO, "data", "gpt2", "gpt2-merges.txt")]
    initialize_megatron(args_list=flags)


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


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _ours(model, prompts, new_tokens):
    """(seconds, first-token seconds, tokens) of one run of the KV-cached generation loop."""
    from megatron.inference.text_generation.generation import (
        generate_tokens_probs_and_return_on_first_stage,
    )

    batch, width = prompts.shape
    tokens = torch.cat([prompts, prompts.new_zeros(batch, new_tokens)], dim=1)
    lengths = torch.full((batch,), width, dtype=torch.long)
    first = []
    start = time.perf_counter()

    def on_step(_tokens, context_length):
        if context_length == width:
            first.append(time.perf_counter() - start)

    out = generate_tokens_probs_and_return_on_first_stage(
        model,
        tokens,
        lengths,
        top_k=1,
        use_eod_token_for_early_termination=False,
        prevent_newline_after_colon=False,
        step_callback=on_step,
    )[0]
    return time.perf_counter() - start, first[0], out


def _ours_no_cache(model, prompts, new_tokens):
    def run():
        tokens = prompts
        with torch.no_grad():
            for _ in range(new_tokens):
                logits = model(tokens, None, None)  # [b, s, v], the whole prefix again
                tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens

    return _timed(run)


def _hf(hf, prompts, new_tokens):
    """(seconds, tokens) of one transformers generate call."""

    def run():
        with torch.no_grad():
            return hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=50256,
            )

    return _timed(run)


def _median(values):
    return statistics.median(values)


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
        f"{'batch':>5} {'implementation':<16} {'tokens/s':>10} {'first token ms':>15} {'vs HF':>7}"
    )
    g = torch.Generator().manual_seed(1)
    # Warm-up (allocator, kernels) before anything is timed.
    warm = torch.randint(0, 50257, (1, 4), generator=g)
    _hf(hf, warm, 2), _ours(model, warm, 2), _ours_no_cache(model, warm, 2)
    for batch in args.batch_sizes:
        prompts = torch.randint(0, 50257, (batch, args.prompt_length), generator=g)
        generated = batch * args.new_tokens
        times = {"kv": [], "nc": [], "hf": [], "ft_kv": [], "ft_hf": [], "kv/hf": [], "nc/hf": []}
        same = True
        # Ours and HF alternate within each repeat so that both see the same machine load; the
        # ratio is taken per repeat and its median reported.
        for _ in range(args.repeats):
            t_hf, hf_tokens = _hf(hf, prompts, args.new_tokens)
            ft_hf, _ = _hf(hf, prompts, 1)
            t_kv, ft_kv, kv_tokens = _ours(model, prompts, args.new_tokens)
            t_nc, nc_tokens = (
                (None, None)
                if args.skip_no_cache
                else _ours_no_cache(model, prompts, args.new_tokens)
            )
            same = same and torch.equal(kv_tokens, hf_tokens)
            same = same and (nc_tokens is None or torch.equal(nc_tokens, hf_tokens))
            for key, value in (("kv", t_kv), ("hf", t_hf), ("ft_kv", ft_kv), ("ft_hf", ft_hf)):
                times[key].append(value)
            times["kv/hf"].append(t_hf / t_kv)
            if t_nc is not None:
                times["nc"].append(t_nc)
                times["nc/hf"].append(t_hf / t_nc)
        rows = [
            ("ours, KV cache", times["kv"], times["ft_kv"], times["kv/hf"]),
            ("ours, no cache", times["nc"], None, times["nc/hf"]),
            ("HF generate", times["hf"], times["ft_hf"], [1.0]),
        ]
        for name, seconds, first, ratios in rows:
            if not seconds:
                continue
            first_ms = f"{_median(first) * 1e3:.1f}" if first is not None else "-"
            print(
                f"{batch:>5} {name:<16} {generated / _median(seconds):>10.1f} {first_ms:>15} "
                f"{_median(ratios):>6.2f}x"
            )
        print(
            f"{batch:>5} KV cache vs HF per repeat: "
            + " ".join(f"{r:.2f}x" for r in times["kv/hf"])
        )
        print(f"{batch:>5} same tokens as HF: {same}")


if __name__ == "__main__":
    main()
