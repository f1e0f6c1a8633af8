"""Autoregressive text generation with Megatron models (sampling, scoring, beam search)."""

from megatron.inference.text_generation.api import (  # noqa: F401
    beam_search,
    beam_search_and_post_process,
    generate,
    generate_and_post_process,
)
