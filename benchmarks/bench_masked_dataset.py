"""BERT dataset figures: sample-index build time and peak memory for 1e6 samples, sample reads/s.

    python benchmarks/bench_masked_dataset.py [--samples 1e6] [--docs 50000] [--seq-length 128]
        [--megatron-root DIR]

A synthetic sentence-level corpus (--docs documents of 2-12 sentences of 4-48 tokens, seeded) is
written once. Then, in a fresh child process per implementation, BERTMaskedWordPieceDataset (binary
head, seed 1234) is built for --samples samples into an empty cache directory: wall time of the
build (helpers.build_mapping over whole epochs + the .npy write) and its CPU time, peak RSS above
the child's baseline, the number of rows, and random-access __getitem__ calls (masking included)
per CPU-second of the child (CPU time, because wall time on a shared machine mostly measures load).

"ours" is this repository. With --megatron-root DIR (an unpacked megatron-core 0.8.0 wheel:
`pip download megatron-core==0.8.0 --no-deps`, then unzip) the same runs use Megatron's own classes
and compiled helpers as the reference, and the ratio ours / reference is printed. The two must
also produce the same sample index (checked by md5 of the rows). Figures from a shared, busy
machine vary from run to run; compare the two columns of one run.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, resource, sys, time, types
root, prefix, cache, vocab, samples, seq, reads = sys.argv[1:8]
sys.path.insert(0, root)
try:
    import pkg_resources  # noqa: F401  (megatron-core 0.8.0 imports it)
except ImportError:
    import packaging.version
    sys.modules["pkg_resources"] = types.SimpleNamespace(packaging=packaging)
from collections import OrderedDict
import hashlib, numpy, torch
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 200))
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split

class _BertWordPieceTokenizer(MegatronTokenizer):
    def __init__(self, vocab_file):
        super().__init__(vocab_file, lower_case=True, vocab_extra_ids=0)
        with open(vocab_file, encoding="utf-8") as f:
            self._vocab = OrderedDict((line.rstrip("\n"), i) for i, line in enumerate(f))
        for token in ("[BOS]", "[EOS]"):
            self._vocab.setdefault(token, len(self._vocab))
        self._inv = OrderedDict((i, t) for t, i in self._vocab.items())
    def tokenize(self, text): raise NotImplementedError
    def detokenize(self, ids): raise NotImplementedError
    vocab = property(lambda self: self._vocab)
    inv_vocab = property(lambda self: self._inv)
    vocab_size = property(lambda self: len(self._vocab))
    cls = property(lambda self: self._vocab["[CLS]"])
    sep = property(lambda self: self._vocab["[SEP]"])
    pad = property(lambda self: self._vocab["[PAD]"])
    mask = property(lambda self: self._vocab["[MASK]"])

config = BERTMaskedWordPieceDatasetConfig(
    random_seed=1234, sequence_length=int(seq), tokenizer=_BertWordPieceTokenizer(vocab),
    blend=([prefix], None), split="100,0,0", path_to_cache=cache, masking_probability=0.15,
    short_sequence_probability=0.1, masking_max_ngram=3, masking_do_full_word=True,
    masking_do_permutation=False, masking_use_longer_ngrams=False,
    masking_use_geometric_distribution=False, classification_head=True)
indexed = IndexedDataset(prefix)
documents = numpy.arange(indexed.document_indices.shape[0] - 1, dtype=numpy.int32)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0, c0 = time.perf_counter(), time.process_time()
ds = BERTMaskedWordPieceDataset(indexed, prefix, documents, int(samples), Split.train, config)
build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - c0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = numpy.ascontiguousarray(ds.sample_index)
order = numpy.random.default_rng(0).integers(0, len(ds), int(reads))
c0 = time.process_time()
for i in order:
    ds[int(i)]
read_cpu_s = time.process_time() - c0
print(json.dumps(dict(build_s=build_s, build_cpu_s=build_cpu_s, peak_mib=(peak - base) / 1024,
                      rows=int(len(ds)),
                      rows_md5=hashlib.md5(rows.tobytes()).hexdigest(),
                      reads_per_cpu_s=int(reads) / read_cpu_s)))
"""


def write_corpus(prefix: str, num_docs: int, vocab_size: int) -> int:
    """Seeded synthetic sentence-level corpus; returns its number of sentences."""
    sys.path.insert(0, str(REPO))
    import numpy

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(1234)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    sentences = 0
    for _ in range(num_docs):
        lengths = rng.integers(4, 49, size=int(rng.integers(2, 13))).tolist()
        tokens = rng.integers(1000, vocab_size, size=sum(lengths))
        builder.add_document(tokens, lengths)
        sentences += len(lengths)
    builder.finalize(prefix + ".idx")
    return sentences


def run_child(root: str, prefix: str, workdir: str, args, name: str) -> dict:
    cache = os.path.join(workdir, f"cache-{name}")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            root,
            prefix,
            cache,
            str(REPO / "data" / "bert" / "bert-vocab.txt"),
            str(int(args.samples)),
            str(args.seq_length),
            str(args.reads),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=root),
    )
    if result.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=float, default=1e6)
    parser.add_argument("--docs", type=int, default=50000)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument(
        "--megatron-root", default=None, help="unpacked megatron-core 0.8.0 wheel, the reference"
    )
    args = parser.parse_args()

    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
        f"(a busy machine: compare the columns of one run, not runs)"
    )
    with tempfile.TemporaryDirectory() as workdir:
        prefix = os.path.join(workdir, "synthetic_text_sentence")
        sentences = write_corpus(prefix, args.docs, 30522)
        print(
            f"corpus: {args.docs:,} documents, {sentences:,} sentences; "
            f"BERT seq {args.seq_length}, "
            f"binary head, {int(args.samples):,} samples requested"
        )
        results = {"ours": run_child(str(REPO), prefix, workdir, args, "ours")}
        if args.megatron_root:
            results["reference"] = run_child(
                os.path.abspath(args.megatron_root), prefix, workdir, args, "reference"
            )
    ours = results["ours"]
    ref = results.get("reference")
    print(f"{'':28s}{'ours':>12s}{'megatron 0.8':>14s}{'ratio':>8s}")
    for key, label, fmt in (
        ("rows", "sample index rows", "{:,.0f}"),
        ("build_s", "index build wall time (s)", "{:.2f}"),
        ("build_cpu_s", "index build CPU time (s)", "{:.2f}"),
        ("peak_mib", "peak RSS during build (MiB)", "{:.1f}"),
        ("reads_per_cpu_s", "__getitem__ per CPU-second", "{:.0f}"),
    ):
        line = f"{label:28s}{fmt.format(ours[key]):>12s}"
        if ref is not None:
            ratio = ours[key] / ref[key] if ref[key] else float("nan")
            line += f"{fmt.format(ref[key]):>14s}{ratio:>8.2f}"
        print(line)
    if ref is not None:
        same = ours["rows_md5"] == ref["rows_md5"]
        print(f"identical sample index: {same} (md5 {ours['rows_md5']})")
    else:
        print(
            "reference: pass --megatron-root DIR (unpacked megatron-core 0.8.0) for the comparison"
        )


if __name__ == "__main__":
    main()
