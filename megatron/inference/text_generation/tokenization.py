"""Prompt tokenization and batching, and detokenization of the generated rows.

Rank 0 tokenizes the prompts and right-pads every row with the end-of-document id to the longest
prompt plus `tokens_to_generate` columns; the sizes, the token matrix [b, s] and the prompt
lengths [b] are then broadcast (int64) over the default group, so every rank holds the batch.
"""

import torch

from megatron.core.utils import get_current_device
from megatron.inference.text_generation.communication import (
    broadcast_int_list,
    broadcast_tensor,
)
from megatron.training.global_vars import get_tokenizer
from megatron.training.tokenizer.tokenizer import (
    _HuggingFaceTokenizer,
    _NullTokenizer,
    _SentencePieceTokenizer,
)


def eod_id(tokenizer):
    """The end-of-document id of `tokenizer` (`eod`, else `eos_id`)."""
    if hasattr(tokenizer, 'eod'):
        return tokenizer.eod
    if hasattr(tokenizer, 'eos_id'):
        return tokenizer.eos_id
    raise AttributeError('No eod token found in Tokenizer')


def _token_string(tokenizer, token_id, byte_decoder):
    """One token's text, as Megatron's detokenize_generations renders a segment: the vocabulary
    entry for SentencePiece and Hugging Face tokenizers, the id for the null tokenizer, and the
    byte-decoded BPE string (invalid UTF-8 replaced) for GPT-2 BPE."""
    if isinstance(tokenizer, (_SentencePieceTokenizer, _HuggingFaceTokenizer)):
        return tokenizer.decoder[token_id]
    if isinstance(tokenizer, _NullTokenizer):
        return str(token_id)
    word = tokenizer.tokenizer.decoder[token_id]
    return bytearray([byte_decoder[c] for c in word]).decode('utf-8', errors='replace')


def detokenize_generations(tokens_gpu_tensor, lengths_gpu_tensor, return_segments):
    """Cut each row to its length and detokenize it.

    Returns:
        (tokens as lists, texts, and with return_segments one string per token of each row).
    """
    tokenizer = get_tokenizer()
    prompts_plus_generations = []
    prompts_plus_generations_segments = []

    tokens = tokens_gpu_tensor.cpu().numpy().tolist()
    lengths = lengths_gpu_tensor.cpu().numpy().tolist()
    byte_decoder = getattr(getattr(tokenizer, 'tokenizer', None), 'byte_decoder', None)
    for sequence_tokens, length in zip(tokens, lengths):
        sequence_tokens = sequence_tokens[:length]
        prompts_plus_generations.append(tokenizer.detokenize(sequence_tokens))
        if return_segments:
            words = [_token_string(tokenizer, t, byte_decoder) for t in sequence_tokens]
            prompts_plus_generations_segments.append(words)

    if return_segments:
        return tokens, prompts_plus_generations, prompts_plus_generations_segments
    return tokens, prompts_plus_generations


def tokenize_prompts(prompts=None, tokens_to_generate=None, add_BOS=None, rank=0):
    """Tokenize and pad the prompts on `rank`, then broadcast them to every rank.

    Returns:
        (tokens [b, max_prompt_len + tokens_to_generate] int64, prompt lengths [b] int64).
    """
    # Only `rank` holds the prompts; the others learn the sizes first, then receive the data.
    prompts_tokens_cuda_long_tensor = None
    prompts_length_cuda_long_tensor = None
    sizes_list = None
    if torch.distributed.get_rank() == rank:
        assert prompts is not None
        assert tokens_to_generate is not None
        prompts_tokens_cuda_long_tensor, prompts_length_cuda_long_tensor = (
            _tokenize_prompts_and_batch(prompts, tokens_to_generate, add_BOS)
        )
        sizes_list = [
            prompts_tokens_cuda_long_tensor.size(0),  # batch size
            prompts_tokens_cuda_long_tensor.size(1),  # sequence length
        ]

    sizes_tensor = broadcast_int_list(2, int_list=sizes_list, rank=rank)
    sizes = sizes_tensor.tolist()
    prompts_tokens_cuda_long_tensor = broadcast_tensor(
        sizes, torch.int64, tensor=prompts_tokens_cuda_long_tensor, rank=rank
    )
    prompts_length_cuda_long_tensor = broadcast_tensor(
        sizes[0], torch.int64, tensor=prompts_length_cuda_long_tensor, rank=rank
    )
    return prompts_tokens_cuda_long_tensor, prompts_length_cuda_long_tensor


def _tokenize_prompts_and_batch(prompts, tokens_to_generate, add_BOS):
    """Tokenize the prompts (with add_BOS, the end-of-document id is prepended: GPT tokenizers
    have no BOS) and right-pad them with that id to max prompt length + tokens_to_generate, so a
    shorter prompt gets more than tokens_to_generate new tokens."""
    tokenizer = get_tokenizer()
    eod = eod_id(tokenizer)
    if add_BOS:
        prompts_tokens = [[eod] + tokenizer.tokenize(prompt) for prompt in prompts]
    else:
        prompts_tokens = [tokenizer.tokenize(prompt) for prompt in prompts]

    prompts_length = [len(prompt_tokens) for prompt_tokens in prompts_tokens]
    max_prompt_len = max(prompts_length)
    samples_length = max_prompt_len + tokens_to_generate
    for prompt_tokens, prompt_length in zip(prompts_tokens, prompts_length):
        padding_size = samples_length - prompt_length
        prompt_tokens.extend([eod] * padding_size)

    device = get_current_device()
    prompts_tokens_tensor = torch.tensor(prompts_tokens, dtype=torch.long, device=device)
    prompts_length_tensor = torch.tensor(prompts_length, dtype=torch.long, device=device)
    return prompts_tokens_tensor, prompts_length_tensor
