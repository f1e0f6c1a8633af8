"""Tokenize a loose-JSON corpus (one JSON object per line) into Megatron `.bin`/`.idx` datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 2

writes `my-gpt2_text_document.bin/.idx` (one per `--json-keys` key; `_sentence` with
`--split-sentences`). Documents are encoded by `--workers` processes but written in input order,
so the output is byte-identical whatever the worker count. Output goes to temporary names that are
renamed only on success: a bad line (malformed JSON, missing key) stops the run with
`FILE:LINE: ...` and leaves no `.bin`/`.idx` under the final names.
"""

import argparse
import glob
import json
import multiprocessing
import os
import sys
import threading
import time

import numpy

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megatron.training.tokenizer.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

_TMP_SUFFIX = ".tmp-preprocess"


class PreprocessError(Exception):
    """A user-facing, one-line error."""


def _load_sentence_splitter(lang: str, keep_newlines: bool):
    """NLTK Punkt for `lang` from installed parameters (no download), or a PreprocessError."""
    from megatron.training.tokenizer.sentence_splitter import (
        SentenceSplitter,
        SentenceSplitterError,
    )

    try:
        return SentenceSplitter(lang, keep_newlines)
    except SentenceSplitterError as exc:
        raise PreprocessError(str(exc)) from None


class Encoder(object):
    """Per-process tokenizer (and sentence splitter); `encode` turns one input line into ids."""

    tokenizer = None
    splitter = None

    def __init__(self, args):
        self.args = args

    def initializer(self):
        """Build the tokenizer in each worker, unless inherited from the parent by fork."""
        if Encoder.tokenizer is None:
            Encoder.tokenizer = build_tokenizer(self.args)
        if self.args.split_sentences and Encoder.splitter is None:
            Encoder.splitter = _load_sentence_splitter(self.args.lang, self.args.keep_newlines)

    def encode(self, item):
        """(path, line number, line) -> (ids, sequence lengths per key, bytes) or ('error', msg)."""
        path, lineno, json_line = item
        try:
            data = json.loads(json_line)
        except json.JSONDecodeError as exc:
            return "error", f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(data, dict):
            return "error", f"{path}:{lineno}: expected a JSON object, got {type(data).__name__}"
        ids = {}
        lens = {}
        for key in self.args.json_keys:
            if key not in data:
                return (
                    "error",
                    f"{path}:{lineno}: missing key '{key}' "
                    f"(--json-keys {' '.join(self.args.json_keys)})",
                )
            text = data[key]
            if isinstance(text, str):
                sentences = (
                    Encoder.splitter.tokenize(text) if Encoder.splitter is not None else [text]
                )
            elif isinstance(text, list) and all(isinstance(t, str) for t in text):
                sentences = text
            else:
                return (
                    "error",
                    f"{path}:{lineno}: key '{key}' must be a string or a list of strings",
                )
            doc_ids = []
            sentence_lens = []
            for sentence in sentences:
                sentence_ids = Encoder.tokenizer.tokenize(sentence)
                if len(sentence_ids) > 0:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if len(doc_ids) > 0 and self.args.append_eod:
                doc_ids.append(Encoder.tokenizer.eod)
                sentence_lens[-1] += 1
            # An int32 array pickles to the main process far faster than a list of ints.
            ids[key] = numpy.asarray(doc_ids, dtype=numpy.int32)
            lens[key] = sentence_lens
        return ids, lens, len(json_line.encode("utf-8"))


def _read_lines(paths):
    """(path, line number, line) for every non-blank line of every input file."""
    for path in paths:
        opener = open
        if path.endswith(".gz"):
            import gzip

            opener = gzip.open
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    yield path, lineno, line


def _output_prefix(args, key, level, partition=None):
    prefix = args.output_prefix if partition is None else f"{args.output_prefix}_{partition}"
    return f"{prefix}_{key}_{level}"


class Partition(object):
    """Encodes a stream of lines into one set of builders (written under temporary names)."""

    def __init__(self, args, workers):
        self.args = args
        self.workers = workers

    def print_processing_stats(self, count, proc_start, total_bytes_processed, final=False):
        """`Processed N documents (X docs/s, Y MB/s).` on stderr every --log-interval documents."""
        if final or count % self.args.log_interval == 0:
            elapsed = max(time.time() - proc_start, 1e-9)
            mbs = total_bytes_processed / elapsed / 1024 / 1024
            print(
                f"Processed {count} documents",
                f"({count / elapsed} docs/s, {mbs} MB/s).",
                file=sys.stderr,
                flush=True,
            )

    def process(self, items, prefixes, tokenizer):
        """Encode `items` with a pool; write one dataset per key to `prefixes[key]` + tmp suffix."""
        encoder = Encoder(self.args)
        dtype = DType.optimal_dtype(tokenizer.vocab_size)
        builders = {
            key: IndexedDatasetBuilder(prefixes[key] + _TMP_SUFFIX + ".bin", dtype=dtype)
            for key in self.args.json_keys
        }
        count = 0
        total_bytes = 0
        proc_start = time.time()
        if multiprocessing.get_start_method() == "fork":
            # Forked workers inherit the parent's tokenizer instead of each loading the vocabulary
            # and merges again (seconds per worker for GPT-2).
            Encoder.tokenizer = tokenizer
        pool = multiprocessing.Pool(self.workers, initializer=encoder.initializer)
        try:
            for result in _with_heartbeat(pool.imap(encoder.encode, items, 32), lambda: count):
                if result[0] == "error":
                    raise PreprocessError(result[1])
                doc, sentence_lens, bytes_processed = result
                count += 1
                total_bytes += bytes_processed
                for key in doc.keys():
                    builders[key].add_document(doc[key], sentence_lens[key])
                self.print_processing_stats(count, proc_start, total_bytes)
        except BaseException:
            pool.terminate()
            pool.join()
            for key, builder in builders.items():
                builder.data_file.close()
                _remove_tmp(prefixes[key])
            raise
        pool.close()
        pool.join()
        for key in self.args.json_keys:
            builders[key].finalize(prefixes[key] + _TMP_SUFFIX + ".idx")
        self.print_processing_stats(count, proc_start, total_bytes, final=True)
        return count


