"""One generation request: its settings, their numeric checks, and the rank-0 preparation.

A request is everything global rank 0 broadcasts before the ranks run a generation loop together:
the `GenerationSettings` (sampling or beam search) and the tokenized prompts. Whatever can fail
because of the request's values is checked here, on rank 0 and before anything is broadcast:

- every setting is finite and fits the int64 / float64 tensors that carry it to the other ranks
  (Megatron sent them as one float32 tensor: seeds above 2**24 were rounded, a temperature of
  1e-300 arrived as 0 and a seed of 10**40 overflowed on rank 0 after the other ranks had been
  told to start);
- top_k is below the vocabulary, a beam search has at least 2 x beam_size candidates per step
  and fits --max-tokens-to-oom, the length penalty cannot overflow a float;
- every prompt tokenizes to at least one token, and the batch fits --max-position-embeddings
  and --max-tokens-to-oom (Megatron's messages).

Errors are `ValueError`s with one-line messages, raised before any collective, so a refused
request never desynchronizes the ranks.
"""

import dataclasses
import math
from typing import List, Optional

import torch

from megatron.core.utils import get_current_device
from megatron.inference.text_generation.tokenization import tokenize_batch

#: Request modes (the loop every rank runs).
SAMPLING = 0
BEAM_SEARCH = 1

#: Bounds of values that travel as int64.
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
#: |length_penalty| bound: length ** penalty stays a finite float for any sequence length up to
#: 2**20 positions.
MAX_LENGTH_PENALTY = 10.0


