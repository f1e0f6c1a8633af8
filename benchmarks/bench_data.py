"""Data pipeline figures: preprocessing throughput, GPT index build time/memory, sample read rate.

    python benchmarks/bench_data.py [--tokens 1e8] [--seq-length 2048] [--reads 2000]

1. tools/preprocess_data.py (GPT-2 BPE, --append-eod) on each bundled corpus with 1 and 2
   workers: MB/s of input JSON and documents/s, wall time including pool start.
2. GPTDataset index build (document, sample and shuffle index, written to a cache dir) for a
   synthetic document-length array totalling --tokens tokens, in a fresh child process: wall time
   and peak RSS above the baseline.
3. Random-access reads from a GPTDataset over the preprocessed corpora: samples/s and tokens/s,
   with and without the explicit attention mask.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import numpy

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "data"


def _load_preprocess():
    spec = importlib.util.spec_from_file_location(
        "_bench_preprocess_data", REPO / "tools" / "preprocess_data.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _cpu_seconds():
    """CPU seconds of this process plus its reaped children (the worker pools)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_preprocess(workdir):
    preprocess = _load_preprocess()
    rows = []
    prefixes = {}
    for corpus in ("mobydick.jsonl", "fortunes.jsonl"):
        path = DATA / "corpus" / corpus
        mb = os.path.getsize(path) / 1024 / 1024
        for workers in (1, 2):
            prefix = os.path.join(workdir, f"{path.stem}_w{workers}")
            args = preprocess.get_args(
                [
                    "--input",
                    str(path),
                    "--output-prefix",
                    prefix,
                    "--append-eod",
                    "--workers",
                    str(workers),
                    "--log-interval",
                    "100000000",
                    "--tokenizer-type",
                    "GPT2BPETokenizer",
                    "--vocab-file",
                    str(DATA / "gpt2" / "gpt2-vocab.json"),
                    "--merge-file",
                    str(DATA / "gpt2" / "gpt2-merges.txt"),
                ]
            )
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            docs = preprocess.run(args)
            dt = time.perf_counter() - t0
            cpu = _cpu_seconds() - cpu0
            rows.append(
                dict(
                    corpus=corpus,
                    workers=workers,
                    seconds=round(dt, 3),
                    mb_per_s=round(mb / dt, 3),
                    docs_per_s=round(docs / dt, 1),
                    docs=docs,
                    mb=round(mb, 3),
                    cpu_seconds=round(cpu, 3),
                    mb_per_cpu_s=round(mb / cpu, 3),
                )
            )
            prefixes[path.stem] = prefix + "_text_document"
    return rows, prefixes


_INDEX_CHILD = r"""
import json, os, resource, sys, time, types, numpy
sys.path.insert(0, sys.argv[1])
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split
from megatron.training.tokenizer.tokenizer import _NullTokenizer
total_tokens, seq, cache = float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rng = numpy.random.default_rng(0)
num_docs = int(total_tokens // 1000)
sizes = rng.integers(1, 2000, size=num_docs, dtype=numpy.int32)
sizes[-1] += int(total_tokens - sizes.sum()) if total_tokens > sizes.sum() else 0
low = types.SimpleNamespace(sequence_lengths=sizes, path_prefix=cache)
cfg = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=(["synthetic"], None),
                       split="1,0,0", path_to_cache=cache, tokenizer=_NullTokenizer(50000),
                       reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
num_samples = int(sizes.sum()) // seq - 1
import tracemalloc
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tracemalloc.start()
t0 = time.perf_counter()
ds = GPTDataset(low, "synthetic", numpy.arange(num_docs, dtype=numpy.int32), num_samples,
                Split.train, cfg)
dt = time.perf_counter() - t0
traced_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
index_bytes = ds.document_index.nbytes + ds.sample_index.nbytes + ds.shuffle_index.nbytes
t1 = time.perf_counter()
ds2 = GPTDataset(low, "synthetic", numpy.arange(num_docs, dtype=numpy.int32), num_samples,
                 Split.train, cfg)
load = time.perf_counter() - t1
print(json.dumps(dict(tokens=int(sizes.sum()), documents=num_docs, seq_length=seq, samples=len(ds),
                      build_seconds=round(dt, 3), cache_load_seconds=round(load, 4),
                      peak_rss_increase_mib=round((peak - base) / 1024, 1),
                      peak_rss_mib=round(peak / 1024, 1),
                      traced_peak_mib=round((traced_peak + ds.sample_index.nbytes) / 2**20, 2),
                      index_mib=round(index_bytes / 2**20, 2))))
"""


