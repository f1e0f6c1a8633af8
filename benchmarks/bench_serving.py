"""Generated tokens/s of the dynamic-batching engine against one-request-at-a-time generation
(what the text generation server runs today) and against transformers' generate with a padded
batch, at 1, 4, 8 and 16 concurrent requests, in one run.

Workload: N requests arrive together; prompt lengths uniform in [--prompt-min, --prompt-max]
(random token ids), each generates exactly --new-tokens tokens (greedy, no early stop). Rows:
- engine: `DynamicInferenceEngine.step()` until all N are done (continuous batching, paged KV
  cache); time to first token (TTFT) per request from its arrival;
- serialized: Megatron's generate loop (`generate_tokens_probs_and_return_on_first_stage`, the
  server's path, KV cache) for one request after the other; a request's TTFT includes the time
  it waited for the ones before it;
- HF padded: one `GPT2LMHeadModel.generate` call on the N prompts left-padded to the longest
  (TTFT: the same call with max_new_tokens=1).
Each row is timed --repeats times, the three implementations alternating; tokens/s is from the
median time, TTFT percentiles pool the repeats, and the ratio (engine / reference tokens/s) is the
median of the per-repeat ratios. Also prints how many requests got the
same tokens from the engine as from the serialized loop (fp32: near-ties may differ).

With --server, the same comparison end to end over HTTP (`serving_e2e.py`): N clients at once
stream `POST /v1/completions` from tools/run_text_generation_server.py on the engine, from the
same server under --use-legacy-static-engine (Megatron's generate() loop, one request at a time:
the server before the engine), and HF generate on the padded batch in this process; same random
GPT-2 (converted by tools/checkpoint/convert.py), same prompts, the three alternating.

Usage:
    python benchmarks/bench_serving.py --repeats 1          # GPT-2 small size (~124M), ~10 min
    python benchmarks/bench_serving.py --num-layers 4 --hidden-size 256 --new-tokens 32  # quick
    python benchmarks/bench_serving.py --plot benchmarks/bench_serving.png
    python benchmarks/bench_serving.py --server --num-layers 4 --hidden-size 256 \
        --num-attention-heads 8 --new-tokens 32 --threads 2 \
        --plot benchmarks/bench_serving_server.png             # end to end, ~10 min
"""

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64, help="KV cache block, tokens")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens per engine step")
    parser.add_argument("--enable-chunked-prefill", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per row (medians reported)"
    )
    parser.add_argument("--plot", default=None, help="write a tokens/s vs clients PNG here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument(
        "--server", action="store_true", help="measure end to end through the HTTP server"
    )
    return parser.parse_args()


def _init(args):
    """bench_generation's one-rank set-up (GPT-2 tokenizer, this model size), and its models:
    a random HF GPT-2 and our GPTModel holding the same weights."""
    import bench_generation

    ns = argparse.Namespace(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        batch_sizes=[max(args.clients)],
    )
    bench_generation._init(ns)
    return bench_generation._build_models(ns)


def _percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _engine(model, config, args, prompts):
    """(seconds, TTFTs, tokens per request) of the dynamic engine on all prompts at once."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.inference.inference_engine import get_inference_wrapper_config
    from megatron.training.global_vars import get_args, get_tokenizer

    margs = get_args()
    wrapper = GPTInferenceWrapper(model, get_inference_wrapper_config(margs))
    controller = TextGenerationController(wrapper, get_tokenizer())
    longest = max(len(p) for p in prompts) + args.new_tokens
    blocks = -(-longest // args.block_size) * len(prompts)
    context = DynamicInferenceContext(
        config,
        max_sequence_length=margs.max_position_embeddings,
        block_size_tokens=args.block_size,
        num_blocks=blocks,
        max_tokens=args.max_tokens,
    )
    engine = DynamicInferenceEngine(
        controller, context, enable_chunked_prefill=args.enable_chunked_prefill
    )
    params = SamplingParams(top_k=1, num_tokens_to_generate=args.new_tokens, termination_id=-1)
    start = time.time()
    ids = [engine.add_request(p, params, arrival_time=start) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.time() - start
    records = [engine.get_request(i) for i in ids]
    return (
        seconds,
        [r.time_first_token - start for r in records],
        [r.generated_tokens for r in records],
    )


def _serialized(model, args, prompts):
    """(seconds, TTFTs, tokens) of the KV-cached generate loop, one request after the other."""
    from megatron.inference.text_generation.generation import (
        generate_tokens_probs_and_return_on_first_stage,
    )

    start = time.perf_counter()
    ttfts, outputs = [], []
    for prompt in prompts:
        width = len(prompt)
        tokens = torch.tensor([prompt + [0] * args.new_tokens])
        first = []

        def on_step(_tokens, context_length, width=width, first=first):
            if context_length == width:
                first.append(time.perf_counter() - start)

        out = generate_tokens_probs_and_return_on_first_stage(
            model,
            tokens,
            torch.tensor([width]),
            top_k=1,
            use_eod_token_for_early_termination=False,
            prevent_newline_after_colon=False,
            step_callback=on_step,
        )[0]
        ttfts.append(first[0])
        outputs.append(out[0, width:].tolist())
    return time.perf_counter() - start, ttfts, outputs


def _hf_padded(hf, args, prompts):
    """(seconds, TTFT) of one transformers generate on the left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 50256, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def run(new):
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                use_cache=True,
                pad_token_id=50256,
            )
        return time.perf_counter() - start

    return run(args.new_tokens), run(1)


