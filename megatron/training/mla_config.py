"""args -> the MLA model config and layer spec (pretrain_gpt.py and the text generation server
with --multi-latent-attention). Kept apart from the flag definitions (arguments_mla.py), which
the parser imports: this module reads the args -> config bridge of arguments.py.
"""

import copy


def mla_config_from_args(args):
    """The MLATransformerConfig of `args` (the YaRN flags renamed to the config's fields)."""
    from megatron.core.transformer.mla_transformer_config import MLATransformerConfig
    from megatron.training.arguments import core_transformer_config_from_args

    named = copy.copy(args)
    named.rope_type = args.rope_type or 'yarn'
    named.original_max_position_embeddings = args.yarn_original_max_position_embeddings
    named.beta_fast = args.yarn_beta_fast
    named.beta_slow = args.yarn_beta_slow
    named.kv_channels = None  # MLA derives it (v_head_dim)
    return core_transformer_config_from_args(named, MLATransformerConfig)


def mla_layer_spec(config):
    """The block spec of this stage's MLA layers (dense or MoE per --moe-layer-freq)."""
    from megatron.core.models.gpt.gpt_layer_specs_mla import get_gpt_mla_decoder_block_spec

    return get_gpt_mla_decoder_block_spec(config)
