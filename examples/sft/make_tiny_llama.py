"""Write a tiny random Hugging Face Llama directory with a chat tokenizer (no downloads).

The stand-in for a released checkpoint in examples/sft/finetune_llama.sh: a byte-level BPE
tokenizer trained on the chat set with ChatML special tokens and chat template
(`<|im_start|>role\\ncontent<|im_end|>\\n`, eos `<|im_end|>`), and a randomly initialised
LlamaForCausalLM (grouped-query attention, RMSNorm, SwiGLU, RoPE, untied output layer), saved with
save_pretrained as model.safetensors + config.json + the tokenizer files:

    python examples/sft/make_tiny_llama.py --output /tmp/tiny-llama [--hidden-size 128]
"""

import argparse
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def _texts(chat_path):
    with open(chat_path, encoding="utf-8") as f:
        for line in f:
            for message in json.loads(line)["messages"]:
                yield message["role"] + "\n" + message["content"]


def build_tokenizer(chat_path, vocab_size):
    """A fast byte-level BPE tokenizer with the ChatML template, trained on the chat set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(chat_path), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        chat_template=CHATML,
    )


def build_model(vocab_size, hidden_size, num_layers, seed):
    """A random LlamaForCausalLM (heads of 32 channels, 2 key/value groups)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    heads = max(2, hidden_size // 32)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 8 * 8,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--chat-data", default=os.path.join(REPO, "data", "sft", "chat.jsonl"))
    parser.add_argument("--vocab-size", type=int, default=1024, help="model vocabulary rows")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    tokenizer = build_tokenizer(args.chat_data, args.vocab_size)
    if len(tokenizer) > args.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens > --vocab-size {args.vocab_size}"
        )
    model = build_model(args.vocab_size, args.hidden_size, args.num_layers, args.seed)
    os.makedirs(args.output, exist_ok=True)
    model.save_pretrained(args.output, safe_serialization=True)
    tokenizer.save_pretrained(args.output)
    print(
        f"wrote a random Llama ({sum(p.numel() for p in model.parameters())} parameters, "
        f"{len(tokenizer)} tokens) to {args.output}"
    )


if __name__ == "__main__":
    main()
