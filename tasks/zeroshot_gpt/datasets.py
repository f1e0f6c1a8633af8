"""Zero-shot datasets, as in Megatron's tasks/zeroshot_gpt/datasets.py.

WikiText: one token stream cut into overlapping windows of seq_length + 1 tokens; window i starts
at token i * stride and scores only its last `stride` targets (window 0 scores all of its
targets), so every target 1..N-1 is scored exactly once.
LAMBADA: one JSON object per line; the target is the last BPE token (default) or, with
--strict-lambada, the whole last word.
"""

import json
import math
import os

import numpy as np
import torch

from megatron.training.utils import print_rank_0
from tasks.zeroshot_gpt.detokenizer import get_detokenizer


def num_windows(num_tokens: int, seq_len: int, stride: int) -> int:
    """Number of windows Megatron builds for num_tokens tokens (the last few may score nothing)."""
    targets = num_tokens - 1
    return max(math.ceil(max(targets - stride, 0) / stride) + 1, 1)


class LMDataset(torch.utils.data.Dataset):
    """Overlapping windows over one token stream; items {'text': [L+1], 'pad_mask': [L]}.

    Args:
        tokens: the token ids of the whole (detokenized) text.
        seq_len: L, the model's window.
        pad_idx: the id that pads the last windows (EOD).
        num_original_tokens: words of the raw file (for the adjusted perplexity).
        num_tokenized_tokens: len(tokens).
        overlapping_eval: the stride S (None: S = L; 0 becomes 1).
    """

    def __init__(
        self,
        tokens,
        seq_len,
        pad_idx,
        num_original_tokens,
        num_tokenized_tokens,
        overlapping_eval=None,
    ):
        self.tokens = tokens
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        stride = seq_len if overlapping_eval is None else overlapping_eval
        self.overlapping_eval = max(1, stride)
        self.num_original_tokens = num_original_tokens
        self.num_tokenized_tokens = num_tokenized_tokens
        self.total_sequences = num_windows(len(self.tokens), self.seq_len, self.overlapping_eval)

    def __len__(self):
        return self.total_sequences

    def __getitem__(self, idx):
        stride, width = self.overlapping_eval, self.seq_len + 1
        window = list(self.tokens[idx * stride : idx * stride + width])
        text = np.array(window + [self.pad_idx] * (width - len(window)))
        # One flag per target (the tokens after the first): 1 where a real token is predicted.
        pad_mask = np.zeros(self.seq_len, dtype=np.int64)
        pad_mask[: max(len(window) - 1, 0)] = 1
        if idx != 0 and stride != self.seq_len:
            # Earlier windows already scored all but the last `stride` targets.
            pad_mask[:-stride] = 0
        return {'text': text, 'pad_mask': pad_mask}


class LambadaDataset(torch.utils.data.Dataset):
    """LAMBADA passages; items {'text': [L+1] (context + target, EOD-padded), 'pad_mask': [L]}.

    Raises:
        ValueError: a line is not a JSON object with a 'text' string, or a passage does not fit
            in seq_len + 1 tokens (Megatron would fail while batching).
    """

    def __init__(self, path, pad_idx, tokenizer, seq_len, strict=False):
        print_rank_0('> building lambada dataset from {} ...'.format(path))
        self.seq_len = seq_len
        self.pad_idx = pad_idx
        self.tokenizer = tokenizer
        self.strict = strict
        self.tokens = []
        self.labels = []
        with open(path, 'r', encoding='utf-8') as f:
            for row, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                text = _lambada_text(path, row, line)
                tokens, labels = self.get_tokens(text)
                if not tokens:
                    # The first token is never predicted: with no context the target would
                    # count as correct whatever the model says.
                    raise ValueError(
                        f'{path}: row {row}: passage {text!r} has no context before its target; '
                        f'a LAMBADA passage needs at least one word before the last'
                    )
                if len(tokens) + len(labels) > seq_len + 1:
                    raise ValueError(
                        f'{path}: row {row}: passage has {len(tokens) + len(labels)} tokens, more '
                        f'than --seq-length + 1 = {seq_len + 1}'
                    )
                self.tokens.append(tokens)
                self.labels.append(labels)
        if not self.tokens:
            raise ValueError(f'{path}: no passages (an empty LAMBADA file)')

    def get_tokens(self, text):
        """(context ids, target ids): the last BPE token, or with strict the whole last word."""
        if self.strict:
            last_word = text.split()[-1]
            context = text[: text.rfind(last_word)].strip()
            return self.tokenizer.tokenize(context), self.tokenizer.tokenize(' ' + last_word)
        ids = self.tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, idx):
        context, target = self.tokens[idx], self.labels[idx]
        sequence = context + target
        padding = max(self.seq_len + 1 - len(sequence), 0)
        # Only the target positions are scored; the flags are aligned with the shifted labels.
        scored = [0] * len(context) + [1] * len(target) + [0] * padding
        return {
            'text': np.array(sequence + [self.pad_idx] * padding),
            'pad_mask': np.array(scored[1:]),
        }


