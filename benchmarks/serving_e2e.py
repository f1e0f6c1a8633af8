"""End-to-end serving benchmark (`bench_serving.py --server`): generated tokens/s and time to
first token of N concurrent HTTP clients.

Set-up: a random HF GPT-2 of the requested size (1024 positions), saved with save_pretrained and
converted by tools/checkpoint/convert.py; two text generation servers on it (one process each,
127.0.0.1): the engine server (--max-batch-size = the most clients) and the serialized server
(--use-legacy-static-engine: Megatron's generate() loop, one request at a time).

Each row: N prompts of random token ids (lengths uniform in [--prompt-min, --prompt-max]); N
client threads start together, each streams one `POST /v1/completions` (greedy, `ignore_eos`,
exactly --new-tokens tokens); TTFT is a client's time to its first text chunk, tokens/s the
generated tokens over the time until the last client finished. The HF reference is one
`generate` call on the left-padded batch in this process (TTFT: the same call for 1 token).
Within each repeat the three run one after the other, so they see the same machine load; the
ratios are the medians of the per-repeat ratios. The load average is printed with each row.
"""

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
VOCAB = os.path.join(REPO, "data", "gpt2", "gpt2-vocab.json")
MERGES = os.path.join(REPO, "data", "gpt2", "gpt2-merges.txt")
EOD = 50256


