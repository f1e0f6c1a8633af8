"""Rules of the multi-token-prediction fields of TransformerConfig (called from its
__post_init__; no imports, so the config module can use it)."""


def check_mtp_config(config) -> None:
    """ValueError (one line) for layouts MTP cannot run here."""
    depth = config.mtp_num_layers
    if depth is None:
        return
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"mtp_num_layers must be a positive integer, got {depth!r}")
    if config.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"multi-token prediction with pipeline_model_parallel_size "
            f"({config.pipeline_model_parallel_size}) > 1 is not supported (the MTP layers need "
            "the embedding on the last stage)"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            f"multi-token prediction with context_parallel_size ({config.context_parallel_size}) "
            "> 1 is not supported"
        )
