"""tools/preprocess_data.py and tools/merge_datasets.py on the bundled corpora: round trips,
worker-count independence, partitions, merging, and the one-line errors on bad input.
(--split-sentences is covered in test_sentence_splitting.py.)"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import types

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.training.tokenizer import build_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[3]
DATA = REPO / "data"
GPT2 = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    str(DATA / "gpt2" / "gpt2-vocab.json"),
    "--merge-file",
    str(DATA / "gpt2" / "gpt2-merges.txt"),
]


def _load_tool(name):
    # Worker pools pickle the tool's classes by module name, so every importer of this file (pytest
    # may import it twice, as a test module and from test_preprocess_limits) must share one module.
    if f"_tool_{name}" in sys.modules:
        return sys.modules[f"_tool_{name}"]
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # worker pools pickle the tool's classes by module name
    spec.loader.exec_module(module)
    return module


preprocess = _load_tool("preprocess_data")
merge_datasets = _load_tool("merge_datasets")


@pytest.fixture(scope="module")
def gpt2():
    return build_tokenizer(
        types.SimpleNamespace(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=str(DATA / "gpt2" / "gpt2-vocab.json"),
            merge_file=str(DATA / "gpt2" / "gpt2-merges.txt"),
            tokenizer_model=None,
            vocab_extra_ids=0,
            make_vocab_size_divisible_by=128,
            tensor_model_parallel_size=1,
            rank=1,
        )
    )


def _texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _run_cli(tool, argv):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / f"{tool}.py")] + argv,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(REPO),
    )


def _outputs(prefix_dir):
    return sorted(p.name for p in pathlib.Path(prefix_dir).iterdir())


@pytest.mark.parametrize("corpus", ["mobydick.jsonl", "fortunes.jsonl"])
def test_round_trip_every_document(tmp_path, gpt2, corpus):
    """preprocess -> IndexedDataset -> detokenize gives back every document of the corpus."""
    prefix = str(tmp_path / "out")
    result = _run_cli(
        "preprocess_data",
        [
            "--input",
            str(DATA / "corpus" / corpus),
            "--output-prefix",
            prefix,
            "--append-eod",
            "--workers",
            "2",
            "--log-interval",
            "100",
        ]
        + GPT2,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "Processed 100 documents (" in result.stderr
        and " docs/s, " in result.stderr
        and " MB/s)." in result.stderr
    )
    ds = IndexedDataset(prefix + "_text_document")
    texts = _texts(DATA / "corpus" / corpus)
    assert ds.index.dtype == numpy.uint16
    assert len(ds) == len(texts) and ds.document_indices.tolist() == list(range(len(texts) + 1))
    for i, text in enumerate(texts):
        ids = ds[i]
        assert ids[-1] == gpt2.eod
        assert gpt2.detokenize(ids[:-1].tolist()) == text, f"document {i}"


def test_output_identical_for_any_worker_count(tmp_path):
    outs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        preprocess.main(
            [
                "--input",
                str(DATA / "corpus" / "mobydick.jsonl"),
                "--output-prefix",
                prefix,
                "--append-eod",
                "--workers",
                str(workers),
                "--log-interval",
                "1000000",
            ]
            + GPT2
        )
        outs[workers] = [
            open(prefix + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx")
        ]
    assert outs[1] == outs[2]
    assert len(outs[1][0]) > 500_000


@pytest.fixture
def small_jsonl(tmp_path):
    path = tmp_path / "small.jsonl"
    texts = _texts(DATA / "corpus" / "fortunes.jsonl")[:41]
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "title": f"Fortune number {i}"}) + "\n")
    return path, texts


def test_multiple_keys_and_no_eod(tmp_path, gpt2, small_jsonl):
    path, texts = small_jsonl
    prefix = str(tmp_path / "multi")
    preprocess.main(
        [
            "--input",
            str(path),
            "--output-prefix",
            prefix,
            "--json-keys",
            "text",
            "title",
            "--workers",
            "1",
        ]
        + GPT2
    )
    text_ds = IndexedDataset(prefix + "_text_document")
    title_ds = IndexedDataset(prefix + "_title_document")
    assert [gpt2.detokenize(text_ds[i].tolist()) for i in range(len(texts))] == texts
    assert gpt2.detokenize(title_ds[7].tolist()) == "Fortune number 7"


def test_partitions_merge_round_robin(tmp_path, gpt2, small_jsonl):
    path, texts = small_jsonl
    prefix = str(tmp_path / "parts")
    preprocess.main(
        ["--input", str(path), "--output-prefix", prefix, "--workers", "2", "--partitions", "2"]
        + GPT2
    )
    ds = IndexedDataset(prefix + "_text_document")
    order = list(range(0, len(texts), 2)) + list(range(1, len(texts), 2))
    assert [gpt2.detokenize(ds[i].tolist()) for i in range(len(texts))] == [texts[k] for k in order]
    seq = str(tmp_path / "seq")
    preprocess.main(
        [
            "--input",
            str(path),
            "--output-prefix",
            seq,
            "--workers",
            "2",
            "--partitions",
            "2",
            "--keep-sequential-samples",
        ]
        + GPT2
    )
    ds = IndexedDataset(seq + "_text_document")
    assert [gpt2.detokenize(ds[i].tolist()) for i in range(len(texts))] == texts


def test_merge_datasets(tmp_path, gpt2, small_jsonl):
    path, texts = small_jsonl
    parts = tmp_path / "parts"
    parts.mkdir()
    lines = open(path, encoding="utf-8").read().splitlines()
    for name, chunk in (("a", lines[:20]), ("b", lines[20:])):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("\n".join(chunk) + "\n", encoding="utf-8")
        preprocess.main(
            ["--input", str(src), "--output-prefix", str(parts / name), "--workers", "1"] + GPT2
        )
    result = _run_cli(
        "merge_datasets", ["--input", str(parts), "--output-prefix", str(tmp_path / "merged")]
    )
    assert result.returncode == 0, result.stderr
    merged = IndexedDataset(str(tmp_path / "merged"))
    assert [gpt2.detokenize(merged[i].tolist()) for i in range(len(texts))] == texts
    assert merged.document_indices.tolist() == list(range(len(texts) + 1))
    os.remove(parts / "b_text_document.bin")
    with pytest.raises(SystemExit, match=r"error: \.bin file not provided for .*b_text_document"):
        merge_datasets.main(["--input", str(parts), "--output-prefix", str(tmp_path / "merged2")])


def _expect_error(tmp_path, argv, pattern):
    prefix = str(tmp_path / "outbad")
    with pytest.raises(SystemExit) as info:
        preprocess.main(argv + ["--output-prefix", prefix])
    message = str(info.value.code)
    assert "\n" not in message
    assert __import__("re").search(pattern, message), message
    assert not [p for p in os.listdir(tmp_path) if p.startswith("outbad")], "left files behind"


def test_empty_input(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    _expect_error(
        tmp_path, ["--input", str(empty), "--workers", "1"] + GPT2, r"empty input \(no JSON lines\)"
    )


def test_malformed_json_names_file_and_line(tmp_path, small_jsonl):
    path, _ = small_jsonl
    lines = open(path, encoding="utf-8").read().splitlines()
    lines[29] = lines[29][:-3]  # cut the closing quote and brace
    bad = tmp_path / "badjson.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _expect_error(
        tmp_path,
        ["--input", str(bad), "--workers", "2"] + GPT2,
        rf"error: {bad}:30: malformed JSON",
    )


def test_missing_key_names_file_and_line(tmp_path, small_jsonl):
    path, _ = small_jsonl
    _expect_error(
        tmp_path,
        ["--input", str(path), "--json-keys", "text", "body", "--workers", "2"] + GPT2,
        rf"error: {path}:1: missing key 'body'",
    )


def test_missing_vocab_file(tmp_path, small_jsonl):
    path, _ = small_jsonl
    argv = [
        "--input",
        str(path),
        "--workers",
        "1",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(tmp_path / "nope.json"),
        "--merge-file",
        str(DATA / "gpt2" / "gpt2-merges.txt"),
    ]
    _expect_error(tmp_path, argv, r"--vocab-file: no such file: .*nope\.json")


def test_missing_input_file(tmp_path):
    _expect_error(
        tmp_path,
        ["--input", str(tmp_path / "none.jsonl"), "--workers", "1"] + GPT2,
        r"no such file",
    )