def bench_index(tokens, seq, workdir):
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _INDEX_CHILD,
            str(REPO),
            str(tokens),
            str(seq),
            os.path.join(workdir, "index_cache"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_reads(prefixes, seq, reads, workdir):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training.tokenizer.tokenizer import _GPT2BPETokenizer

    tok = _GPT2BPETokenizer(
        str(DATA / "gpt2" / "gpt2-vocab.json"), str(DATA / "gpt2" / "gpt2-merges.txt")
    )
    rows = []
    for create_mask in (False, True):
        cfg = GPTDatasetConfig(
            random_seed=1234,
            sequence_length=seq,
            blend=([prefixes["fortunes"], prefixes["mobydick"]], [0.5, 0.5]),
            split="100,0,0",
            path_to_cache=os.path.join(workdir, "read_cache"),
            tokenizer=tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=create_mask,
        )
        train = BlendedMegatronDatasetBuilder(
            GPTDataset, [5000, None, None], lambda: True, cfg
        ).build()[0]
        order = numpy.random.default_rng(0).integers(0, len(train), size=reads)
        t0 = time.perf_counter()
        for i in order:
            train[int(i)]
        dt = time.perf_counter() - t0
        rows.append(
            dict(
                seq_length=seq,
                attention_mask=create_mask,
                samples=reads,
                samples_per_s=round(reads / dt, 1),
                tokens_per_s=round(reads * seq / dt),
            )
        )
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=float, default=1e8)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--read-seq-length", type=int, default=1024)
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--json", type=str, default=None, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        pre, prefixes = bench_preprocess(workdir)
        index = [bench_index(args.tokens, seq, workdir) for seq in (args.seq_length, 128)]
        reads = bench_reads(prefixes, args.read_seq_length, args.reads, workdir)
    results = dict(
        cpu_count=os.cpu_count(),
        load_average=os.getloadavg(),
        preprocess=pre,
        gpt_index=index,
        random_reads=reads,
    )
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        " (figures scale down under load)"
    )
    print("preprocess_data (GPT2BPETokenizer, --append-eod):")
    for r in pre:
        print(
            f"  {r['corpus']:15s} workers={r['workers']}  {r['mb_per_s']:6.2f} MB/s"
            f"  {r['docs_per_s']:9.1f} docs/s"
            f"  ({r['docs']} docs, {r['mb']} MB, {r['seconds']} s wall, {r['cpu_seconds']} CPU s,"
            f" {r['mb_per_cpu_s']} MB per CPU s)"
        )
    for ix in index:
        print(
            f"GPT indices for {ix['tokens']:,} tokens ({ix['documents']:,} docs),"
            f" seq {ix['seq_length']}: "
            f"{ix['build_seconds']} s incl. .npy writes,"
            f" peak allocation {ix['traced_peak_mib']} MiB "
            f"(indices {ix['index_mib']} MiB, process peak RSS {ix['peak_rss_mib']} MiB); "
            f"{ix['samples']:,} samples; cache reload {ix['cache_load_seconds']} s"
        )
    for r in reads:
        print(
            f"random reads seq {r['seq_length']} attention_mask={r['attention_mask']}: "
            f"{r['samples_per_s']} samples/s, {r['tokens_per_s']:,} tokens/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
