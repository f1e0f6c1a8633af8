"""MLATransformerConfig: the transformer config of multi-latent attention models (later Megatron's
`MLATransformerConfig`, same field names and config defaults).

Field defaults are the config's (DeepSeek-V2/V3-sized ranks, YaRN factor 40); the command line
has its own defaults (see megatron/training/cli/arguments_mla.py), as in Megatron.
"""

from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class MLATransformerConfig(TransformerConfig):
    """TransformerConfig plus the sizes and rotary scaling of multi-latent attention."""

    multi_latent_attention: bool = True
    """Build the attention of every layer as MLASelfAttention."""

    q_lora_rank: Optional[int] = 512
    """Rank of the query down projection (None: one full-rank `linear_q_proj`)."""

    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent."""

    qk_head_dim: int = 128
    """Per-head size of the query/key part without position embedding."""

    qk_pos_emb_head_dim: int = 64
    """Per-head size of the rotary query/key part (the key part is shared by all heads)."""

    v_head_dim: int = 128
    """Per-head value size."""

    normalization: str = "RMSNorm"
    """Norm of the layers and of the latents."""

    rope_type: str = "yarn"
    """Rotary on the decoupled part: "yarn" or "rope" (plain, unscaled)."""

    rotary_base: float = 10000
    """RoPE base."""

    rotary_percent: float = 1.0
    """Must be 1.0 (the whole decoupled part is rotated)."""

    rotary_scaling_factor: float = 40
    """YaRN context extension factor."""

    original_max_position_embeddings: int = 4096
    """YaRN: the pretraining context length."""

    beta_fast: float = 32
    """YaRN: ramp end (rotations) below which channels keep their frequency."""

    beta_slow: float = 1
    """YaRN: ramp end (rotations) above which channels are fully interpolated."""

    mscale: float = 1.0
    """YaRN: numerator of the cos/sin concentration factor."""

    mscale_all_dim: float = 0.0
    """YaRN: denominator of the concentration factor; the softmax scale is multiplied by
    g(factor, mscale_all_dim)^2. 0.0 (later Megatron's default) boosts only the rotary half of
    each logit; DeepSeek-V3 checkpoints need 1.0 (with mscale 1.0)."""

    yarn_correction_range_round_to_int: bool = True
    """YaRN: round the ramp's ends to whole channels."""

    def __post_init__(self):
        """MLA has no kv_channels of its own: default it to v_head_dim so the base checks do not
        require hidden_size % num_attention_heads == 0; then run the base checks and MLA's."""
        if self.kv_channels is None:
            self.kv_channels = self.v_head_dim
        super().__post_init__()
        check_mla_config(self)


def check_mla_config(config: MLATransformerConfig) -> None:
    """ValueError (one line naming the fields) for MLA settings that cannot be built."""
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"multi-latent attention: {name} must be a positive integer, got {value!r}"
            )
    if config.q_lora_rank is not None and config.q_lora_rank <= 0:
        raise ValueError(
            "multi-latent attention: q_lora_rank must be positive or None, got "
            f"{config.q_lora_rank}"
        )
    if config.qk_pos_emb_head_dim % 2 != 0:
        raise ValueError(
            "multi-latent attention: qk_pos_emb_head_dim "
            f"({config.qk_pos_emb_head_dim}) must be even"
        )
    if config.num_query_groups != config.num_attention_heads:
        raise ValueError(
            f"multi-latent attention excludes grouped-query attention: num_query_groups "
            f"({config.num_query_groups}) must equal num_attention_heads "
            f"({config.num_attention_heads})"
        )
    if config.rope_type not in ("yarn", "rope"):
        raise ValueError(
            f"multi-latent attention: rope_type must be 'yarn' or 'rope', got {config.rope_type!r}"
        )
    if config.rotary_interleaved:
        raise ValueError(
            "multi-latent attention: rotary_interleaved is not supported "
            "(MLA de-interleaves itself)"
        )
    if config.rotary_percent != 1.0:
        raise ValueError(
            f"multi-latent attention: rotary_percent must be 1.0, got {config.rotary_percent}"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            "multi-latent attention with context_parallel_size "
            f"({config.context_parallel_size}) > 1 is not supported"
        )
