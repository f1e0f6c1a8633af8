"""Tiny Hugging Face chat tokenizers for the SFT tests, built in the test (no downloads): a
byte-level BPE trained with `tokenizers` on a few sentences, with special tokens and a chat
template, saved with save_pretrained so that SFTTokenizer loads it like a real one."""

import json
import os

#: A ChatML template (the shape of Qwen's / OpenAI's): each turn is
#: <|im_start|>role\ncontent<|im_end|>\n; the generation prompt is <|im_start|>assistant\n.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: A template with a BOS before everything and no generation prompt (Llama-2-like brackets).
BRACKETS = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "[ASSISTANT] {{ m['content'] }}{{ eos_token }}\n{% else %}[{{ m['role'] | upper }}] "
    "{{ m['content'] }}\n{% endif %}{% endfor %}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<pad>"]
NEMOTRON = ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>", "<unk>"]
FIM = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]

TRAINING_TEXT = [
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money",
    "in my purse, and nothing particular to interest me on shore, I thought I would sail about.",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition.",
    "What is the title of chapter 12? Which book is it from? Answer briefly, please. Thank you!",
    "system user assistant tool The answer is 42. def add(a, b): return a + b  # code\n\t\n",
    "Ünïcödé façade naïve café — “quotes” and émojis ✓ 東京",
]


def build_chat_tokenizer(
    directory, template=CHATML, vocab_size=400, extra_special=(), pad=True, bos=False
):
    """Save a tiny fast tokenizer with `template` as its chat template into `directory`.

    Args:
        directory: where to save (created).
        template: the Jinja chat template, or None for none.
        vocab_size: BPE vocabulary size (the 256 bytes + merges + special tokens).
        extra_special: more special tokens (e.g. NEMOTRON or FIM).
        pad: give it a pad token (<pad>); else it has none.
        bos: set bos_token <s> and eos_token </s> (else eos is <|im_end|>).

    Returns:
        the directory (str).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    kwargs = dict(tokenizer_object=tokenizer, unk_token=None)
    if bos:
        kwargs.update(bos_token="<s>", eos_token="</s>")
    else:
        kwargs.update(eos_token="<|im_end|>")
    if pad:
        kwargs["pad_token"] = "<pad>"
    if template is not None:
        kwargs["chat_template"] = template
    hf = PreTrainedTokenizerFast(**kwargs)
    os.makedirs(directory, exist_ok=True)
    hf.save_pretrained(str(directory))
    return str(directory)


def write_jsonl(path, rows):
    """Write rows (dicts, or raw strings written as they are) one per line."""
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)
