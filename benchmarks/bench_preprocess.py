"""tools/preprocess_data.py against Megatron's tool: same corpus and workers, byte-identical output.

    python benchmarks/bench_preprocess.py [--tokenizer gpt2|bert] [--workers 2] [--rounds 3]

Reference: Megatron's tools/preprocess_data.py is not shipped in the megatron-core wheel, so the
reference run is our tool with `MEGATRON_PURE_PYTHON_TOKENIZERS=1`: the same pipeline as
Megatron's tool (a multiprocessing pool of `--workers` encoders, `imap` with chunks of 32, JSON
parsed and tokenized in the workers, ids written in input order by an IndexedDatasetBuilder) with
the pure-Python GPT-2 BPE / BERT WordPiece tokenizers that Megatron's tool uses. "ours" is the
default run, where tiktoken / HF tokenizers encode (same ids). Runs alternate ours / reference
in fresh processes; each pair's outputs are compared byte for byte. Prints wall seconds, MB/s,
and the ratio reference/ours (>1 means ours is faster) per round and the median.
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / "data"
TOKENIZERS = {
    "gpt2": [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(DATA / "gpt2" / "gpt2-vocab.json"),
        "--merge-file",
        str(DATA / "gpt2" / "gpt2-merges.txt"),
    ],
    "bert": [
        "--tokenizer-type",
        "BertWordPieceLowerCase",
        "--vocab-file",
        str(DATA / "bert" / "bert-vocab.txt"),
    ],
}


def _corpus(workdir, copies):
    """The bundled corpora concatenated `copies` times into one JSONL file."""
    path = os.path.join(workdir, "corpus.jsonl")
    with open(path, "wb") as out:
        for _ in range(copies):
            for name in ("mobydick.jsonl", "fortunes.jsonl"):
                out.write((DATA / "corpus" / name).read_bytes())
    return path


def _run(corpus, prefix, tokenizer, workers, pure):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MEGATRON_PURE_PYTHON_TOKENIZERS", None)
    if pure:
        env["MEGATRON_PURE_PYTHON_TOKENIZERS"] = "1"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "preprocess_data.py"),
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--append-eod",
        "--workers",
        str(workers),
        "--log-interval",
        "1000000000",
    ] + TOKENIZERS[tokenizer]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    files = [pathlib.Path(prefix + "_text_document" + ext).read_bytes() for ext in (".bin", ".idx")]
    return seconds, files


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="gpt2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--copies", type=int, default=1, help="corpus copies (the corpus is ~3.8 MB)"
    )
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"tokenizer {args.tokenizer}, {args.workers} workers"
    )
    ratios = []
    with tempfile.TemporaryDirectory() as workdir:
        corpus = _corpus(workdir, args.copies)
        mb = os.path.getsize(corpus) / 2**20
        for r in range(args.rounds):
            ours, ours_files = _run(
                corpus, os.path.join(workdir, "ours"), args.tokenizer, args.workers, False
            )
            ref, ref_files = _run(
                corpus, os.path.join(workdir, "ref"), args.tokenizer, args.workers, True
            )
            if ours_files != ref_files:
                raise SystemExit("ours and the reference wrote different .bin/.idx bytes")
            ratios.append(ref / ours)
            print(
                f"round {r}: ours {ours:.2f} s ({mb / ours:.2f} MB/s)  reference {ref:.2f} s "
                f"({mb / ref:.2f} MB/s)  ratio {ref / ours:.2f}x  "
                f"(output byte-identical, {mb:.1f} MB)",
                flush=True,
            )
    print(
        f"preprocess_data {args.tokenizer} workers={args.workers}: "
        f"ratio median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, "
        f"max {max(ratios):.2f}) over {len(ratios)} rounds; busy shared machine"
    )


if __name__ == "__main__":
    main()
