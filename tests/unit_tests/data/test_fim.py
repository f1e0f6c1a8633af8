"""Fill-in-the-middle: every rewritten segment reassembles to the original text once the sentinels
are removed and the parts put back in order (PSM and SPM, whole documents and split fragments);
FIM and SPM frequencies match their rates; rate 0 is the identity; sentinels come from the
vocabulary by name; GPTFIMDataset samples depend on their index only."""

import json
import os

import numpy
import pytest
import torch

from tests.unit_tests.data.sft_utils import CHATML, FIM, build_chat_tokenizer

pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from megatron.training.tokenizer.tokenizer import _HuggingFaceTokenizer

    path = build_chat_tokenizer(tmp_path_factory.mktemp("fimtok") / "t", CHATML, extra_special=FIM)
    return _HuggingFaceTokenizer(path)


@pytest.fixture(scope="module")
def documents():
    """Paragraphs of Moby Dick (the bundled corpus), as texts."""
    with open(os.path.join(REPO, "data", "corpus", "mobydick.jsonl")) as f:
        chapters = [json.loads(line)["text"] for line in f][1:4]
    paragraphs = [p for c in chapters for p in c.split("\n\n") if len(p) > 40]
    return paragraphs[:60]


def _codec_and_ids(tok):
    from megatron.core.datasets.fim import FIMTokenIds
    from megatron.training.datasets.fim_dataset import _text_codec

    encode, decode = _text_codec(tok)
    v = tok.vocab
    ids = FIMTokenIds(
        v["<fim_prefix>"], v["<fim_middle>"], v["<fim_suffix>"], v["<fim_pad>"], v["<|endoftext|>"]
    )
    return encode, decode, ids


def _reassemble(segment, ids, decode):
    """Text of a rewritten piece: sentinels removed, parts back in prefix-middle-suffix order."""
    if not segment or segment[0] != ids.prefix:
        return decode(segment), None
    if segment[1] == ids.suffix:  # SPM: <PRE><SUF> suffix <MID> prefix middle (no boundary mark)
        mid = segment.index(ids.middle)
        suffix, rest = segment[2:mid], segment[mid + 1 :]
        return decode(rest) + decode(suffix), "spm"
    suf, mid = segment.index(ids.suffix), segment.index(ids.middle)
    prefix, suffix, middle = segment[1:suf], segment[suf + 1 : mid], segment[mid + 1 :]
    return decode(prefix) + decode(middle) + decode(suffix), "psm"


def _split(tokens, sep):
    out, cur = [], []
    for t in tokens:
        if t == sep:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out + [cur]


@pytest.mark.parametrize("spm_rate", [0.0, 1.0, 0.5])
def test_every_segment_reassembles(tok, documents, spm_rate):
    from megatron.core.datasets.fim import fim_transform

    encode, decode, ids = _codec_and_ids(tok)
    rng = numpy.random.default_rng(1)
    window = []
    for doc in documents[:20]:
        window += encode(doc) + [ids.eod]
    window += [ids.eod] + encode(documents[20])[:30]  # an empty document, then a partial one
    out = fim_transform(numpy.array(window), rng, ids, encode, decode, 1.0, spm_rate)
    original, rewritten = _split(window, ids.eod), _split(out.tolist(), ids.eod)
    assert len(rewritten) == len(original)  # every EOD kept, the empty document too
    layouts = []
    for before, after in zip(original, rewritten):
        text, layout = _reassemble(after, ids, decode)
        assert text == decode(before)
        if before:
            layouts.append(layout)
    # Every non-empty segment is rewritten (rate 1). PSM with an empty prefix has SPM's shape.
    assert None not in layouts and len(layouts) == 21
    if spm_rate == 1.0:
        assert set(layouts) == {"spm"}
    elif spm_rate == 0.0:
        assert layouts.count("psm") > 15
    else:
        assert set(layouts) == {"spm", "psm"}


