"""build_tokenizer: vocab padding and its printed line, every tokenizer type, and bad inputs."""

import json
import pathlib
import types

import pytest

from megatron.training.tokenizer import build_tokenizer
from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding

DATA = pathlib.Path(__file__).resolve().parents[3] / "data"
GPT2_VOCAB = str(DATA / "gpt2" / "gpt2-vocab.json")
GPT2_MERGES = str(DATA / "gpt2" / "gpt2-merges.txt")
BERT_VOCAB = str(DATA / "bert" / "bert-vocab.txt")


def _args(**kw):
    base = dict(
        vocab_file=None,
        merge_file=None,
        tokenizer_model=None,
        vocab_extra_ids=0,
        vocab_size=None,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        rank=0,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def _padded_by_counting(size, multiple):
    after = size
    while after % multiple != 0:
        after += 1
    return after


def _mobydick_lines(limit=3000):
    lines = []
    with open(DATA / "corpus" / "mobydick.jsonl", encoding="utf-8") as f:
        for line in f:
            lines += [s for s in json.loads(line)["text"].split("\n") if s.strip()]
            if len(lines) > limit:
                break
    return lines


@pytest.mark.parametrize("tp,divisible_by", [(1, 128), (2, 128), (4, 64), (8, 1)])
def test_gpt2_padded_vocab_line(capsys, tp, divisible_by):
    args = _args(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file=GPT2_VOCAB,
        merge_file=GPT2_MERGES,
        tensor_model_parallel_size=tp,
        make_vocab_size_divisible_by=divisible_by,
    )
    tok = build_tokenizer(args)
    expected = _padded_by_counting(50257, divisible_by * tp)
    assert tok.vocab_size == 50257 and tok.eod == 50256
    assert args.padded_vocab_size == expected
    out = capsys.readouterr().out
    assert "> building GPT2BPETokenizer tokenizer ..." in out
    assert (
        f" > padded vocab (size: 50257) with {expected - 50257} dummy tokens (new size: {expected})"
        in out
    )


def test_padding_is_silent_off_rank_zero(capsys):
    args = _args(rank=3, tensor_model_parallel_size=2)
    assert _vocab_size_with_padding(30524, args) == _padded_by_counting(30524, 256)
    assert capsys.readouterr().out == ""


def test_bert_special_ids_and_sentinels():
    tok = build_tokenizer(
        _args(tokenizer_type="BertWordPieceLowerCase", vocab_file=BERT_VOCAB, vocab_extra_ids=100)
    )
    assert (tok.cls, tok.sep, tok.mask, tok.pad) == (101, 102, 103, 0)
    # [BOS], [EOS] and 100 T5 sentinels are appended after the 30522 file entries.
    assert tok.vocab_size == 30522 + 2 + 100
    assert tok.inv_vocab[30522 + 2] == "<extra_id_0>"
    # T5 takes its sentinels from additional_special_tokens_ids, <extra_id_0> first (ascending).
    assert (tok.bos, tok.eos) == (30522, 30523)
    assert tok.additional_special_tokens == [f"<extra_id_{i}>" for i in range(100)]
    assert tok.additional_special_tokens_ids == list(range(30524, 30624))
    no_extra = build_tokenizer(_args(tokenizer_type="BertWordPieceCase", vocab_file=BERT_VOCAB))
    assert no_extra.additional_special_tokens_ids == [] and no_extra.vocab_size == 30524
    assert tok.detokenize(tok.tokenize("Call me Ishmael.")) == "call me ishmael."


def test_null_tokenizer():
    args = _args(tokenizer_type="NullTokenizer", vocab_size=1000)
    tok = build_tokenizer(args)
    assert tok.tokenize("5 17 999") == [5, 17, 999]
    assert tok.detokenize([5, 17]) == "5 17"
    assert tok.eod == 1000 and tok.vocab_size == 1001
    assert (tok.cls, tok.sep, tok.mask) == (-1, -1, -1)
    assert args.padded_vocab_size == 1024


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    prefix = str(tmp_path_factory.mktemp("sp") / "tiny")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_mobydick_lines()),
        model_prefix=prefix,
        vocab_size=256,
        model_type="bpe",
        character_coverage=1.0,
        pad_id=3,
        minloglevel=2,
    )
    return prefix + ".model"


