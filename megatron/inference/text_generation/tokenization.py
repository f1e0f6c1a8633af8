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


def token_strings(tokenizer, token_ids):
    """One string per token (Megatron's `segments`)."""
    byte_decoder = getattr(getattr(tokenizer, 'tokenizer', None), 'byte_decoder', None)
    return [_token_string(tokenizer, t, byte_decoder) for t in token_ids]


class UntokenizablePrompt(ValueError):
    """A prompt the tokenizer refuses (e.g. a lone surrogate): a bad request (HTTP 400), unlike
    Megatron's length errors, which its server answers with 200."""


def tokenize_batch(tokenizer, prompts, tokens_to_generate: int, add_BOS: bool):
    """Token rows of the prompts (EOD prepended with add_BOS: GPT tokenizers have no BOS) and
    their lengths; ValueError if a prompt yields no token (the loop needs one to start)."""
    eod = eod_id(tokenizer)
    rows = []
    for i, prompt in enumerate(prompts):
        try:
            ids = list(tokenizer.tokenize(prompt))
        except Exception as exc:  # a tokenizer refusing the text is the request's fault
            raise UntokenizablePrompt(
                f'prompts[{i}] cannot be tokenized by {type(tokenizer).__name__}: '
                f'{type(exc).__name__}: {exc}'
            ) from None
        if add_BOS:
            ids = [eod] + ids
        if not ids:
            raise ValueError(
                f'prompts[{i}] ({prompt!r}) has no tokens; give a non-empty prompt or add_BOS=true'
            )
        rows.append(ids)
    lengths = [len(ids) for ids in rows]
    width = max(lengths) + tokens_to_generate
    for ids in rows:
        ids.extend([eod] * (width - len(ids)))
    return rows, lengths


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
    for sequence_tokens, length in zip(tokens, lengths):
        sequence_tokens = sequence_tokens[:length]
        prompts_plus_generations.append(tokenizer.detokenize(sequence_tokens))
        if return_segments:
            prompts_plus_generations_segments.append(token_strings(tokenizer, sequence_tokens))

    if return_segments:
        return tokens, prompts_plus_generations, prompts_plus_generations_segments
    return tokens, prompts_plus_generations


def broadcast_batch(tokens=None, lengths=None, rank=0):
    """Broadcast the padded batch from global rank `rank` to every rank of the default group:
    its sizes [b, s], the tokens [b, s] and the prompt lengths [b] (all int64).

    Returns:
        (tokens [b, s], lengths [b]) on every rank.
    """
    sizes_list = None
    if torch.distributed.get_rank() == rank:
        sizes_list = [tokens.size(0), tokens.size(1)]  # batch size, sequence length
    sizes = broadcast_int_list(2, int_list=sizes_list, rank=rank).tolist()
    tokens = broadcast_tensor(sizes, torch.int64, tensor=tokens, rank=rank)
    lengths = broadcast_tensor(sizes[0], torch.int64, tensor=lengths, rank=rank)
    return tokens, lengths


def tokenize_prompts(prompts=None, tokens_to_generate=None, add_BOS=None, rank=0):
    """Tokenize and pad the prompts on `rank`, then broadcast them to every rank.

    Returns:
        (tokens [b, max_prompt_len + tokens_to_generate] int64, prompt lengths [b] int64).
    """
    tokens = lengths = None
    if torch.distributed.get_rank() == rank:
        assert prompts is not None
        assert tokens_to_generate is not None
        tokens, lengths = _tokenize_prompts_and_batch(prompts, tokens_to_generate, add_BOS)
    return broadcast_batch(tokens, lengths, rank=rank)


def _tokenize_prompts_and_batch(prompts, tokens_to_generate, add_BOS):
    """Tokenize the prompts (with add_BOS, the end-of-document id is prepended: GPT tokenizers
    have no BOS) and right-pad them with that id to max prompt length + tokens_to_generate, so a
    shorter prompt gets more than tokens_to_generate new tokens."""
    rows, lengths = tokenize_batch(get_tokenizer(), prompts, tokens_to_generate, add_BOS)
    device = get_current_device()
    prompts_tokens_tensor = torch.tensor(rows, dtype=torch.long, device=device)
    prompts_length_tensor = torch.tensor(lengths, dtype=torch.long, device=device)
    return prompts_tokens_tensor, prompts_length_tensor