#: Seconds without a finished document after which a "still encoding" line is printed.
STILL_ENCODING_INTERVAL = 30.0


def _with_heartbeat(results, done):
    """Yield from `results`; while one document takes long (one huge document), a thread prints
    on stderr every STILL_ENCODING_INTERVAL seconds that it is still being encoded."""
    last = [time.time(), time.time()]  # last finished document, last line printed
    stop = threading.Event()

    def _beat():
        while not stop.wait(min(1.0, STILL_ENCODING_INTERVAL / 2)):
            now = time.time()
            if now - max(last) >= STILL_ENCODING_INTERVAL:
                last[1] = now
                print(
                    f"Processed {done()} documents; still encoding document {done() + 1} "
                    f"({now - last[0]:.0f} s so far)",
                    file=sys.stderr,
                    flush=True,
                )

    thread = threading.Thread(target=_beat, daemon=True)
    thread.start()
    try:
        for result in results:
            last[0] = last[1] = time.time()
            yield result
    finally:
        stop.set()
        thread.join()


def _cap_workers(args):
    """More encoding processes than CPU cores only add memory: cap --workers (a multiple of
    --partitions) at the cores this process may use, with a warning."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if args.workers <= cores:
        return
    capped = max(args.partitions, cores // args.partitions * args.partitions)
    if capped >= args.workers:
        return
    print(
        f"WARNING: --workers {args.workers} is more than the {cores} CPU cores available; "
        f"using {capped} workers",
        file=sys.stderr,
        flush=True,
    )
    args.workers = capped


def _remove_tmp(prefix):
    for ext in (".bin", ".idx"):
        try:
            os.remove(prefix + _TMP_SUFFIX + ext)
        except OSError:  # absent, or its directory is not one
            pass


def _commit(prefix):
    # .bin first: a reader checks for both files, and the .idx appears last.
    os.replace(prefix + _TMP_SUFFIX + ".bin", prefix + ".bin")
    os.replace(prefix + _TMP_SUFFIX + ".idx", prefix + ".idx")


def get_args(argv=None):
    """Megatron's preprocess_data flags."""
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input", type=str, required=True, help="Path to input JSON (a glob with --partitions > 1)"
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="JSON fields to tokenize, separated by spaces (one output per field).",
    )
    group.add_argument(
        "--split-sentences",
        action="store_true",
        help="Split documents into sentences (NLTK Punkt, offline).",
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="Keep newlines between sentences when splitting.",
    )

    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--tokenizer-type",
        type=str,
        required=True,
        choices=list(TOKENIZER_TYPES),
        help="Tokenizer to encode with.",
    )
    group.add_argument(
        "--tokenizer-model",
        type=str,
        default=None,
        help="Tokenizer model file (SentencePiece and similar).",
    )
    group.add_argument(
        "--vocab-file", type=str, default=None, help="Vocabulary file of the tokenizer."
    )
    group.add_argument("--vocab-size", default=786, help="Vocabulary size of the NullTokenizer.")
    group.add_argument(
        "--merge-file", type=str, default=None, help="BPE merges file (GPT-2 style tokenizers)."
    )
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="End every document with the end-of-document token.",
    )
    group.add_argument(
        "--lang",
        type=str,
        default="english",
        help="Language of the Punkt sentence splitter.",
    )
    group.add_argument(
        "--vocab-extra-ids",
        type=int,
        default=0,
        help="Number of additional vocabulary tokens (T5 sentinels).",
    )

    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", type=str, required=True, help="Output path without the .bin/.idx suffix."
    )

    group = parser.add_argument_group(title="runtime")
    group.add_argument(
        "--workers", type=int, required=True, help="Tokenizing processes per partition."
    )
    group.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="Split the input into this many partitions, processed in parallel and merged.",
    )
    group.add_argument(
        "--log-interval", type=int, default=1000, help="Print progress every this many documents."
    )
    group.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="With --partitions > 1, keep the documents in their input order.",
    )
    args = parser.parse_args(argv)
    args.keep_empty = False

    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.partitions < 1:
        parser.error(f"--partitions must be >= 1, got {args.partitions}")
    if args.workers % args.partitions != 0:
        parser.error(
            f"--workers ({args.workers}) must be divisible by --partitions ({args.partitions})"
        )
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    _cap_workers(args)
    if args.keep_newlines and not args.split_sentences:
        print("--keep-newlines only applies with --split-sentences; ignored", file=sys.stderr)

    # Tokenizer settings build_tokenizer expects from the training arguments.
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    args.padded_vocab_size = None
    if args.tokenizer_type == "NullTokenizer":
        args.vocab_size = int(args.vocab_size)
    return args


