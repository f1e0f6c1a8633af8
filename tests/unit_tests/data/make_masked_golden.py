"""Write golden BERT/T5 dataset samples (tests/unit_tests/data/golden/masked_datasets.json).

    python tests/unit_tests/data/make_masked_golden.py --megatron-root DIR

DIR is an unpacked megatron-core 0.8.0 wheel (`pip download megatron-core==0.8.0 --no-deps`, then
unzip): the samples then come from Megatron's own BERTMaskedWordPieceDataset /
T5MaskedWordPieceDataset and its compiled helpers. Without --megatron-root this repository's
classes are used (only useful to inspect what ours produce). The JSON holds the inputs too (the
sentence token ids of a bundled-text corpus and the configs), so the test needs nothing else.

The sampling runs in a child interpreter whose `megatron` package is the chosen one; it works in a
scratch directory with relative paths (`corpus`, `cache`, `bert-vocab.txt`) so the dataset
descriptions and their md5 hashes do not depend on where it ran.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
GOLDEN = os.path.join(HERE, "golden", "masked_datasets.json")
SAMPLES_PER_SPLIT = 12
# T5's 2-D masks follow from text_enc/text_dec; the test checks them against those.
_DERIVED_MASKS = ("enc_mask", "dec_mask", "enc_dec_mask")

COMMON = dict(
    random_seed=1234,
    split="90,7,3",
    masking_probability=0.15,
    short_sequence_probability=0.1,
    masking_do_full_word=True,
    masking_do_permutation=False,
    masking_use_longer_ngrams=False,
)
CASES = {
    "bert_binary_head": dict(
        kind="bert",
        vocab_extra_ids=0,
        sizes=[64, 8, 4],
        config=dict(
            sequence_length=64,
            masking_max_ngram=3,
            masking_use_geometric_distribution=False,
            classification_head=True,
        ),
    ),
    "bert_no_binary_head": dict(
        kind="bert",
        vocab_extra_ids=0,
        sizes=[64, 8, 4],
        config=dict(
            sequence_length=32,
            masking_max_ngram=3,
            masking_use_geometric_distribution=False,
            classification_head=False,
        ),
    ),
    "t5": dict(
        kind="t5",
        vocab_extra_ids=20,
        sizes=[64, 8, 4],
        config=dict(
            sequence_length=64,
            sequence_length_decoder=32,
            masking_max_ngram=10,
            masking_use_geometric_distribution=True,
        ),
    ),
}


def _corpus():
    """Sentence token ids (document -> sentence -> ids) of 60 bundled-text paragraphs."""
    sys.path.insert(0, REPO)
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tests.unit_tests.data.sentence_corpus import (
        bert_tokenizer,
        bundled_sentence_corpus,
    )

    with tempfile.TemporaryDirectory() as tmp:
        prefix = bundled_sentence_corpus(os.path.join(tmp, "c"), bert_tokenizer(), num_docs=60)
        ds = IndexedDataset(prefix)
        bounds = ds.document_indices.tolist()
        return [
            [ds[i].tolist() for i in range(bounds[d], bounds[d + 1])]
            for d in range(len(bounds) - 1)
        ]


def _sample_in_child(megatron_root: str, spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(REPO, "data", "bert", "bert-vocab.txt"), tmp)
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=megatron_root)
        subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", megatron_root],
            cwd=tmp,
            env=env,
            check=True,
        )
        with open(os.path.join(tmp, "out.json")) as f:
            return json.load(f)


def _child(megatron_root: str) -> None:
    """Build the corpus and every case with the `megatron` found under megatron_root."""
    sys.path.insert(0, megatron_root)
    import types

    try:
        import pkg_resources  # noqa: F401  (megatron-core 0.8.0 imports it)
    except ImportError:
        import packaging.version

        sys.modules["pkg_resources"] = types.SimpleNamespace(packaging=packaging)
    from collections import OrderedDict

    import numpy
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
    from megatron.core.datasets.t5_dataset import (
        T5MaskedWordPieceDataset,
        T5MaskedWordPieceDatasetConfig,
    )

    class _BertWordPieceTokenizer(MegatronTokenizer):
        """Ids of a WordPiece vocab file plus [BOS], [EOS], <extra_id_i> (no text handling)."""

        def __init__(self, vocab_file, vocab_extra_ids):
            super().__init__(vocab_file, lower_case=True, vocab_extra_ids=vocab_extra_ids)
            with open(vocab_file, encoding="utf-8") as f:
                self._vocab = OrderedDict((line.rstrip("\n"), i) for i, line in enumerate(f))
            self._extra = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
            for token in ["[BOS]", "[EOS]"] + self._extra:
                self._vocab.setdefault(token, len(self._vocab))
            self._inv = OrderedDict((i, t) for t, i in self._vocab.items())

        def tokenize(self, text):
            raise NotImplementedError

        def detokenize(self, ids):
            raise NotImplementedError

        vocab = property(lambda self: self._vocab)
        inv_vocab = property(lambda self: self._inv)
        vocab_size = property(lambda self: len(self._vocab))
        cls = property(lambda self: self._vocab["[CLS]"])
        sep = property(lambda self: self._vocab["[SEP]"])
        pad = property(lambda self: self._vocab["[PAD]"])
        mask = property(lambda self: self._vocab["[MASK]"])
        bos = property(lambda self: self._vocab["[BOS]"])
        eos = property(lambda self: self._vocab["[EOS]"])
        additional_special_tokens_ids = property(lambda self: [self._vocab[t] for t in self._extra])

    with open("spec.json") as f:
        spec = json.load(f)
    builder = IndexedDatasetBuilder("corpus.bin", dtype=numpy.uint16)
    for sentences in spec["corpus"]:
        flat = [t for s in sentences for t in s]
        builder.add_document(torch.tensor(flat), [len(s) for s in sentences])
    builder.finalize("corpus.idx")

    out = {}
    for name, case in spec["cases"].items():
        cls, config_cls = {
            "bert": (BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig),
            "t5": (T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig),
        }[case["kind"]]
        config = config_cls(
            tokenizer=_BertWordPieceTokenizer("bert-vocab.txt", case["vocab_extra_ids"]),
            blend=(["corpus"], None),
            path_to_cache="cache",
            **spec["common"],
            **case["config"],
        )
        splits = BlendedMegatronDatasetBuilder(cls, case["sizes"], lambda: True, config).build()
        out[name] = []
        for ds in splits:
            samples = []
            for i in range(min(len(ds), SAMPLES_PER_SPLIT)):
                sample = ds[i]
                samples.append(
                    {
                        k: (v.tolist() if isinstance(v, numpy.ndarray) else v)
                        for k, v in sample.items()
                        if k not in _DERIVED_MASKS
                    }
                )
            out[name].append(
                dict(
                    num_samples=len(ds),
                    description=ds.unique_description,
                    description_hash=ds.unique_description_hash,
                    sample_index_dtype=str(ds.sample_index.dtype),
                    sample_index=numpy.asarray(ds.sample_index).tolist(),
                    samples=samples,
                )
            )
    with open("out.json", "w") as f:
        json.dump(out, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--megatron-root",
        default=REPO,
        help="directory holding the `megatron` package to sample with",
    )
    parser.add_argument("--out", default=GOLDEN)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child)
        return
    spec = dict(corpus=_corpus(), common=COMMON, cases=CASES)
    results = _sample_in_child(os.path.abspath(args.megatron_root), spec)
    produced_by = (
        "megatron-core 0.8.0" if os.path.abspath(args.megatron_root) != REPO else "this repo"
    )
    golden = dict(produced_by=produced_by, **spec, results=results)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(golden, f, separators=(",", ":"))
    print(
        f"wrote {args.out} ({produced_by}): "
        + ", ".join(
            f"{name} {[split['num_samples'] for split in r]}" for name, r in results.items()
        )
    )


if __name__ == "__main__":
    main()