def test_gpt_sentencepiece_round_trip(sp_model):
    import sentencepiece

    ref = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer(
        _args(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    )
    assert tok.vocab_size == 256 and tok.eod == ref.eos_id() and tok.pad == 3
    # Unlike SentencePieceTokenizer, the GPT variant adds no BERT special tokens.
    assert (tok.cls, tok.sep, tok.mask) == (-1, -1, -1)
    for line in _mobydick_lines(200)[:200]:
        ids = tok.tokenize(line)
        assert ids == ref.encode_as_ids(line)
        assert tok.detokenize(ids) == ref.decode_ids(ids)


def test_sentencepiece_tokenizer_specials(sp_model):
    import sentencepiece

    ref = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer(
        _args(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model, vocab_extra_ids=3)
    )
    # <CLS> <SEP> <EOD> <MASK> and 3 sentinels are added; pad/bos/eos exist in the model.
    assert tok.vocab_size == 256 + 4 + 3
    assert [tok.cls, tok.sep, tok.eod, tok.mask] == [256, 257, 258, 259]
    assert (tok.pad, tok.bos, tok.eos) == (3, ref.bos_id(), ref.eos_id())
    assert tok.additional_special_tokens_ids == [260, 261, 262]
    text = "Call me Ishmael.<SEP>Some years ago<EOD>"
    ids = tok.tokenize(text)
    assert ids == ref.encode_as_ids("Call me Ishmael.") + [257] + ref.encode_as_ids(
        "Some years ago"
    ) + [258]
    assert tok.detokenize(ids) == "Call me Ishmael. <SEP> Some years ago <EOD> "
    for line in _mobydick_lines(100)[:100]:
        assert tok.detokenize(tok.tokenize(line)) == ref.decode_ids(ref.encode_as_ids(line))


def test_huggingface_tokenizer_from_local_files(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.train_from_iterator(
        _mobydick_lines(1000),
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=hf, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(str(tmp_path))
    args = _args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    tok = build_tokenizer(args)
    assert tok.vocab_size == hf.get_vocab_size()
    assert tok.eod == hf.token_to_id("<eos>")
    line = "Call me Ishmael. Some years ago"
    assert tok.tokenize(line) == hf.encode(line).ids
    assert args.padded_vocab_size == _padded_by_counting(hf.get_vocab_size(), 128)
    with pytest.raises(FileNotFoundError, match="local files only"):
        build_tokenizer(
            _args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "nope"))
        )


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (
            dict(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file="/nonexistent/vocab.json",
                merge_file=GPT2_MERGES,
            ),
            FileNotFoundError,
            r"--vocab-file: no such file: /nonexistent/vocab.json",
        ),
        (
            dict(tokenizer_type="GPT2BPETokenizer", vocab_file=GPT2_VOCAB),
            ValueError,
            r"--merge-file is required for --tokenizer-type GPT2BPETokenizer",
        ),
        (dict(tokenizer_type="BertWordPieceCase"), ValueError, r"--vocab-file is required"),
        (
            dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nonexistent.model"),
            FileNotFoundError,
            r"--tokenizer-model: no such file",
        ),
        (dict(tokenizer_type="NullTokenizer"), ValueError, r"--vocab-size is required"),
        (
            dict(tokenizer_type="Unknown"),
            ValueError,
            r"--tokenizer-type Unknown is not implemented",
        ),
    ],
)
def test_bad_tokenizer_arguments(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        build_tokenizer(_args(**kwargs))
    assert "\n" not in str(info.value)


def test_llama2_tokenizer_adds_bos(sp_model):
    import sentencepiece

    ref = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer(_args(tokenizer_type="Llama2Tokenizer", tokenizer_model=sp_model))
    ids = tok.tokenize("Call me Ishmael.")
    assert ids == [ref.bos_id()] + ref.encode_as_ids("Call me Ishmael.")
    assert tok.tokenize("Call me", bos=False, eos=True) == ref.encode_as_ids("Call me") + [
        ref.eos_id()
    ]
    assert tok.eod == ref.eos_id() and tok.vocab_size == 256
    assert (tok.cls, tok.sep, tok.mask) == (-1, -1, -1)
    assert tok.detokenize(ids[1:]) == "Call me Ishmael."
