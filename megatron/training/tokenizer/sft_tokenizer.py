"""SFTTokenizer: a Hugging Face tokenizer that renders chat conversations in a prompt format and
says which tokens are the assistant's (the only ones trained).

`--tokenizer-type SFTTokenizer --tokenizer-model DIR --sft-tokenizer-prompt-format FORMAT`, with
later Megatron's four formats:

- `nemotron-h-aligned` (Megatron's default): system `<SPECIAL_10>System\\n{c}\\n`, user
  `<SPECIAL_11>User\\n{c}\\n<SPECIAL_11>Assistant\\n` (the assistant header is part of the user
  turn), assistant `{c}\\n`; contents stripped. Trained: each assistant turn.
- `nemotron-nano-v2`: `/think` and `/no_think` removed from system and user contents, system
  `<SPECIAL_10>System\\n{c}\\n`, user `<SPECIAL_11>User\\n{c}\\n`, assistant
  `<SPECIAL_11>Assistant\\n{c}\\n<SPECIAL_12>\\n`. Trained: the assistant turn after its header.
- `identity`: the raw contents concatenated. Trained: the assistant contents.
- `default`: the tokenizer's own chat template. Trained: each assistant turn from where the
  template's generation prompt ends to where the next turn starts (its content and the
  template's end-of-turn text, e.g. `<|im_end|>\\n`). Megatron trains every token of this
  format, prompts included; here the prompts are masked as in the other formats.

How the mask is found: the conversation is rendered to text once, with the character span of
each trained part known (by construction for the first three formats; for `default` from the
renders of the conversation's prefixes, which must be prefixes of the full render), then
tokenized once with character offsets; a token is trained when it holds a character of a trained
span (a token that merges a header's last space with the answer's first word is the answer's).
Unlike Megatron's per-turn re-rendering, this needs no turn-separable template and survives BPE
merges across turn boundaries. Tokens are those of the full render, as Megatron's.
"""

import re
from typing import List, Sequence, Tuple

import numpy

from megatron.training.tokenizer.hf_tokenizer import _HuggingFaceTokenizer

PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "identity", "default")

#: Ignored target, as Megatron's tokenize_conversation marks untrained tokens.
IGNORE_INDEX = -100

_NEEDED_TOKENS = {
    "nemotron-h-aligned": ("<SPECIAL_10>", "<SPECIAL_11>"),
    "nemotron-nano-v2": ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>"),
}
_PAD_TOKEN = {
    "nemotron-h-aligned": "<SPECIAL_233>",
    "nemotron-nano-v2": "<unk>",
    "identity": "<unk>",
}
_THINK = re.compile(r"/no_think|/think")


def _pieces_nemotron_h(conversation, add_generation_prompt):
    pieces = []
    for m in conversation:
        c = m["content"].strip()
        if m["role"] == "system":
            pieces.append((f"<SPECIAL_10>System\n{c}\n", False))
        elif m["role"] == "user":
            pieces.append((f"<SPECIAL_11>User\n{c}\n<SPECIAL_11>Assistant\n", False))
        else:
            pieces.append((f"{c}\n", True))
    return pieces


def _pieces_nemotron_nano(conversation, add_generation_prompt):
    pieces = []
    for m in conversation:
        if m["role"] == "system":
            pieces.append((f"<SPECIAL_10>System\n{_THINK.sub('', m['content']).strip()}\n", False))
        elif m["role"] == "user":
            pieces.append((f"<SPECIAL_11>User\n{_THINK.sub('', m['content']).strip()}\n", False))
        else:
            pieces.append(("<SPECIAL_11>Assistant\n", False))
            pieces.append((f"{m['content'].strip()}\n<SPECIAL_12>\n", True))
    if add_generation_prompt:
        pieces.append(("<SPECIAL_11>Assistant\n", False))
    return pieces


def _pieces_identity(conversation, add_generation_prompt):
    return [(m["content"], m["role"] == "assistant") for m in conversation]