def test_split_sample_fragments_reassemble_and_keep_split_tokens(tok, documents):
    from megatron.core.datasets.fim import fim_transform

    encode, decode, ids = _codec_and_ids(tok)
    dot = tok.vocab["."]
    window = []
    for doc in documents[:10]:
        window += encode(doc) + [ids.eod]
    out = fim_transform(
        numpy.array(window), numpy.random.default_rng(2), ids, encode, decode, 1.0, 0.5, dot, 1.0
    )
    for before, after in zip(_split(window, ids.eod), _split(out.tolist(), ids.eod)):
        if dot not in before:
            continue
        frags_before, frags_after = _split(before, dot), _split(after, dot)
        assert len(frags_before) == len(frags_after)  # every split token kept, in place
        for fb, fa in zip(frags_before, frags_after):
            assert _reassemble(fa, ids, decode)[0] == decode(fb)
            assert (fa[:1] == [ids.prefix]) == bool(fb)  # fragment rate 1: each non-empty one


def test_rates_rate_zero_and_no_prefix(tok):
    from megatron.core.datasets.fim import fim_transform

    encode, decode, ids = _codec_and_ids(tok)
    words = ["whale", "ship", "sea", "Ahab", "white", "harpoon", "deck", "storm"]
    rng = numpy.random.default_rng(3)
    window = []
    n = 3000
    for _ in range(n):
        window += encode(" ".join(rng.choice(words, size=rng.integers(2, 6)))) + [ids.eod]
    out = fim_transform(
        numpy.array(window), numpy.random.default_rng(4), ids, encode, decode, 0.3, 0.7
    )
    segments = _split(out.tolist(), ids.eod)[:-1]
    fim = [s for s in segments if s[:1] == [ids.prefix]]
    # Within the binomial 99 % interval (2.58 sigma).
    assert abs(len(fim) / n - 0.3) < 2.58 * (0.3 * 0.7 / n) ** 0.5
    # SPM looks like <PRE><SUF>...; so does PSM with an empty prefix (both cut points at 0),
    # which happens with probability 1 - (c / (c + 1))^2 for a text of c characters.
    looks_spm = [s[1] == ids.suffix for s in fim]
    chars = numpy.array([len(_reassemble(s, ids, decode)[0]) for s in fim])
    p = 0.7 + 0.3 * (1 - (chars / (chars + 1)) ** 2)
    assert abs(sum(looks_spm) - p.sum()) < 2.58 * (p * (1 - p)).sum() ** 0.5
    # Cut points uniform over characters: the prefix holds a third of the text on average.
    psm = [s for s in fim if s[1] != ids.suffix]
    shares = [
        len(decode(s[1 : s.index(ids.suffix)])) / len(_reassemble(s, ids, decode)[0]) for s in psm
    ]
    assert abs(numpy.mean(shares) - 1 / 3) < 0.05
    # Rate 0 is the identity (empty documents and all EODs kept).
    window = numpy.array(encode("a b") + [ids.eod, ids.eod] + encode("c"))
    same = fim_transform(window, numpy.random.default_rng(0), ids, encode, decode, 0.0, 0.5)
    assert same.tolist() == window.tolist()
    # A piece starting with the no-prefix string is left alone.
    kept = fim_transform(
        window, numpy.random.default_rng(0), ids, encode, decode, 1.0, 0.5, no_prefix="a"
    )
    assert kept.tolist()[:3] == window.tolist()[:3] and kept.tolist()[3] == ids.eod


