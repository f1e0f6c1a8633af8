"""Command-line flags of the training layer: the parser (`arguments_parser`), one module per flag
family (`arguments_<family>`: model, MoE, run control, SFT/FIM, and the families added for
Mamba, MLA, FSDP, vision, resilience ...), and the table of Megatron flags that are refused with
a reason (`arguments_unsupported`). `megatron.training.arguments` (parse_args, validate_args,
core_transformer_config_from_args) stays the public entry point.
"""
