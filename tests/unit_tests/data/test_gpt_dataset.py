"""GPTDataset / BlendedDataset / builder on real tokenized text, against a reference written from
Megatron's megatron/core/datasets/gpt_dataset.py: epochs, the separate-last-epoch rule, the seeded
shuffles, samples as windows of the shuffled token stream, masks, blend sizing and the cache."""

import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys
import types

import numpy
import pytest
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import Split, get_blend_from_list
from megatron.training.tokenizer import build_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[3]
DATA = REPO / "data"
SEQ = 32


def _tokenizer():
    args = types.SimpleNamespace(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=str(DATA / "gpt2" / "gpt2-vocab.json"),
        merge_file=str(DATA / "gpt2" / "gpt2-merges.txt"),
        tokenizer_model=None,
        vocab_extra_ids=0,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        rank=1,
    )
    return build_tokenizer(args)


def _write_corpus(prefix, corpus, num_docs, tok):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    with open(DATA / "corpus" / corpus, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == num_docs:
                break
            ids = tok.tokenize(json.loads(line)["text"]) + [tok.eod]
            builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptdata")
    tok = _tokenizer()
    fortunes = str(root / "fortunes_text_document")
    moby = str(root / "moby_text_document")
    _write_corpus(fortunes, "fortunes.jsonl", 400, tok)
    _write_corpus(moby, "mobydick.jsonl", 30, tok)
    return types.SimpleNamespace(root=root, tok=tok, fortunes=fortunes, moby=moby)


def _config(corpus, cache, **kw):
    base = dict(
        random_seed=1234,
        sequence_length=SEQ,
        blend=([corpus.fortunes], None),
        split="969,30,1",
        path_to_cache=str(cache),
        tokenizer=corpus.tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    base.update(kw)
    return GPTDatasetConfig(**base)


# ---------------------------------------------------------------------------------------------
# Reference (the index construction of Megatron's gpt_dataset.py)
# ---------------------------------------------------------------------------------------------


def reference_split(corpus_prefix, seed, num_samples, docs):
    ds = IndexedDataset(corpus_prefix)
    lengths = ds.sequence_lengths
    tokens_per_epoch = int(lengths[docs].sum())
    epochs = 1
    while epochs * tokens_per_epoch < num_samples * SEQ + 1:
        epochs += 1
    separate = False
    if epochs > 1:
        n0 = ((epochs - 1) * tokens_per_epoch - 1) // SEQ
        n_ep = (tokens_per_epoch - 1) // SEQ
        separate = (num_samples - n0) < int(0.8 * n_ep)
    rs = numpy.random.RandomState(seed)
    if separate:
        first = numpy.array(list(docs) * (epochs - 1), dtype=numpy.int32)
        rs.shuffle(first)
        last = numpy.array(list(docs), dtype=numpy.int32)
        rs.shuffle(last)
        doc_index = numpy.concatenate([first, last])
    else:
        doc_index = numpy.array(list(docs) * epochs, dtype=numpy.int32)
        rs.shuffle(doc_index)
    stream = numpy.concatenate([ds[int(d)] for d in doc_index]).astype(numpy.int64)
    total = (epochs * tokens_per_epoch - 1) // SEQ
    windows = [stream[j * SEQ : j * SEQ + SEQ + 1] for j in range(total)]
    if separate:
        a = numpy.arange(n0, dtype=numpy.uint32)
        rs.shuffle(a)
        b = numpy.arange(n0, total, dtype=numpy.uint32)
        rs.shuffle(b)
        shuffle = numpy.concatenate([a, b])
    else:
        shuffle = numpy.arange(total, dtype=numpy.uint32)
        rs.shuffle(shuffle)
    return types.SimpleNamespace(
        epochs=epochs,
        separate=separate,
        doc_index=doc_index,
        shuffle=shuffle,
        samples=[windows[j] for j in shuffle],
    )


def _train_docs(n):
    return numpy.arange(0, round(0.969 * n))


@pytest.mark.parametrize("case", ["one_epoch", "three_epochs_joint", "three_epochs_separate"])
def test_samples_match_reference(corpus, tmp_path, case):
    n_docs = 400
    docs = _train_docs(n_docs)
    tokens = int(IndexedDataset(corpus.fortunes).sequence_lengths[docs].sum())
    if case == "one_epoch":
        n = 50
    elif case == "three_epochs_joint":
        n = (3 * tokens - 1) // SEQ
    else:
        n = ((2 * tokens - 1) // SEQ) + 1
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [n, None, None], lambda: True, _config(corpus, tmp_path)
    ).build()
    ref = reference_split(corpus.fortunes, 1234, n, docs)
    assert ref.epochs == {"one_epoch": 1, "three_epochs_joint": 3, "three_epochs_separate": 3}[case]
    assert ref.separate == (case == "three_epochs_separate")
    numpy.testing.assert_array_equal(train.document_index, ref.doc_index)
    numpy.testing.assert_array_equal(train.shuffle_index, ref.shuffle)
    assert train.shuffle_index.dtype == numpy.uint32
    assert len(train) == len(ref.samples) >= n
    for i in list(range(0, len(train), max(1, len(train) // 300))) + [len(train) - 1]:
        sample = train[i]
        assert torch.equal(sample["tokens"], torch.from_numpy(ref.samples[i][:-1]))
        assert torch.equal(sample["labels"], torch.from_numpy(ref.samples[i][1:]))


def test_cache_names_description_and_reuse(corpus, tmp_path):
    cfg = _config(corpus, tmp_path, split="90,8,2")
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [40, 8, 4], lambda: True, cfg
    ).build()
    assert train.built_anew_on_cache_miss
    for ds, name in ((train, "train"), (valid, "valid"), (test, "test")):
        desc = json.loads(ds.unique_description)
        assert list(desc) == [
            "class",
            "dataset_path",
            "num_samples",
            "index_split",
            "random_seed",
            "sequence_length",
            "split",
            "split_matrix",
            "tokenizer",
        ]
        assert desc["index_split"] == name and desc["split"] == "90,8,2"
        assert desc["tokenizer"]["class"] == "_GPT2BPETokenizer"
        digest = hashlib.md5(ds.unique_description.encode("utf-8")).hexdigest()
        for suffix in (
            "description.txt",
            "document_index.npy",
            "sample_index.npy",
            "shuffle_index.npy",
        ):
            assert (tmp_path / f"{digest}-GPTDataset-{name}-{suffix}").is_file()
        assert (
            tmp_path / f"{digest}-GPTDataset-{name}-description.txt"
        ).read_text() == ds.unique_description
    assert desc["split_matrix"] == [[0.0, 0.9], [0.9, 0.98], [0.98, 1.0]]
    # A restart with the same config loads the cache and gives the same samples.
    again = BlendedMegatronDatasetBuilder(GPTDataset, [40, 8, 4], lambda: True, cfg).build()[0]
    assert not again.built_anew_on_cache_miss
    assert all(torch.equal(again[i]["tokens"], train[i]["tokens"]) for i in range(len(train)))
    # Another seed: another order (and another cache entry).
    other_cfg = _config(corpus, tmp_path, split="90,8,2", random_seed=5)
    other = BlendedMegatronDatasetBuilder(GPTDataset, [40, 8, 4], lambda: True, other_cfg).build()[
        0
    ]
    assert other.built_anew_on_cache_miss
    assert not numpy.array_equal(
        numpy.asarray(other.shuffle_index), numpy.asarray(train.shuffle_index)
    )


def test_default_cache_location(corpus, tmp_path):
    import shutil

    prefix = str(tmp_path / "copy")
    shutil.copy(corpus.moby + ".bin", prefix + ".bin")
    shutil.copy(corpus.moby + ".idx", prefix + ".idx")
    cfg = _config(corpus, None, blend=([prefix], None), path_to_cache=None)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [10, None, None], lambda: True, cfg).build()[
        0
    ]
    files = os.listdir(os.path.join(prefix, "cache", "GPTDataset_indices"))
    assert f"{train.unique_description_hash}-GPTDataset-train-shuffle_index.npy" in files


_ORDER_SCRIPT = """
import sys, types, numpy
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.training.tokenizer import build_tokenizer
prefix, cache, data = sys.argv[1:4]
tok = build_tokenizer(types.SimpleNamespace(tokenizer_type="GPT2BPETokenizer",
    vocab_file=data + "/gpt2/gpt2-vocab.json",
    merge_file=data + "/gpt2/gpt2-merges.txt", tokenizer_model=None, vocab_extra_ids=0,
    make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, rank=1))
cfg = GPTDatasetConfig(random_seed=1234, sequence_length=32, blend=([prefix], None),
    split="969,30,1", path_to_cache=cache, tokenizer=tok, reset_position_ids=False,
    reset_attention_mask=False, eod_mask_loss=False)
train = BlendedMegatronDatasetBuilder(GPTDataset, [300, None, None], lambda: True, cfg).build()[0]
print(train.unique_description_hash,
      ",".join(str(int(train[i]["tokens"][0])) for i in range(len(train))))
"""


def test_same_order_in_another_process(corpus, tmp_path):
    cfg = _config(corpus, tmp_path / "here")
    train = BlendedMegatronDatasetBuilder(GPTDataset, [300, None, None], lambda: True, cfg).build()[
        0
    ]
    out = subprocess.run(
        [sys.executable, "-c", _ORDER_SCRIPT, corpus.fortunes, str(tmp_path / "there"), str(DATA)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
    )
    assert out.returncode == 0, out.stderr
    digest, firsts = out.stdout.split()
    assert digest == train.unique_description_hash
    assert firsts == ",".join(str(int(train[i]["tokens"][0])) for i in range(len(train)))


def _brute_force_masks(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    s = len(tokens)
    eods = [k for k in range(s) if tokens[k] == eod]
    position_ids, masked = [], numpy.zeros((s, s), dtype=bool)
    for i in range(s):
        prev = [k for k in eods if k < i]
        position_ids.append(i - (prev[-1] + 1) if (reset_position_ids and prev) else i)
        for j in range(s):
            masked[i, j] = j > i or (reset_attention_mask and any(j <= k < i for k in eods))
    loss = [0.0 if (eod_mask_loss and t == eod) else 1.0 for t in tokens]
    return masked, loss, position_ids


@pytest.mark.parametrize(
    "flags",
    [
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (False, False, True),
        (True, True, True),
    ],
)
def test_masks_and_position_ids(corpus, tmp_path, flags):
    rp, ra, em = flags
    cfg = _config(
        corpus, tmp_path, reset_position_ids=rp, reset_attention_mask=ra, eod_mask_loss=em
    )
    train = BlendedMegatronDatasetBuilder(GPTDataset, [60, None, None], lambda: True, cfg).build()[
        0
    ]
    eod = corpus.tok.eod
    seen_eod = False
    for i in range(60):
        sample = train[i]
        tokens = sample["tokens"].tolist()
        seen_eod |= eod in tokens
        masked, loss, pos = _brute_force_masks(tokens, eod, rp, ra, em)
        assert sample["attention_mask"].dtype == torch.bool and sample["attention_mask"].shape == (
            1,
            SEQ,
            SEQ,
        )
        assert numpy.array_equal(sample["attention_mask"][0].numpy(), masked)
        assert sample["loss_mask"].tolist() == loss
        assert sample["position_ids"].tolist() == pos
    assert seen_eod  # fortunes are short: the options were really exercised


def test_no_attention_mask_when_disabled(corpus, tmp_path):
    cfg = _config(corpus, tmp_path, create_attention_mask=False)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [5, None, None], lambda: True, cfg).build()[0]
    assert set(train[0]) == {"tokens", "labels", "loss_mask", "position_ids"}


def test_weighted_blend_sizes_and_items(corpus, tmp_path):
    blend = get_blend_from_list(["0.3", corpus.fortunes, "0.7", corpus.moby])
    assert blend == ([corpus.fortunes, corpus.moby], [0.3, 0.7])
    cfg = _config(corpus, tmp_path, blend=blend, split="80,10,10")
    sizes = [100, 20, 6]
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    for split, (blended, n) in enumerate(zip(datasets, sizes)):
        assert isinstance(blended, BlendedDataset)
        per_dataset = [math.ceil(n * w * 1.005) for w in (0.3, 0.7)]  # core_v0.8.0 blend sizing
        assert [d.num_samples for d in blended.datasets] == per_dataset
        assert len(blended) == sum(per_dataset)
        assert blended.split == Split(split)
        counts = numpy.bincount(numpy.asarray(blended.dataset_index), minlength=2)
        assert abs(counts[0] - 0.3 * len(blended)) <= 1
        for k in (0, 1, len(blended) - 1):
            item = blended[k]
            d, s = int(blended.dataset_index[k]), int(blended.dataset_sample_index[k])
            assert int(item["dataset_id"]) == d
            assert torch.equal(item["tokens"], blended.datasets[d][s]["tokens"])
    digest = datasets[0].unique_description_hash
    assert (tmp_path / f"{digest}-BlendedDataset-train-dataset_index.npy").is_file()
    assert datasets[0].weights == [0.3, 0.7]
    renorm = _config(
        corpus, tmp_path, blend=blend, split="80,10,10", renormalize_blend_weights=True
    )
    train = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, renorm).build()[0]
    per_dataset = [math.ceil(100 * w * 1.005) for w in (0.3, 0.7)]
    assert train.weights == pytest.approx([n / sum(per_dataset) for n in per_dataset])
    assert list(json.loads(datasets[0].unique_description)) == [
        "class",
        "datasets",
        "split",
        "weights",
        "size",
    ]


def test_unweighted_blend_and_blend_per_split(corpus, tmp_path):
    cfg = _config(corpus, tmp_path, blend=([corpus.fortunes, corpus.moby], None), split="90,8,2")
    train = BlendedMegatronDatasetBuilder(GPTDataset, [50, None, None], lambda: True, cfg).build()[
        0
    ]
    assert len(train) == 50  # min(requested, sum of one-epoch lengths)
    assert [d.num_samples for d in train.datasets] == [None, None]
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=SEQ,
        blend_per_split=[([corpus.fortunes], None), ([corpus.moby], None), None],
        path_to_cache=str(tmp_path),
        tokenizer=corpus.tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [30, 10, 5], lambda: True, cfg
    ).build()
    assert test is None
    assert (
        isinstance(train, GPTDataset) and train.dataset_path == corpus.fortunes and len(train) >= 30
    )
    assert valid.dataset_path == corpus.moby and len(valid.indices) == 30


def test_split_without_documents_is_an_error(corpus, tmp_path):
    import shutil

    prefix = str(tmp_path / "tiny")
    shutil.copy(corpus.moby + ".bin", prefix + ".bin")
    shutil.copy(corpus.moby + ".idx", prefix + ".idx")
    cfg = _config(corpus, tmp_path, blend=([prefix], None), split="99,1,0")
    with pytest.raises(
        ValueError,
        match=(
            r"--split 99,1,0 leaves the valid split of .* with no documents \(30 in total\) but 10 "
            r"samples"
        ),
    ) as info:
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 10, 0], lambda: True, cfg).build()
    assert "\n" not in str(info.value)
    # Requesting nothing from the empty split is fine.
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [10, 0, 0], lambda: True, cfg
    ).build()
    assert len(valid) == 0 and test is None