def _free_port(avoid=None):
    """A port free now (not `avoid`: two ports asked for one after the other can coincide)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port != avoid:
            return port


def _hf_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.num_layers,
        n_embd=args.hidden_size,
        n_head=args.num_attention_heads,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config).eval()


def _convert(hf_dir, ckpt):
    subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "checkpoint", "convert.py"),
         "--model-type", "GPT", "--loader", "hf", "--saver", "mcore",
         "--load-dir", hf_dir, "--save-dir", ckpt],
        check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=REPO),
    )  # fmt: skip


class _Server:
    """tools/run_text_generation_server.py in its own process (stopped by `stop`)."""

    def __init__(self, ckpt, log, extra, threads):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(
            os.environ,
            PYTHONPATH=REPO,
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port(avoid=self.port)),
            OMP_NUM_THREADS=str(threads),
        )
        cmd = [sys.executable, os.path.join(REPO, "tools", "run_text_generation_server.py"),
               "--load", ckpt, "--use-checkpoint-args", "--vocab-file", VOCAB,
               "--merge-file", MERGES, "--port", str(self.port)] + list(extra)  # fmt: skip
        self.log = open(log, "w")  # noqa: SIM115 (open as long as the server runs)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=600):
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log.name}")
            try:
                if requests.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout}s; see {self.log.name}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def _stream(url, prompt, new_tokens, start, out, i):
    """One client: (TTFT, end time, generated tokens, text) into out[i].

    It reads the event stream as raw bytes (http.client) and parses the chunks after the stream
    ended: the clients share this 2-core machine with the server, so a client that decoded
    every chunk as it came (as `requests.iter_lines` + json per line does) would take CPU time
    from the server it measures. TTFT is the arrival of the first chunk that carries text."""
    import http.client
    import json

    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=3600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first, raw = None, []
    while chunk := response.read1(65536):
        if first is None and b'"text": "' in chunk.replace(b'"text": ""', b""):
            first = time.perf_counter() - start
        raw.append(chunk)
    end = time.perf_counter() - start
    conn.close()
    text, tokens = "", 0
    for line in b"".join(raw).decode().split("\n"):
        if line.startswith("data: {"):
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            text += "".join(choice["text"] for choice in event.get("choices", ()))
    out[i] = (first, end, tokens, text)


def _clients(server, prompts, new_tokens):
    """(seconds, TTFTs, generated tokens, texts) of len(prompts) concurrent clients."""
    out = [None] * len(prompts)
    start = time.perf_counter()
    threads = [
        threading.Thread(target=_stream, args=(server.url, p, new_tokens, start, out, i))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        raise RuntimeError("a client failed (see the server log)")
    return (
        max(o[1] for o in out),
        [o[0] for o in out],
        sum(o[2] for o in out),
        [o[3] for o in out],
    )


def _hf_padded(hf, ids, new_tokens):
    """(seconds, TTFT) of one transformers generate on the left-padded batch."""
    width = max(len(p) for p in ids)
    batch = torch.full((len(ids), width), EOD, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(ids):
        batch[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def run(new):
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(batch, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, use_cache=True, pad_token_id=EOD)  # fmt: skip
        return time.perf_counter() - start

    return run(new_tokens), run(1)


def _percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _plot(path, rows, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (
        ("engine", "server on the dynamic engine"),
        ("serialized", "serialized server (legacy loop)"),
        ("HF padded", "HF generate, padded batch"),
    ):
        ax.plot([r["clients"] for r in rows], [r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens / s")
    ax.set_xticks([r["clients"] for r in rows])
    ax.set_title(
        f"HTTP end to end: {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.new_tokens} new tokens"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


def _row(n, servers, hf, prompts, ids, args):
    names = ["engine", "serialized", "HF padded"]
    seconds = {k: [] for k in names}
    ttfts = {k: [] for k in names}
    same = 0
    for _ in range(args.repeats):
        texts = {}
        for name in ("engine", "serialized"):
            t, first, tokens, texts[name] = _clients(servers[name], prompts, args.new_tokens)
            assert tokens == n * args.new_tokens, (name, tokens)
            seconds[name].append(t)
            ttfts[name] += first
        t, first = _hf_padded(hf, ids, args.new_tokens)
        seconds["HF padded"].append(t)
        ttfts["HF padded"] += [first] * n
        same = sum(a == b for a, b in zip(texts["engine"], texts["serialized"]))
    row = {"clients": n}
    load = os.getloadavg()[0]
    for name in names:
        ratio = statistics.median(r / e for r, e in zip(seconds[name], seconds["engine"]))
        row[name] = n * args.new_tokens / statistics.median(seconds[name])
        print(
            f"{n:>7} {name:<11} {row[name]:>9.1f} {statistics.median(ttfts[name]) * 1e3:>12.0f} "
            f"{_percentile(ttfts[name], 0.95) * 1e3:>12.0f} {ratio:>13.2f}x {load:>6.1f}",
            flush=True,
        )
    print(f"{n:>7} engine text == serialized text for {same}/{n} clients", flush=True)
    return row


def run(args):
    """The end-to-end table (and plot) of `bench_serving.py --server`."""
    from megatron.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    work = tempfile.mkdtemp(prefix="bench_serving_")
    servers = {}
    try:
        hf = _hf_model(args)
        hf.save_pretrained(os.path.join(work, "hf"), safe_serialization=True)
        _convert(os.path.join(work, "hf"), os.path.join(work, "ckpt"))
        ckpt, most = os.path.join(work, "ckpt"), max(args.clients)
        block = ["--inference-dynamic-batching-block-size", str(args.block_size)]
        servers["engine"] = _Server(
            ckpt, os.path.join(work, "engine.log"), ["--max-batch-size", str(most)] + block,
            threads,
        )  # fmt: skip
        servers["serialized"] = _Server(
            ckpt, os.path.join(work, "serialized.log"), ["--use-legacy-static-engine"], threads
        )
        for server in servers.values():
            server.wait_ready()
        tokenizer = GPT2Tokenizer(VOCAB, MERGES)
        g = torch.Generator().manual_seed(1)
        print(
            f"model: {args.num_layers} layers, hidden {args.hidden_size}, "
            f"{sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters; prompts "
            f"{args.prompt_min}-{args.prompt_max} tokens, {args.new_tokens} new tokens, torch "
            f"threads {threads} per process, {os.cpu_count()} CPUs, load average at start "
            f"{os.getloadavg()[0]:.1f}"
        )
        warm = [tokenizer.decode(torch.randint(0, EOD, (8,), generator=g).tolist())]
        for server in servers.values():
            _clients(server, warm, 2)
        _hf_padded(hf, [tokenizer.encode(p) for p in warm], 2)
        print(
            f"{'clients':>7} {'serving':<11} {'tokens/s':>9} {'TTFT p50 ms':>12} "
            f"{'TTFT p95 ms':>12} {'engine / this':>14} {'load':>6}"
        )
        rows = []
        for n in args.clients:
            lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (n,), generator=g)
            prompts = [
                tokenizer.decode(torch.randint(0, EOD, (k,), generator=g).tolist())
                for k in lengths.tolist()
            ]
            ids = [tokenizer.encode(p) for p in prompts]  # what the servers tokenize
            rows.append(_row(n, servers, hf, prompts, ids, args))
        if args.plot:
            _plot(args.plot, rows, args)
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
