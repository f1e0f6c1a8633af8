"""The SFT loss mask is 1 exactly on assistant tokens, for every prompt format, checked against an
independent oracle: the conversation rendered here (or by the tokenizer's own chat template), the
assistant spans found in the text by pattern, and the tokens mapped to characters with the
tokenizer's offsets. A token is an assistant token when it holds a character of an assistant span.

Shapes: single turn, system prompt with several turns, several conversations in one row, messages
before the first system message, tool turns, unicode and whitespace-heavy contents.
"""

import re

import numpy
import pytest
import torch

from tests.unit_tests.data.sft_utils import (
    BRACKETS,
    CHATML,
    NEMOTRON,
    build_chat_tokenizer,
    write_jsonl,
)

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def _m(role, content):
    return {"role": role, "content": content}


ROWS = {
    "single": [_m("user", "What is 6*7?"), _m("assistant", "The answer is 42.")],
    "multi_turn": [
        _m("system", "Answer briefly, please."),
        _m("user", "Which book is it from?"),
        _m("assistant", "Moby Dick."),
        _m("user", "And the chapter?"),
        _m("assistant", "Chapter 12, Biographical."),
        _m("user", "Thank you!"),
        _m("assistant", "You are welcome."),
    ],
    "two_conversations": [
        _m("system", "You are a librarian."),
        _m("user", "Who wrote Emma?"),
        _m("assistant", "Jane Austen."),
        _m("system", "You answer in one word."),
        _m("user", "Capital of Japan?"),
        _m("assistant", "東京"),
        _m("user", "And the sea?"),
        _m("assistant", "Pacific"),
    ],
    "before_system": [
        _m("user", "hello"),
        _m("assistant", "hi there"),
        _m("system", "Be brief."),
        _m("user", "def add(a, b):"),
        _m("assistant", "    return a + b  # code\n"),
    ],
    "unicode_whitespace": [
        _m("user", "  Ünïcödé façade \n\n\t naïve café?  "),
        _m("assistant", "\n  “quotes” — and émojis ✓ \t\n"),
    ],
}
TOOL_ROW = [
    _m("user", "What is 6*7?"),
    _m("assistant", "Let me compute."),
    _m("tool", "42"),
    _m("assistant", "It is 42."),
]


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_tok")
    return {
        "chatml": build_chat_tokenizer(root / "chatml", CHATML, extra_special=NEMOTRON),
        "brackets": build_chat_tokenizer(root / "brackets", BRACKETS, bos=True, pad=False),
    }


def _sft_tokenizer(path, fmt):
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer

    return SFTTokenizer(path, fmt)


# ---- the oracle: text and assistant spans, written independently of SFTTokenizer -------------


def _oracle_text(fmt, hf, conversation):
    """The rendered text of a conversation and its assistant character spans."""
    if fmt == "default":
        text = hf.apply_chat_template(conversation, tokenize=False)
        if "<|im_start|>" in text:
            pattern = r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n)"
        else:
            pattern = r"\[ASSISTANT\] (.*?</s>\n)"
        return text, [m.span(1) for m in re.finditer(pattern, text, flags=re.S)]
    if fmt == "identity":
        text, spans = "", []
        for m in conversation:
            if m["role"] == "assistant":
                spans.append((len(text), len(text) + len(m["content"])))
            text += m["content"]
        return text, spans
    text = ""
    for m in conversation:
        c = m["content"]
        if fmt == "nemotron-nano-v2" and m["role"] != "assistant":
            c = c.replace("/no_think", "").replace("/think", "")
        c = c.strip()
        if m["role"] == "system":
            text += "<SPECIAL_10>System\n" + c + "\n"
        elif m["role"] == "user":
            text += "<SPECIAL_11>User\n" + c + "\n"
            if fmt == "nemotron-h-aligned":
                text += "<SPECIAL_11>Assistant\n"
        elif fmt == "nemotron-h-aligned":
            text += c + "\n"
        else:
            text += "<SPECIAL_11>Assistant\n" + c + "\n<SPECIAL_12>\n"
    if fmt == "nemotron-h-aligned":
        pattern = r"<SPECIAL_11>Assistant\n(.*?\n)(?=<SPECIAL_1|$)"
    else:
        pattern = r"<SPECIAL_11>Assistant\n(.*?\n<SPECIAL_12>\n)"
    return text, [m.span(1) for m in re.finditer(pattern, text, flags=re.S)]


def _oracle(fmt, hf, conversation):
    """(token ids, assistant bool per token) from the oracle's text and spans."""
    text, spans = _oracle_text(fmt, hf, conversation)
    assert len(spans) == sum(m["role"] == "assistant" for m in conversation)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assistant = [
        any(s < hi and max(e, s + 1) > lo for lo, hi in spans) for s, e in enc["offset_mapping"]
    ]
    return numpy.array(enc["input_ids"]), numpy.array(assistant)


FORMATS = [
    ("chatml", "default"),
    ("brackets", "default"),
    ("chatml", "nemotron-h-aligned"),
    ("chatml", "nemotron-nano-v2"),
    ("chatml", "identity"),
]