def _plot(path, rows, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("engine", "dynamic engine"),
        ("serial", "serialized (today's server)"),
        ("hf", "HF generate, padded batch"),
    ):
        xs = [r["clients"] for r in rows if key in r]
        ys = [r[key] for r in rows if key in r]
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_xticks([r["clients"] for r in rows])
    ax.set_title(
        f"{args.num_layers} layers, hidden {args.hidden_size}, {args.new_tokens} new tokens"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


def main():
    args = _parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.server:
        import serving_e2e

        serving_e2e.run(args)
        return
    hf, model = _init(args)
    config = model.config
    print(
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters; prompts "
        f"{args.prompt_min}-{args.prompt_max} tokens, {args.new_tokens} new tokens, torch threads "
        f"{torch.get_num_threads()}"
    )
    g = torch.Generator().manual_seed(1)
    warm = [torch.randint(0, 50256, (8,), generator=g).tolist()]
    _engine(model, config, argparse.Namespace(**{**vars(args), "new_tokens": 2}), warm)
    _serialized(model, argparse.Namespace(**{**vars(args), "new_tokens": 2}), warm)
    header = (
        f"{'clients':>7} {'implementation':<12} {'tokens/s':>9} {'TTFT p50 ms':>12} "
        f"{'TTFT p95 ms':>12} {'engine / this':>14}"
    )
    print(header)
    rows = []
    for n in args.clients:
        lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (n,), generator=g).tolist()
        prompts = [torch.randint(0, 50256, (k,), generator=g).tolist() for k in lengths]
        total = n * args.new_tokens
        names = ["engine", "serialized"] + ([] if args.skip_hf else ["HF padded"])
        seconds = {name: [] for name in names}
        ttfts = {name: [] for name in names}
        same = 0
        # The three alternate within each repeat so that they see the same machine load; the
        # ratio is taken per repeat and its median printed.
        for _ in range(args.repeats):
            t, first, tok_eng = _engine(model, config, args, prompts)
            seconds["engine"].append(t)
            ttfts["engine"] += first
            t, first, tok_ser = _serialized(model, args, prompts)
            seconds["serialized"].append(t)
            ttfts["serialized"] += first
            if not args.skip_hf:
                t, first = _hf_padded(hf, args, prompts)
                seconds["HF padded"].append(t)
                ttfts["HF padded"] += [first] * n
            same = sum(a == b for a, b in zip(tok_eng, tok_ser))
        row = {"clients": n}
        for name in names:
            ratio = statistics.median(
                ref / eng for ref, eng in zip(seconds[name], seconds["engine"])
            )
            rate = total / statistics.median(seconds[name])
            row[{"engine": "engine", "serialized": "serial", "HF padded": "hf"}[name]] = rate
            print(
                f"{n:>7} {name:<12} {rate:>9.1f} {statistics.median(ttfts[name]) * 1e3:>12.0f} "
                f"{_percentile(ttfts[name], 0.95) * 1e3:>12.0f} {ratio:>13.2f}x"
            )
        print(f"{n:>7} engine tokens == serialized tokens for {same}/{n} requests")
        rows.append(row)
    if args.plot:
        _plot(args.plot, rows, args)


if __name__ == "__main__":
    main()