def test_config_errors(corpus):
    assert get_blend_from_list(["a", "b", "c"]) == (["a", "b", "c"], None)
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    with pytest.raises(ValueError, match="cannot tell weights from prefixes"):
        get_blend_from_list(["0.5", "a", "b", "c"])
    with pytest.raises(ValueError, match=">= 0"):
        get_blend_from_list(["-1", "a", "1", "b"])
    with pytest.raises(ValueError, match="split"):
        GPTDatasetConfig(
            random_seed=1,
            sequence_length=SEQ,
            blend=([corpus.fortunes], None),
            tokenizer=corpus.tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        )
    with pytest.raises(ValueError, match="incompatible"):
        GPTDatasetConfig(
            random_seed=1,
            sequence_length=SEQ,
            blend=([corpus.fortunes], None),
            split="1",
            blend_per_split=[([corpus.fortunes], None), None, None],
            tokenizer=corpus.tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        )
    with pytest.raises(ValueError, match="eod_mask_loss"):
        GPTDatasetConfig(
            random_seed=1,
            sequence_length=SEQ,
            tokenizer=corpus.tok,
            reset_position_ids=False,
            reset_attention_mask=False,
        )


def test_mock_dataset(corpus):
    cfg = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQ,
        tokenizer=corpus.tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
    )
    assert cfg.mock and cfg.split == "1,1,1"
    train, valid, test = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [20, 4, 2], lambda: True, cfg
    ).build()
    # Megatron r0.8's length: every sample built (one epoch here), at least what was asked.
    assert all(len(ds) == ds.sample_index.shape[0] - 1 for ds in (train, valid, test))
    assert len(train) >= 20 and len(valid) >= 4 and len(test) >= 2
    sample = train[0]
    assert sample["tokens"].shape == (SEQ,) and torch.equal(
        sample["labels"][:-1], sample["tokens"][1:]
    )
    # Mock documents are 1, 2, ..., n-1, eod: every non-eod token is one more than the previous one
    # inside a document.
    toks = sample["tokens"].tolist()
    for a, b in zip(toks, toks[1:]):
        assert b == a + 1 or a == corpus.tok.eod or b == corpus.tok.eod
    with pytest.raises(IndexError):
        train[len(train)]


