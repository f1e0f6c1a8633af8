"""Chat prompts: OpenAI-style messages rendered with the tokenizer's own chat template.

Hugging Face tokenizers (`--tokenizer-type HuggingFaceTokenizer`) carry a chat template (the
`chat_template` of their tokenizer_config.json); an `SFTTokenizer` renders with its
`--sft-tokenizer-prompt-format` (the format the model was fine-tuned with). For every other
tokenizer, or one without a template, `ValueError` says so (a server answers it with HTTP 400).
"""

from typing import List, Optional

from megatron.core.datasets.sft_packing import ROLES


def get_chat_template(tokenizer) -> Optional[str]:
    """The tokenizer's chat template (Jinja source), or None."""
    hf_tokenizer = getattr(tokenizer, "_tokenizer", None)
    return getattr(hf_tokenizer, "chat_template", None) or None


#: Most messages one chat request may hold (rendering is linear, but a request is bounded).
MAX_MESSAGES = 1024


def _check_messages(messages) -> None:
    """The rules `--sft` applies to its data: known roles and string contents."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    if len(messages) > MAX_MESSAGES:
        raise ValueError(f"messages holds {len(messages)} messages, at most {MAX_MESSAGES}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        if message["role"] not in ROLES:
            raise ValueError(
                f"messages[{i}] has unknown role {message['role']!r:.40}; roles are "
                f"{', '.join(ROLES)}"
            )
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string")


def _is_sft_tokenizer(tokenizer) -> bool:
    """An SFTTokenizer: its prompt format (`default` included: the template) is the chat
    format the model was fine-tuned with."""
    return getattr(tokenizer, "prompt_format", None) is not None and hasattr(
        tokenizer, "tokenize_conversation"
    )


def _render(tokenizer, messages, add_generation_prompt, tokenize, template_kwargs):
    _check_messages(messages)
    if _is_sft_tokenizer(tokenizer):
        if tokenize:
            # Exactly the tokens fine-tuning saw for this conversation (no special tokens added).
            return [
                int(t)
                for t in tokenizer.tokenize_conversation(
                    messages, return_target=False, add_generation_prompt=add_generation_prompt
                )
            ]
        text, _ = tokenizer.render(messages, add_generation_prompt=add_generation_prompt)
        return text
    if get_chat_template(tokenizer) is None:
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__.lstrip('_')}) has no chat template: chat "
            "requests need --tokenizer-type HuggingFaceTokenizer with a tokenizer whose "
            "tokenizer_config.json defines chat_template"
        )
    try:
        return tokenizer._tokenizer.apply_chat_template(
            messages,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # the template's own checks (e.g. roles must alternate)
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc


def apply_chat_template(
    tokenizer, messages: List[dict], add_generation_prompt: bool = True, template_kwargs=None
) -> str:
    """The prompt text of `messages` (with the assistant's turn opened when
    add_generation_prompt)."""
    return _render(tokenizer, messages, add_generation_prompt, False, template_kwargs)


def chat_prompt_token_ids(
    tokenizer, messages: List[dict], add_generation_prompt: bool = True, template_kwargs=None
) -> List[int]:
    """The prompt's token ids, tokenized by the template itself (no second BOS, as tokenizing
    the rendered text again could add)."""
    ids = _render(tokenizer, messages, add_generation_prompt, True, template_kwargs)
    if not isinstance(ids, list):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
