"""Rules of the multi-token-prediction fields of TransformerConfig (called from its
__post_init__; no imports, so the config module can use it)."""


def check_mtp_config(config) -> None:
    """ValueError (one line) for layouts MTP cannot run here."""
    depth = config.mtp_num_layers
    if depth is None:
        return
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"mtp_num_layers must be a positive integer, got {depth!r}")
    if config.virtual_pipeline_model_parallel_size is not None:
        # The last stage builds its own copy of the word embedding for the MTP layers; the
        # interleaved schedule's chunks are not wired for it.
        raise ValueError(
            "multi-token prediction with virtual_pipeline_model_parallel_size "
            f"({config.virtual_pipeline_model_parallel_size}) is not supported"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"multi-token prediction with context_parallel_size ({config.context_parallel_size}) "
            "> 1 is not supported"
        )