def _input_files(args):
    if any(ch in args.input for ch in "*?["):
        paths = sorted(glob.glob(args.input))
        if not paths:
            raise PreprocessError(f"--input {args.input}: no file matches")
    else:
        paths = [args.input]
    for path in paths:
        if not os.path.isfile(path):
            raise PreprocessError(f"--input {path}: no such file")
    return paths


def _all_prefixes(args, level):
    """Every output prefix of the run: the final ones, and each partition's."""
    prefixes = [_output_prefix(args, key, level) for key in args.json_keys]
    if args.partitions > 1:
        for i in range(args.partitions):
            prefixes += [_output_prefix(args, key, level, partition=i) for key in args.json_keys]
    return prefixes


def _check_outputs(args, level, inputs):
    """The output files can be written, and no two of them (nor an input) are the same file:
    one line before any work (PreprocessError)."""
    directory = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise PreprocessError(f"--output-prefix {args.output_prefix}: {directory} {what}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PreprocessError(f"--output-prefix {args.output_prefix}: {directory} is not writable")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise PreprocessError(
            f"--json-keys {' '.join(args.json_keys)}: a key is repeated, its datasets would "
            f"overwrite each other"
        )
    inputs = {os.path.realpath(p) for p in inputs}
    for prefix in _all_prefixes(args, level):
        for name in (prefix + ".bin", prefix + ".idx"):
            if os.path.realpath(name) in inputs:
                raise PreprocessError(f"--output-prefix {args.output_prefix}: {name} is an input")
            if os.path.isdir(name):
                raise PreprocessError(
                    f"--output-prefix {args.output_prefix}: {name} is a directory"
                )


def run(args):
    """Preprocess as configured by `args`; returns the number of documents."""
    paths = _input_files(args)
    level = "sentence" if args.split_sentences else "document"
    _check_outputs(args, level, paths)
    if not any(True for _ in _read_lines(paths)):
        raise PreprocessError(f"--input {', '.join(paths)}: empty input (no JSON lines)")
    if args.split_sentences:
        _load_sentence_splitter(args.lang, args.keep_newlines)  # fail fast with a clear message
    tokenizer = build_tokenizer(args)
    final_prefixes = {key: _output_prefix(args, key, level) for key in args.json_keys}

    if args.partitions == 1:
        count = Partition(args, args.workers).process(_read_lines(paths), final_prefixes, tokenizer)
        for key in args.json_keys:
            _commit(final_prefixes[key])
        return count

    # Partitions: deal documents round-robin (or contiguously), encode each, then merge in order.
    lines = list(_read_lines(paths))
    n = args.partitions
    if args.keep_sequential_samples:
        per = (len(lines) + n - 1) // n
        parts = [lines[i * per : (i + 1) * per] for i in range(n)]
    else:
        parts = [lines[i::n] for i in range(n)]
    count = 0
    partition_prefixes = []
    for i, part in enumerate(parts):
        prefixes = {key: _output_prefix(args, key, level, partition=i) for key in args.json_keys}
        count += Partition(args, args.workers // n).process(iter(part), prefixes, tokenizer)
        for key in args.json_keys:
            _commit(prefixes[key])
        partition_prefixes.append(prefixes)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    for key in args.json_keys:
        builder = IndexedDatasetBuilder(final_prefixes[key] + _TMP_SUFFIX + ".bin", dtype=dtype)
        for prefixes in partition_prefixes:
            builder.add_index(prefixes[key])
        builder.finalize(final_prefixes[key] + _TMP_SUFFIX + ".idx")
        _commit(final_prefixes[key])
    return count


def main(argv=None):
    args = get_args(argv)
    try:
        count = run(args)
    except (PreprocessError, OSError, ValueError) as exc:
        # Whatever stopped the run, no temporary file stays behind.
        level = "sentence" if args.split_sentences else "document"
        for prefix in _all_prefixes(args, level):
            _remove_tmp(prefix)
        if isinstance(exc, OSError) and exc.filename is not None:
            raise SystemExit(f"error: {exc.strerror}: {exc.filename}") from None
        raise SystemExit(f"error: {exc}") from None
    level = "sentence" if args.split_sentences else "document"
    for key in args.json_keys:
        prefix = _output_prefix(args, key, level)
        ds = IndexedDataset(prefix)
        print(
            f"Wrote {prefix}.bin/.idx: {count} documents, {len(ds)} sequences, "
            f"{int(ds.sequence_lengths.sum(dtype='int64'))} tokens",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