class SFTTokenizer(_HuggingFaceTokenizer):
    """A local Hugging Face tokenizer plus a chat prompt format.

    Args:
        tokenizer_path: the tokenizer directory (--tokenizer-model); local files only.
        prompt_format: one of PROMPT_FORMATS (--sft-tokenizer-prompt-format).

    Raises:
        ValueError: an unknown format, a format this tokenizer cannot render (a nemotron format
            whose special tokens are not single tokens of the vocabulary, `default` without a
            chat template, or tool turns in a nemotron format), or a slow tokenizer (no
            character offsets).
    """

    def __init__(self, tokenizer_path: str, prompt_format: str = "nemotron-h-aligned"):
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(
                f"--sft-tokenizer-prompt-format {prompt_format!r} is not a prompt format; "
                f"choose one of {', '.join(PROMPT_FORMATS)}"
            )
        super().__init__(tokenizer_path)
        self.unique_identifiers["prompt_format"] = prompt_format
        self.prompt_format = prompt_format
        self.tokenizer_path = tokenizer_path
        if not getattr(self._tokenizer, "is_fast", False):
            raise ValueError(
                f"--tokenizer-model {tokenizer_path}: SFTTokenizer needs a fast tokenizer "
                "(tokenizer.json) for character offsets; this one is "
                f"{type(self._tokenizer).__name__}"
            )
        for token in _NEEDED_TOKENS.get(prompt_format, ()):
            if len(self._encode(token)) != 1:
                raise ValueError(
                    f"--sft-tokenizer-prompt-format {prompt_format} needs {token} as one token, "
                    f"but the tokenizer of --tokenizer-model {tokenizer_path} has no such token; "
                    "use --sft-tokenizer-prompt-format default (its own chat template) or identity"
                )
        if prompt_format == "default" and not getattr(self._tokenizer, "chat_template", None):
            raise ValueError(
                f"--sft-tokenizer-prompt-format default renders with the tokenizer's chat "
                f"template, but the tokenizer of --tokenizer-model {tokenizer_path} has none; "
                "add one (tokenizer_config.json / chat_template.jinja) or choose another format"
            )
        self._pad_id = self._find_pad_id()

    def _encode(self, text: str) -> List[int]:
        return self._tokenizer(text, add_special_tokens=False).input_ids

    def _find_pad_id(self) -> int:
        name = _PAD_TOKEN.get(self.prompt_format)
        if name is not None and name in self._vocab:
            return self._vocab[name]
        for candidate in (self._tokenizer.pad_token_id, self._tokenizer.eos_token_id):
            if candidate is not None:
                return candidate
        return 0

    @property
    def pad(self) -> int:
        """The id written into padding positions (the format's pad token when the vocabulary has
        it, else the tokenizer's pad, else its eos). Padding never carries loss, whatever id."""
        return self._pad_id

    def render(
        self, conversation: Sequence[dict], add_generation_prompt: bool = False
    ) -> Tuple[str, List[Tuple[int, int]]]:
        """The conversation as text, and the character spans of its trained parts.

        Raises:
            ValueError: a conversation this format cannot render (see the class docstring).
        """
        if self.prompt_format == "default":
            return self._render_with_template(conversation, add_generation_prompt)
        if self.prompt_format != "identity" and any(m["role"] == "tool" for m in conversation):
            raise ValueError(
                f"--sft-tokenizer-prompt-format {self.prompt_format} has no rendering for tool "
                "turns; use --sft-tokenizer-prompt-format default (the tokenizer's chat template)"
            )
        make = {
            "nemotron-h-aligned": _pieces_nemotron_h,
            "nemotron-nano-v2": _pieces_nemotron_nano,
            "identity": _pieces_identity,
        }[self.prompt_format]
        text, spans = "", []
        for piece, trained in make(conversation, add_generation_prompt):
            if trained:
                spans.append((len(text), len(text) + len(piece)))
            text += piece
        return text, spans

    def _template(self, messages, add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _render_with_template(self, conversation, add_generation_prompt):
        text = self._template(conversation, add_generation_prompt)
        try:
            bounds = self._turn_bounds_local(conversation, text)
        except Exception:  # the template refused a window or is not local: exact renders
            bounds = None
        if bounds is None:
            bounds = self._turn_bounds_exact(conversation, text)
        spans = []
        for k, (start, end, has_prompt) in bounds.items():
            content = conversation[k]["content"]
            if not has_prompt:
                # No generation prompt in this template: skip the assistant header up to the
                # content, when the content appears verbatim.
                found = text.find(content, start, end)
                if found < 0:
                    found = text.find(content.strip(), start, end)
                start = found if found >= 0 else start
            spans.append((start, end))
        return text, spans

    def _not_prefix_error(self):
        return ValueError(
            f"the chat template of --tokenizer-model {self.tokenizer_path} renders a "
            "conversation's earlier turns differently once later turns follow, so its "
            "assistant turns cannot be located (--sft-tokenizer-prompt-format default); "
            "use a template whose renders of a conversation's prefixes are prefixes"
        )

    def _turn_bounds_exact(self, conversation, text):
        """{assistant turn k: (start, end, template has a generation prompt)} from the renders of
        the conversation's prefixes (two renders of up to k messages per turn)."""
        bounds = {}
        for k, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            before = self._template(conversation[:k], True)
            after = self._template(conversation[: k + 1], False)
            if not (text.startswith(after) and after.startswith(before)):
                raise self._not_prefix_error()
            has_prompt = before != self._template(conversation[:k], False)
            bounds[k] = (len(before), len(after), has_prompt)
        return bounds

    def _turn_bounds_local(self, conversation, text):
        """The same bounds from renders of a few messages each (linear work): turn k's text is
        the difference between the renders of a short window ending before it and the window
        with it (the window keeps a leading system message and starts at the same parity, for
        templates that check roles alternate). None unless the pieces rebuild `text` exactly."""
        head = 1 if conversation and conversation[0]["role"] == "system" else 0
        position = len(self._template(conversation[:head], False)) if head else 0
        if not text.startswith(self._template(conversation[:head], False) if head else ""):
            return None
        bounds = {}
        for k in range(head, len(conversation)):
            first = max(head, k - 2 + ((k - head) % 2))
            window = conversation[:head] + conversation[first:k]
            base = self._template(window, False) if window else ""
            with_turn = self._template(window + [conversation[k]], False)
            if not with_turn.startswith(base):
                return None
            piece = with_turn[len(base) :]
            if not text.startswith(piece, position):
                return None
            if conversation[k]["role"] == "assistant":
                prompt = self._template(window, True) if window else ""
                if not prompt.startswith(base) or not with_turn.startswith(prompt):
                    return None
                bounds[k] = (
                    position + len(prompt) - len(base),
                    position + len(piece),
                    prompt != base,
                )
            position += len(piece)
        if position != len(self._template(conversation, False)):
            return None
        return bounds

    def tokenize_conversation(
        self,
        conversation: Sequence[dict],
        return_target: bool = True,
        add_generation_prompt: bool = False,
    ):
        """Token ids of a conversation (int64), and with return_target the targets: the token
        where it is trained, IGNORE_INDEX (-100) elsewhere (Megatron's convention)."""
        text, spans = self.render(conversation, add_generation_prompt)
        encoding = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = numpy.asarray(encoding["input_ids"], dtype=numpy.int64)
        if not return_target:
            return ids
        offsets = numpy.asarray(encoding["offset_mapping"], dtype=numpy.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], numpy.maximum(offsets[:, 1], offsets[:, 0] + 1)
        trained = numpy.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            trained |= (starts < hi) & (ends > lo)
        return ids, numpy.where(trained, ids, IGNORE_INDEX)