def test_mock_rebuild_reuses_the_indices_of_the_same_plan(corpus, monkeypatch):
    """Without an on-disk cache a second build in the same process takes the memoised indices:
    the same arrays (read-only) for the same epoch plan, whatever num_samples asked for it,
    equal to a fresh build; another seed or sequence length builds anew."""
    from megatron.core.datasets import index_memo

    long_seq = 1024  # fewer samples per epoch than SEQ: quicker builds

    def build(seed=1234, seq=long_seq, sizes=(20, 4, 2)):
        cfg = GPTDatasetConfig(
            random_seed=seed,
            sequence_length=seq,
            tokenizer=corpus.tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        )
        return BlendedMegatronDatasetBuilder(MockGPTDataset, list(sizes), lambda: True, cfg).build()

    index_memo.clear()
    first = build()
    again = build(sizes=(24, 8, 2))  # still one epoch of every split: the same plan
    for a, b in zip(first, again):
        assert a.shuffle_index is b.shuffle_index and a.sample_index is b.sample_index
        assert not a.shuffle_index.flags.writeable
    index_memo.clear()
    monkeypatch.setattr(index_memo, "MAX_BYTES", 0)  # nothing fits: every build is fresh
    fresh = build()
    for a, b in zip(first, fresh):
        assert a.shuffle_index is not b.shuffle_index
        assert numpy.array_equal(a.shuffle_index, b.shuffle_index)
        assert numpy.array_equal(a.sample_index, b.sample_index)
        assert numpy.array_equal(a.document_index, b.document_index)
    monkeypatch.undo()
    other_seed, other_seq = build(seed=99)[0], build(seq=long_seq // 2)[0]
    assert not numpy.array_equal(other_seed.shuffle_index[:64], first[0].shuffle_index[:64])
    assert other_seq.sample_index.shape != first[0].sample_index.shape
    index_memo.clear()


def _distributed_build(fortunes_prefix, cache, data_dir):
    """Every rank builds through the builder; rank 0 writes the cache, the others load it."""
    tok = build_tokenizer(
        types.SimpleNamespace(
            tokenizer_type="GPT2BPETokenizer",
            vocab_file=data_dir + "/gpt2/gpt2-vocab.json",
            merge_file=data_dir + "/gpt2/gpt2-merges.txt",
            tokenizer_model=None,
            vocab_extra_ids=0,
            make_vocab_size_divisible_by=128,
            tensor_model_parallel_size=1,
            rank=1,
        )
    )
    cfg = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=SEQ,
        blend=([fortunes_prefix], None),
        split="969,30,1",
        path_to_cache=cache,
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    train = BlendedMegatronDatasetBuilder(GPTDataset, [100, None, None], lambda: True, cfg).build()[
        0
    ]
    return {
        "built": train.built_anew_on_cache_miss,
        "shuffle": torch.from_numpy(numpy.asarray(train.shuffle_index).astype(numpy.int64)),
        "first": train[0]["tokens"],
    }


def test_built_on_rank_zero_loaded_elsewhere(corpus, tmp_path):
    dist_utils = pytest.importorskip("tests.unit_tests.dist_utils")
    outs = dist_utils.run_distributed(
        _distributed_build, world_size=2, args=(corpus.fortunes, str(tmp_path / "cache"), str(DATA))
    )
    assert outs[0]["built"] is True and outs[1]["built"] is False
    assert torch.equal(outs[0]["shuffle"], outs[1]["shuffle"])
    assert torch.equal(outs[0]["first"], outs[1]["first"])


def test_mock_data_refuses_a_vocabulary_smaller_than_its_token_ids():
    """--mock-data's documents are 1, 2, ..., length - 1 (ids up to 4095): a smaller vocabulary
    is refused when the dataset is built, not by an IndexError (TP1) or zero embeddings (TP > 1)
    in the middle of training."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    with pytest.raises(ValueError, match=r'vocabulary of 64 does not hold: use --vocab-size 4095'):
        MockGPTLowLevelDataset(_NullTokenizer(63))
    dataset = MockGPTLowLevelDataset(_NullTokenizer(4095))
    assert max(int(dataset[i].max()) for i in range(50)) < 4096