@dataclasses.dataclass
class GenerationSettings:
    """The settings of one request, as every rank needs them (Megatron's keyword names).

    `host_stop` asks every rank to follow rank 0's verdict after each generated column (one
    extra 1-element broadcast per step): rank 0 may then end the loop early, for stop sequences
    or a client that went away.
    """

    mode: int = SAMPLING
    tokens_to_generate: int = 0
    return_output_log_probs: bool = False
    top_k_sampling: int = 0
    top_p_sampling: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    temperature: float = 1.0
    add_BOS: bool = False
    use_eod_token_for_early_termination: bool = True
    stop_on_double_eol: bool = False
    stop_on_eol: bool = False
    prevent_newline_after_colon: bool = False
    random_seed: int = -1
    beam_size: int = 0
    stop_token: int = 50256
    num_return_gen: int = 1
    length_penalty: float = 1.0
    host_stop: bool = False

    @classmethod
    def int_fields(cls) -> List[str]:
        """Fields carried by the int64 tensor (ints and bools), in broadcast order."""
        return [f.name for f in dataclasses.fields(cls) if f.type in (int, bool, 'int', 'bool')]

    @classmethod
    def float_fields(cls) -> List[str]:
        """Fields carried by the float64 tensor, in broadcast order."""
        return [f.name for f in dataclasses.fields(cls) if f.type in (float, 'float')]

    def pack(self):
        """([ints], [floats]) in broadcast order (bools as 0 / 1)."""
        ints = [int(getattr(self, name)) for name in self.int_fields()]
        floats = [float(getattr(self, name)) for name in self.float_fields()]
        return ints, floats

    @classmethod
    def unpack(cls, ints, floats) -> 'GenerationSettings':
        """The inverse of `pack` (on the receiving ranks)."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for name, value in zip(cls.int_fields(), ints):
            values[name] = bool(value) if types[name] in (bool, 'bool') else int(value)
        for name, value in zip(cls.float_fields(), floats):
            values[name] = float(value)
        return cls(**values)

    def check(self, vocab_size: int) -> None:
        """Numeric checks of what reaches the collectives and the loops (ValueError, one line)."""
        for name in self.int_fields():
            value = getattr(self, name)
            if not isinstance(value, int) or not INT64_MIN <= value <= INT64_MAX:
                raise ValueError(f'{name} must be an integer that fits in 64 bits, got {value!r}')
        for name in self.float_fields():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f'{name} must be a finite number, got {value!r}')
        if self.mode not in (SAMPLING, BEAM_SEARCH):
            raise ValueError(f'unknown generation mode {self.mode}')
        if self.tokens_to_generate < 0:
            raise ValueError(
                f'tokens_to_generate must be an integer greater than or equal to 0, got '
                f'{self.tokens_to_generate}'
            )
        if not (self.random_seed == -1 or 0 <= self.random_seed <= INT64_MAX):
            raise ValueError(
                f'random_seed must be -1 (unset) or in [0, 2**63 - 1], got {self.random_seed}'
            )
        if self.mode == SAMPLING:
            self._check_sampling(vocab_size)
        else:
            self._check_beam_search(vocab_size)

    def _check_sampling(self, vocab_size):
        top_k = self.top_k_sampling
        if top_k < 0 or (top_k > 1 and top_k >= vocab_size):
            raise ValueError(
                f'top_k must be 0 (off), 1 (greedy) or below the vocabulary size ({vocab_size}), '
                f'got {self.top_k_sampling}'
            )
        for name in ('top_p_sampling', 'top_p_decay', 'top_p_bound'):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f'{name} must be in [0, 1], got {value}')
        if self.top_k_sampling > 0 and self.top_p_sampling > 0.0:
            raise ValueError('cannot set both top-k and top-p samplings.')
        if not 0.0 < self.temperature <= 100.0:
            raise ValueError(
                f'temperature must be a positive number less than or equal to 100.0, got '
                f'{self.temperature}'
            )

    def _check_beam_search(self, vocab_size):
        largest = max(1, vocab_size // 2)
        if not 1 <= self.beam_size <= largest:
            raise ValueError(
                f'beam_width must be in [1, {largest}] (a step ranks 2 x beam_width candidates '
                f'among the {vocab_size} tokens), got {self.beam_size}'
            )
        if not 1 <= self.num_return_gen <= self.beam_size:
            raise ValueError(
                f'num_return_gen must be in [1, beam_size = {self.beam_size}], got '
                f'{self.num_return_gen}'
            )
        if abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise ValueError(
                f'length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], '
                f'got {self.length_penalty}'
            )


@dataclasses.dataclass
class PreparedRequest:
    """A checked request on rank 0: its settings and the padded batch.

    Attributes:
        settings: the request's settings.
        tokens: [b, max prompt length + tokens_to_generate] int64, right-padded with EOD.
        lengths: [b] int64 prompt lengths.
    """

    settings: GenerationSettings
    tokens: torch.Tensor
    lengths: torch.Tensor


def check_batch_size(settings: GenerationSettings, lengths, max_position_embeddings, max_tokens):
    """Megatron's limits of the batch (its messages), plus beam search's rows x width."""
    width = max(lengths) + settings.tokens_to_generate
    if settings.mode == BEAM_SEARCH:
        # Megatron caps beam search at the position limit; a prompt that fills it cannot grow.
        if max(lengths) >= min(width, max_position_embeddings):
            raise ValueError('context length + tokens_to_generate too large')
        rows = settings.beam_size
        width = min(width, max_position_embeddings)
    else:
        if width > max_position_embeddings:
            raise ValueError('Length of prompt + tokens_to_generate longer than allowed')
        rows = len(lengths)
    if rows * width > max_tokens:
        raise ValueError(f'Too many tokens.  {rows * width} is greater than {max_tokens}')


def prepare_request(
    prompts,
    settings: GenerationSettings,
    tokenizer,
    max_position_embeddings: int,
    max_tokens_to_oom: int,
    vocab_size: Optional[int] = None,
) -> PreparedRequest:
    """Check the settings, tokenize and pad the prompts: everything of a request that can fail,
    before any collective (rank 0 only).

    Raises:
        ValueError: one line naming the setting or prompt and its value.
    """
    if not prompts:
        raise ValueError('prompts is empty')
    settings.check(vocab_size if vocab_size is not None else tokenizer.vocab_size)
    if settings.mode == BEAM_SEARCH and len(prompts) != 1:
        raise ValueError('When doing beam_search, batch size must be 1')
    rows, lengths = tokenize_batch(
        tokenizer, prompts, settings.tokens_to_generate, settings.add_BOS
    )
    check_batch_size(settings, lengths, max_position_embeddings, max_tokens_to_oom)
    device = get_current_device()
    return PreparedRequest(
        settings=settings,
        tokens=torch.tensor(rows, dtype=torch.long, device=device),
        lengths=torch.tensor(lengths, dtype=torch.long, device=device),
    )
