"""Chat prompts rendered with a Hugging Face tokenizer's chat template (a tiny word-level
tokenizer built here and saved with save_pretrained), and the errors for tokenizers without
one."""

import pytest

from megatron.training.tokenizer.chat_template import (
    apply_chat_template,
    chat_prompt_token_ids,
    get_chat_template,
)
from megatron.training.tokenizer.tokenizer import _HuggingFaceTokenizer, _NullTokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _save_tokenizer(path, template):
    words = [
        "<s>",
        "</s>",
        "<unk>",
        "<user>",
        "<assistant>",
        "<system>",
        "hi",
        "there",
        "be",
        "brief",
    ]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)


def test_chat_template_renders_messages(tmp_path):
    tokenizer = _HuggingFaceTokenizer(_save_tokenizer(tmp_path / "chat", TEMPLATE))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert get_chat_template(tokenizer) == TEMPLATE
    text = apply_chat_template(tokenizer, messages)
    assert text == "<s><system> be brief <user> hi there <assistant>"
    assert apply_chat_template(tokenizer, messages, add_generation_prompt=False).endswith("there ")
    assert chat_prompt_token_ids(tokenizer, messages) == [0, 5, 8, 9, 3, 6, 7, 4]

    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a string"):
        apply_chat_template(tokenizer, [messages[0], {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="non-empty list"):
        apply_chat_template(tokenizer, [])


def test_chat_messages_follow_the_sft_rules_and_are_bounded(tmp_path):
    """Unknown roles and null contents are refused (as --sft refuses them in its data), and a
    request holds at most MAX_MESSAGES messages."""
    from megatron.training.tokenizer.chat_template import MAX_MESSAGES

    tokenizer = _HuggingFaceTokenizer(_save_tokenizer(tmp_path / "chat", TEMPLATE))
    with pytest.raises(ValueError, match=r"messages\[0\] has unknown role 'bot'; roles are "):
        apply_chat_template(tokenizer, [{"role": "bot", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a string"):
        apply_chat_template(tokenizer, [messages_ok(), {"role": "assistant", "content": None}])
    many = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    with pytest.raises(ValueError, match=rf"holds {MAX_MESSAGES + 1} messages, at most"):
        apply_chat_template(tokenizer, many)
    assert apply_chat_template(tokenizer, many[:MAX_MESSAGES]).startswith("<s><user> hi")


def messages_ok():
    return {"role": "user", "content": "hi"}


def test_tokenizers_without_a_template_are_refused(tmp_path):
    plain = _HuggingFaceTokenizer(_save_tokenizer(tmp_path / "plain", None))
    for tokenizer in (plain, _NullTokenizer(10)):
        assert get_chat_template(tokenizer) is None
        with pytest.raises(ValueError, match="has no chat template"):
            apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])


def test_template_errors_become_value_errors(tmp_path):
    strict = TEMPLATE.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages') }}{% endif %}",
    )
    tokenizer = _HuggingFaceTokenizer(_save_tokenizer(tmp_path / "strict", strict))
    with pytest.raises(ValueError, match="the chat template rejected the messages: no system"):
        apply_chat_template(tokenizer, [{"role": "system", "content": "x"}])


def test_sft_tokenizer_renders_with_its_prompt_format(tmp_path):
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer

    tokenizer = SFTTokenizer(_save_tokenizer(tmp_path / "sft", None), prompt_format="identity")
    messages = [{"role": "user", "content": "hi "}, {"role": "assistant", "content": "there"}]
    text, _ = tokenizer.render(messages, add_generation_prompt=True)
    assert apply_chat_template(tokenizer, messages) == text == "hi there"
    # The prompt's tokens are those fine-tuning saw for the conversation.
    trained = tokenizer.tokenize_conversation(messages, False, add_generation_prompt=True)
    assert (
        chat_prompt_token_ids(tokenizer, messages) == trained.tolist() == tokenizer.tokenize(text)
    )

    # `default`: the tokenizer's own template is the prompt format.
    templated = SFTTokenizer(_save_tokenizer(tmp_path / "sft_t", TEMPLATE), prompt_format="default")
    chat = [{"role": "user", "content": "hi there"}]
    assert apply_chat_template(templated, chat) == "<s><user> hi there <assistant>"
    assert chat_prompt_token_ids(templated, chat) == [0, 3, 6, 7, 4]
