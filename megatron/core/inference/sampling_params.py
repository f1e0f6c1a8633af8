"""Per-request sampling settings (`SamplingParams`; core_r0.8.0 called them
`CommonInferenceParams`, which stays an alias).

The first five fields keep r0.8's order and defaults. Greedy decoding is `top_k=1`; with the
library defaults (top_k 0, top_p 0.0) the next token is drawn from the full softmax at
`temperature`.
"""

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    Attributes:
        temperature (float): logits are divided by it before top-k / top-p and sampling (greedy
            ignores it).
        top_k (int): 1 = greedy (argmax); k > 1 keeps the k largest logits; 0 = off.
        top_p (float): nucleus sampling mass in (0, 1]; 0.0 = off. Exclusive with top_k > 0.
        return_log_probs (bool): also return the log probability of each generated token (raw
            logits, temperature 1, over the padded vocabulary, as Megatron's generate()).
        num_tokens_to_generate (int, optional): most tokens generated; None (dynamic engine) =
            up to the engine's max sequence length.
        skip_prompt_log_probs (bool): with return_log_probs, leave out the prompt's log probs
            (log P(prompt token k + 1 | prompt tokens 0..k)); the dynamic engine then computes
            only the last prompt position's logits.
        termination_id (int, optional): token id that ends the request (kept in the dynamic
            engine's tokens, stripped from its text); None = the tokenizer's end-of-document id,
            -1 = never stop early (exactly num_tokens_to_generate tokens).
        stop_token_ids (list of lists of int, optional): the request also stops once its
            generated tokens end with one of these id sequences (kept in the output).
        random_seed (int, optional): seed of this request's own random generator, so that its
            sampled tokens do not depend on the other requests of the batch. None: the engine
            derives one from its own seed and the request id.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    num_tokens_to_generate: Optional[int] = 30
    skip_prompt_log_probs: bool = False
    termination_id: Optional[int] = None
    stop_token_ids: Optional[List[List[int]]] = field(default=None)
    random_seed: Optional[int] = None

    def add_attributes(self, attribute_value_pair: dict) -> None:
        """Set extra attributes, e.g. `params.add_attributes({'min_length': 4})`.

        The engines do not read attributes they do not know; this is a place for callers' own
        settings (as in megatron-core).
        """
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1

    def sampling_key(self):
        """The settings that shape the sampling distribution (rows that share it can be
        sampled together)."""
        return (self.temperature, self.top_k, self.top_p)

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError naming the field and value when a setting is out of range."""
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in [0, 1], got {self.top_p!r}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(
                "Cannot have top-p and top-k both greater than zero "
                f"(top_k={self.top_k}, top_p={self.top_p})"
            )
        if vocab_size is not None and self.top_k >= vocab_size and self.top_k > 1:
            raise ValueError(f"top-k is larger than vocab size: {self.top_k} >= {vocab_size}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0.0:
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}")
        n = self.num_tokens_to_generate
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"num_tokens_to_generate must be an integer >= 0, got {n!r}")
        if self.stop_token_ids is not None:
            for seq in self.stop_token_ids:
                if not seq or not all(isinstance(t, int) for t in seq):
                    raise ValueError(
                        f"stop_token_ids must be non-empty lists of token ids, got {seq!r}"
                    )