@pytest.mark.parametrize("tok,fmt", FORMATS)
def test_targets_are_exactly_the_assistant_tokens(tokenizer_dirs, tok, fmt):
    from megatron.core.datasets.sft_packing import split_conversations

    tokenizer = _sft_tokenizer(tokenizer_dirs[tok], fmt)
    hf = tokenizer._tokenizer
    rows = dict(ROWS)
    if fmt in ("default", "identity"):
        rows["tool"] = TOOL_ROW
    for name, messages in rows.items():
        for conversation in split_conversations(messages):
            ids, targets = tokenizer.tokenize_conversation(conversation)
            expected_ids, assistant = _oracle(fmt, hf, conversation)
            numpy.testing.assert_array_equal(ids, expected_ids, err_msg=name)
            assert assistant.any() and not assistant.all(), name
            numpy.testing.assert_array_equal(targets != -100, assistant, err_msg=f"{fmt} {name}")
            numpy.testing.assert_array_equal(targets[assistant], ids[assistant])


def test_default_format_matches_apply_chat_template(tokenizer_dirs):
    """Tokens of the `default` format are exactly HF apply_chat_template's (Megatron's tokens)."""
    tokenizer = _sft_tokenizer(tokenizer_dirs["chatml"], "default")
    conversation = ROWS["multi_turn"]
    expected = tokenizer._tokenizer.apply_chat_template(conversation, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    ids = tokenizer.tokenize_conversation(conversation, return_target=False)
    assert ids.tolist() == list(expected)


def test_dataset_loss_mask_on_assistant_tokens_only(tokenizer_dirs, tmp_path):
    """Through SFTDataset (packing across rows and Megatron's one row per sample): loss_mask[i]
    is 1 exactly where labels[i] is an assistant token of tokens[i]'s own conversation."""
    from megatron.core.datasets.sft_packing import split_conversations
    from megatron.core.datasets.utils import Split
    from megatron.training.datasets.sft_dataset import SFTDataset, SFTDatasetConfig

    tokenizer = _sft_tokenizer(tokenizer_dirs["chatml"], "default")
    rows = [{"messages": m} for m in ROWS.values()] + [{"messages": TOOL_ROW, "id": 7}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    conversations = [c for r in rows for c in split_conversations(r["messages"])]
    oracle = {
        tuple(_oracle("default", tokenizer._tokenizer, c)[0].tolist()): c for c in conversations
    }
    for one_row in (False, True):
        config = SFTDatasetConfig(
            random_seed=1,
            sequence_length=128,
            blend=([path], None),
            split="1",
            tokenizer=tokenizer,
            one_row_per_sample=one_row,
            path_to_cache=str(tmp_path / f"cache{one_row}"),
        )
        low = SFTDataset.build_low_level_dataset(path, config)
        dataset = SFTDataset(low, path, numpy.arange(len(low)), None, Split.train, config)
        seen = 0
        for i in range(len(dataset)):
            sample = dataset[i]
            cu = sample["cu_seqlens"].tolist()
            bounds = sorted(set(cu))
            expected_mask = torch.zeros(128)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                ids = sample["tokens"][lo:hi].tolist()
                # The segment is a conversation (+ the pad tail on the last one).
                key = max((k for k in oracle if list(k[: len(ids)]) == ids[: len(k)]), key=len)
                _, assistant = _oracle("default", tokenizer._tokenizer, oracle[key])
                n = min(len(key), 129 - lo)  # the pack holds 129 tokens; labels are pack[1:]
                expected_mask[lo : lo + n - 1] = torch.from_numpy(assistant[1:n].astype("float32"))
                assert sample["position_ids"][lo:hi].tolist()[: n - 1] == list(range(n - 1))
                seen += 1
            torch.testing.assert_close(sample["loss_mask"], expected_mask, rtol=0, atol=0)
            assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
        assert seen == len(conversations)


@pytest.mark.parametrize("tok", ["chatml", "brackets"])
def test_default_format_work_is_linear_in_the_conversation(tokenizer_dirs, tok):
    """The `default` format's turn bounds come from renders of a few messages each (the same
    bounds as rendering every prefix), so a long conversation renders O(n) characters."""
    from megatron.core.datasets.sft_packing import split_conversations

    tokenizer = _sft_tokenizer(tokenizer_dirs[tok], "default")
    for messages in list(ROWS.values()) + [TOOL_ROW]:
        for conversation in split_conversations(messages):
            text = tokenizer._template(conversation, False)
            local = tokenizer._turn_bounds_local(conversation, text)
            assert local == tokenizer._turn_bounds_exact(conversation, text), conversation
    long = [_m("system", "Answer briefly.")]
    for i in range(300):
        long += [_m("user", f"What is {i} plus 1?"), _m("assistant", f"It is {i + 1}.")]
    rendered = []
    template = tokenizer._template
    tokenizer._template = lambda m, g: rendered.append(len(template(m, g))) or template(m, g)
    try:
        text, spans = tokenizer.render(long)
    finally:
        del tokenizer._template
    assert len(spans) == 300
    assert sum(rendered) < 12 * len(text), (sum(rendered), len(text))
