"""SFTDataset: samples depend on their index only, Megatron's splits (contiguous rows) and blends,
the long-conversation policy, bad rows named by file and line, CP padding, and a plan cache that
an edited file does not reuse."""

import json
import re

import numpy
import pytest
import torch

from tests.unit_tests.data.sft_utils import CHATML, build_chat_tokenizer, write_jsonl

pytest.importorskip("transformers")


def _row(i, turns=1, system=True):
    messages = [{"role": "system", "content": f"Row {i}."}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"What is {i} plus {t}?"})
        messages.append({"role": "assistant", "content": f"It is {i + t}."})
    return {"messages": messages}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer

    path = build_chat_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", CHATML)
    return SFTTokenizer(path, "default")


def _config(tokenizer, tmp_path, **kw):
    from megatron.training.datasets.sft_dataset import SFTDatasetConfig

    kw.setdefault("split", "1")
    kw.setdefault("sequence_length", 96)
    return SFTDatasetConfig(
        random_seed=1, tokenizer=tokenizer, path_to_cache=str(tmp_path / "cache"), **kw
    )


def _build(path, config, sizes=(None, None, None)):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.training.datasets.sft_dataset import SFTDataset

    return BlendedMegatronDatasetBuilder(SFTDataset, list(sizes), lambda: True, config).build()


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_samples_depend_on_the_index_only(tokenizer, tmp_path):
    rows = [_row(i, turns=1 + i % 3, system=i % 4 != 0) for i in range(40)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    config = _config(tokenizer, tmp_path, blend=([path], None))
    first = _build(path, config)[0]
    n = len(first)
    forward = [first[i] for i in range(n)]
    again = _build(path, config)[0]  # a fresh instance: loads the cached plan
    for i in numpy.random.default_rng(0).permutation(n).tolist() + list(range(n))[::-1]:
        assert _same(again[i], forward[i]), i
    loader = torch.utils.data.DataLoader(again, batch_size=1, num_workers=2)
    for i, batch in enumerate(loader):
        assert all(torch.equal(batch[k][0], forward[i][k]) for k in forward[i])
    # More samples than packs wrap around in the same order (Megatron's i mod n).
    longer = _build(path, config, sizes=(3 * n, None, None))[0]
    assert len(longer) >= 3 * n and _same(longer[2 * n + 1], forward[1])


def test_split_takes_contiguous_rows_and_blend_follows_weights(tokenizer, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [_row(i) for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [_row(100 + i) for i in range(10)])
    config = _config(tokenizer, tmp_path, blend=([a], None), split="60,20,20", sequence_length=64)
    decode = tokenizer._tokenizer.decode

    def rows_in(dataset):
        texts = [decode(dataset[i]["tokens"]) for i in range(len(dataset))]
        return sorted(int(r) for t in texts for r in re.findall(r"Row (\d+)\.", t))

    assert [rows_in(d) for d in _build(a, config)] == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9]]
    # A weighted blend of two files: each sample comes from the file its weight says.
    config = _config(
        tokenizer, tmp_path, blend=([a, b], [0.25, 0.75]), split="1", sequence_length=64
    )
    blended = _build(a, config, sizes=(16, None, None))[0]
    ids = [int(blended.dataset_index[i]) for i in range(16)]
    assert ids.count(1) == 12 and ids.count(0) == 4
    for i in range(16):
        text = decode(blended[i]["tokens"])
        assert ("Row 1" in text and all(f"Row {k}." not in text for k in range(10))) == (
            ids[i] == 1
        )


