"""Inference: autoregressive text generation and the REST server that serves it."""