def _indexed(tmp_path, tok, documents):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    encode = _codec_and_ids(tok)[0]
    prefix = str(tmp_path / "fim_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for doc in documents:
        ids = encode(doc) + [tok.vocab["<|endoftext|>"]]
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_fim_dataset_is_deterministic_by_index(tok, documents, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

    prefix = _indexed(tmp_path, tok, documents)

    def build(seed):
        config = GPTFIMDatasetConfig(
            random_seed=seed,
            sequence_length=64,
            blend=([prefix], None),
            split="1",
            tokenizer=tok,
            path_to_cache=str(tmp_path / "cache"),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            fim_rate=1.0,
            fim_spm_rate=0.5,
        )
        return BlendedMegatronDatasetBuilder(
            GPTFIMDataset, [40, None, None], lambda: True, config
        ).build()[0]

    a, b, other = build(1), build(1), build(2)
    forward = [a[i] for i in range(20)]
    for i in list(range(20))[::-1]:
        assert all(torch.equal(b[i][k], forward[i][k]) for k in forward[i])
    assert any(not torch.equal(other[i]["tokens"], forward[i]["tokens"]) for i in range(20))
    pad = tok.vocab["<fim_pad>"]
    for sample in forward:
        assert sample["tokens"].shape == (64,)
        assert (sample["tokens"] == tok.vocab["<fim_prefix>"]).any()
        assert (sample["loss_mask"][sample["labels"] == pad] == 0).all()


def test_sentinels_by_name_and_tokenizers_refused(tok, tmp_path, documents):
    from megatron.core.datasets.utils import Split
    from megatron.training.datasets.fim_dataset import (
        GPTFIMDataset,
        GPTFIMDatasetConfig,
        _text_codec,
    )
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    prefix = _indexed(tmp_path, tok, documents[:5])
    config = GPTFIMDatasetConfig(
        random_seed=1,
        sequence_length=32,
        blend=([prefix], None),
        split="1",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        fim_extra_tokens={
            "prefix": "<PRE>",
            "middle": "<fim_middle>",
            "suffix": "<fim_suffix>",
            "pad": "<fim_pad>",
            "eod": "<|endoftext|>",
        },
    )
    with pytest.raises(ValueError) as info:
        GPTFIMDataset(None, prefix, numpy.arange(5), None, Split.train, config)
    assert str(info.value) == (
        "--fim-prefix-token '<PRE>' is not a token of the vocabulary of --tokenizer-type "
        "HuggingFaceTokenizer; add it to the tokenizer (e.g. as a special token of the Hugging "
        "Face tokenizer) or name a token it has"
    )
    with pytest.raises(ValueError, match=r"^--fim-data needs a tokenizer whose text round trip"):
        _text_codec(_NullTokenizer(100))
    with pytest.raises(ValueError, match="fim_split_sample needs fim_fragment_rate"):
        GPTFIMDatasetConfig(
            random_seed=1,
            sequence_length=32,
            blend=([prefix], None),
            split="1",
            tokenizer=tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            fim_split_sample=".",
        )


def test_pad_equal_to_end_of_document_keeps_documents_apart(tok, documents, tmp_path):
    """A tokenizer whose pad id is the end-of-document id (pad = eos): at FIM rate 0 the samples
    equal plain GPT samples (no end-of-document token deleted, no document run into the next)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
    from megatron.training.tokenizer.tokenizer import _HuggingFaceTokenizer

    pad_is_eod = _HuggingFaceTokenizer(tok._tokenizer.name_or_path)
    pad_is_eod._tokenizer.pad_token = "<|endoftext|>"
    eod = pad_is_eod.vocab["<|endoftext|>"]
    assert pad_is_eod.pad == eod
    prefix = _indexed(tmp_path, tok, documents[:20])
    common = dict(
        random_seed=1,
        sequence_length=64,
        blend=([prefix], None),
        split="1",
        tokenizer=pad_is_eod,
        path_to_cache=str(tmp_path / "cache"),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )

    def build(cls, config):
        return BlendedMegatronDatasetBuilder(cls, [12, None, None], lambda: True, config).build()[0]

    plain = build(GPTDataset, GPTDatasetConfig(**common))
    identity = build(GPTFIMDataset, GPTFIMDatasetConfig(fim_rate=0.0, **common))
    windows = [plain._query_document_sample_shuffle_indices(i)[0] for i in range(12)]
    assert any((w == eod).any() for w in windows)
    for i in range(12):
        assert torch.equal(identity[i]["tokens"], plain[i]["tokens"]), i
        assert torch.equal(identity[i]["labels"], plain[i]["labels"]), i


def test_fim_sentinels_must_differ(tok, tmp_path, documents):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

    prefix = _indexed(tmp_path, tok, documents[:5])
    for names, message in (
        (
            {"prefix": "<fim_prefix>", "middle": "<fim_prefix>"},
            "--fim-prefix-token and --fim-middle-token name the same token",
        ),
        ({"pad": "<|endoftext|>"}, "--fim-pad-token and --fim-eod-token name the same token"),
    ):
        tokens = {
            "prefix": "<fim_prefix>",
            "middle": "<fim_middle>",
            "suffix": "<fim_suffix>",
            "pad": "<fim_pad>",
            "eod": "<|endoftext|>",
            **names,
        }
        config = GPTFIMDatasetConfig(
            random_seed=1,
            sequence_length=32,
            blend=([prefix], None),
            split="1",
            tokenizer=tok,
            path_to_cache=str(tmp_path / "cache"),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            fim_extra_tokens=tokens,
        )
        with pytest.raises(ValueError, match=message):
            BlendedMegatronDatasetBuilder(
                GPTFIMDataset, [4, None, None], lambda: True, config
            ).build()