def test_long_conversations_truncate_with_a_count_or_refuse(tokenizer, tmp_path, capsys):
    rows = [_row(0), _row(1, turns=12), _row(2), _row(3, turns=15)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    config = _config(tokenizer, tmp_path, blend=([path], None), sequence_length=64)
    dataset = _build(path, config)[0]
    out = capsys.readouterr().out
    assert (
        f"WARNING: 2 conversation(s) of {path} (train split) are longer than --seq-length 64" in out
    )
    assert all(dataset[i]["tokens"].shape == (64,) for i in range(len(dataset)))
    config = _config(
        tokenizer, tmp_path, blend=([path], None), sequence_length=64, long_conversations="error"
    )
    with pytest.raises(ValueError) as info:
        _build(path, config)
    message = str(info.value)
    assert message.startswith(f"{path} line 2: a conversation of ")
    assert message.endswith(
        f"tokens does not fit --seq-length 64 + 1 (2 such in {path}); raise --seq-length, shorten "
        "the data, or pass --sft-long-conversations truncate"
    )
    # One row per sample: a row whose conversations together overflow is the unit.
    rows = [{"messages": _row(5, turns=4)["messages"] + _row(6, turns=4)["messages"]}]
    path = write_jsonl(tmp_path / "row.jsonl", rows)
    config = _config(
        tokenizer,
        tmp_path,
        blend=([path], None),
        sequence_length=64,
        one_row_per_sample=True,
        long_conversations="error",
    )
    with pytest.raises(ValueError, match=rf"^{path} line 1: a row of \d+ tokens does not fit"):
        _build(path, config)


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"text": "no messages"}', "no 'messages' list of {role, content} objects"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "message 0 has unknown role 'bot'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "a conversation has no assistant"),
        ('{"messages": [', "not valid JSON"),
    ],
)
def test_bad_rows_are_named_by_file_and_line(tokenizer, tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [_row(0), "", line, _row(1)])
    config = _config(tokenizer, tmp_path, blend=([path], None))
    with pytest.raises(ValueError) as info:
        _build(path, config)
    assert str(info.value).startswith(f"{path} line 3: ") and message in str(info.value)


def test_context_parallel_padding_and_edited_file(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "cp.jsonl", [_row(i, turns=1 + i % 2) for i in range(6)])
    config = _config(tokenizer, tmp_path, blend=([path], None), context_parallel_size=2)
    dataset = _build(path, config)[0]
    for i in range(len(dataset)):
        assert all(int(c) % 4 == 0 for c in dataset[i]["cu_seqlens"])
    with pytest.raises(ValueError, match=r"--seq-length \(98\) must be a multiple of 2 x"):
        _config(
            tokenizer, tmp_path, blend=([path], None), context_parallel_size=2, sequence_length=98
        )
    # The plan is cached; an edited file gets a new plan (its size and mtime key the cache).
    config = _config(tokenizer, tmp_path, blend=([path], None))
    before = _build(path, config)[0]
    with open(path, "a") as f:
        f.write(json.dumps(_row(99, turns=3)) + "\n")
    after = _build(path, config)[0]
    assert after.unique_description_hash != before.unique_description_hash
    assert after.pack_items.shape[0] == before.pack_items.shape[0] + 1


def test_prompt_longer_than_a_sample_is_left_out_and_not_counted(tokenizer, tmp_path, capsys):
    long_prompt = {
        "messages": [
            {"role": "user", "content": "Call me Ishmael. " * 40},
            {"role": "assistant", "content": "Fine."},
        ]
    }
    cut_answer = {
        "messages": [
            {"role": "user", "content": "What is it?"},
            {"role": "assistant", "content": "It is 42. " * 40},
        ]
    }
    rows = [_row(0), long_prompt, _row(2), cut_answer]
    path = write_jsonl(tmp_path / "prompt.jsonl", rows)
    for one_row in (False, True):
        config = _config(
            tokenizer,
            tmp_path,
            blend=([path], None),
            sequence_length=64,
            one_row_per_sample=one_row,
        )
        dataset = _build(path, config)[0]
        out = capsys.readouterr().out
        unit = "row" if one_row else "conversation"
        assert f"WARNING: 1 {unit}(s) of {path} (train split) keep no answer token" in out, out
        # Every sample trains at least one token; the reported count is what the samples train.
        trained = [int(dataset[i]["loss_mask"].sum()) for i in range(dataset.num_packs)]
        assert min(trained) > 0, trained
        reported = int(re.search(r"(\d+) answer tokens\)", out).group(1))
        assert reported == sum(trained), (reported, trained)