def _lambada_text(path, row, line):
    """The 'text' of one JSON line, or a one-line ValueError naming file and row."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f'{path}: row {row}: not a JSON object ({exc.msg})') from None
    if not isinstance(obj, dict) or not isinstance(obj.get('text'), str) or not obj['text'].split():
        raise ValueError(f'{path}: row {row}: needs a non-empty "text" string')
    return obj['text']


def _build_lambada_dataset(args, tokenizer):
    """LAMBADA dataset of the one --valid-data file."""
    assert len(args.valid_data) == 1
    val_dataset = LambadaDataset(
        args.valid_data[0], tokenizer.eod, tokenizer, args.seq_length, args.strict_lambada
    )
    print_rank_0(' > found {} samples.'.format(len(val_dataset)))
    return val_dataset


def count_original_tokens(text: str) -> int:
    """Words of a raw WikiText file: pieces of a split on the single space (newlines stay)."""
    return len(text.strip().split(' '))


def _build_wikitext103_dataset(args, tokenizer):
    """Windows over the one --valid-data file, detokenized by the detokenizer its path selects."""
    assert len(args.valid_data) == 1
    path = args.valid_data[0]
    detokenizer = get_detokenizer(path)
    with open(path, 'rb') as reader:
        entire_data = reader.read().decode('utf-8')
    num_original_tokens = count_original_tokens(entire_data)
    entire_data = detokenizer(entire_data)
    tokenized_data = tokenizer.tokenize(entire_data)
    num_tokenized_tokens = len(tokenized_data)
    if num_tokenized_tokens < 2 or num_original_tokens < 2:
        # Perplexity averages over the tokens after the first (and rescales by the words).
        raise ValueError(
            f'--valid-data {path}: {num_original_tokens} word(s), {num_tokenized_tokens} '
            f'token(s); a perplexity needs at least 2 of each'
        )
    val_dataset = LMDataset(
        tokenized_data,
        args.seq_length,
        tokenizer.eod,
        num_original_tokens,
        num_tokenized_tokens,
        args.overlapping_eval,
    )
    print_rank_0(
        ' > number of original tokens: {}, number of detokenized tokens: {}'.format(
            num_original_tokens, num_tokenized_tokens
        )
    )
    return val_dataset


def build_dataset(task, args, tokenizer):
    """The evaluation dataset of a zero-shot task ('LAMBADA' or 'WIKITEXT103')."""
    if not args.valid_data or len(args.valid_data) != 1:
        raise ValueError(
            f'--task {task} needs exactly one --valid-data file, got {args.valid_data}'
        )
    if not os.path.isfile(args.valid_data[0]):
        raise ValueError(f'--valid-data {args.valid_data[0]}: no such file')
    if task == 'LAMBADA':
        return _build_lambada_dataset(args, tokenizer)
    if task == 'WIKITEXT103':
        return _build_wikitext103_dataset(args, tokenizer)
    raise ValueError(f'dataset for task {task} is not implemented')
