"""TransformerConfig: the architecture, regularisation, initialisation and recomputation options of
a megatron-core transformer. It extends ModelParallelConfig with Megatron's field names.

Modules read the config and never modify it; `__post_init__` fills the derived defaults
(ffn_hidden_size, kv_channels, num_query_groups, init methods) and raises `ValueError` naming the
fields and values for impossible combinations.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.moe.moe_config_checks import check_moe_config
from megatron.core.transformer.mtp_config_checks import check_mtp_config
from megatron.core.transformer.pipeline_layer_split import (
    check_pipeline_layer_split,
    pipeline_stage_layer_counts,
    uneven_split_requested,
)
from megatron.core.utils import init_method_normal, scaled_init_method_normal


@dataclass
class TransformerConfig(ModelParallelConfig):
    """Configuration of a megatron-core transformer (GPTModel, TransformerBlock, ...)."""

    ####################
    # model architecture
    ####################
    num_layers: int = 0
    """Number of transformer layers in the whole model (all pipeline stages)."""

    first_pipeline_num_layers: Optional[int] = None
    """Layers on the first pipeline stage when it differs from the even share (0: a stage that
    holds only the input embedding, r0.8's --standalone-embedding-stage); the other stages share
    the rest evenly. None keeps the even split."""

    last_pipeline_num_layers: Optional[int] = None
    """Layers on the last pipeline stage when it differs from the even share; None keeps it."""

    hidden_size: int = 0
    """Transformer hidden size."""

    num_attention_heads: int = 0
    """Number of attention (query) heads."""

    num_query_groups: Optional[int] = None
    """Number of key/value heads for grouped-query attention (None = num_attention_heads, i.e.
    MHA)."""

    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (None = 4 * hidden_size)."""

    kv_channels: Optional[int] = None
    """Size of one attention head (None = hidden_size // num_attention_heads)."""

    hidden_dropout: float = 0.1
    """Dropout probability on the outputs of attention and MLP before the residual add."""

    attention_dropout: float = 0.1
    """Dropout probability on the attention probabilities."""

    fp32_residual_connection: bool = False
    """Keep the residual stream in fp32 (the embedding output is cast to fp32)."""

    apply_residual_connection_post_layernorm: bool = False
    """Take the residual from the output of the layernorm instead of its input."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""

    layernorm_zero_centered_gamma: bool = False
    """LayerNorm weight is stored centred on zero (the effective weight is 1 + weight)."""

    add_bias_linear: bool = True
    """Biases on all linear layers (qkv, attention output, MLP)."""

    add_qkv_bias: bool = False
    """Bias on the QKV projection even when add_bias_linear is False."""

    gated_linear_unit: bool = False
    """Gated MLP: the first MLP layer outputs 2 * ffn_hidden_size and act(first half) * second half
    is fed to the second layer (SwiGLU with activation_func=F.silu)."""

    activation_func: Callable = F.gelu
    """Activation of the MLP."""

    activation_func_fp8_input_store: bool = False
    """Store the activation input in fp8 (Transformer Engine only; accepted, unused)."""

    num_moe_experts: Optional[int] = None
    """Number of MoE experts (None = dense MLP)."""

    rotary_interleaved: bool = False
    """Rotate interleaved pairs (x0, x1), (x2, x3)... instead of the two halves of each head."""

    window_size: Optional[Tuple[int, int]] = None
    """Sliding-window attention (not implemented; must be None)."""

    normalization: str = "LayerNorm"
    """Normalization layer: "LayerNorm" or "RMSNorm"."""

    qk_layernorm: bool = False
    """Normalise queries and keys per head before the dot product."""

    test_mode: bool = False
    """Extra checks in tests."""

    use_flash_attn: bool = False
    """Run every core attention through torch's fused scaled_dot_product_attention (its flash or
    memory-efficient kernels where the device has them, the same math elsewhere), attention
    dropout and padding masks included (`--use-flash-attn`)."""

    calculate_per_token_loss: bool = False
    """Average the loss over all tokens of the global batch instead of per micro-batch."""

    ####################
    # initialization
    ####################
    init_method: Callable = None
    """Initialiser of most weights (None = N(0, init_method_std))."""

    output_layer_init_method: Callable = None
    """Initialiser of the attention-output and second MLP weights (None =
    N(0, init_method_std / sqrt(2 * num_layers)))."""

    init_method_std: float = 0.02
    """Standard deviation of the default initialisers."""

    ####################
    # mixed-precision
    ####################
    apply_query_key_layer_scaling: bool = False
    """Scale Q·K^T by 1 / layer_number (and the softmax input back), for fp16 stability."""

    attention_softmax_in_fp32: bool = True
    """Compute the attention softmax in fp32 when the scores are 16-bit."""

    ####################
    # fusion
    ####################
    bias_activation_fusion: bool = False
    """Use the bias + activation fused op (bias-GeLU or bias-SwiGLU)."""

    masked_softmax_fusion: bool = False
    """Use the fused scale-mask-softmax kernel (plain torch here)."""

    persist_layer_norm: bool = False
    """Persistent layernorm kernel (Apex only; accepted, unused)."""

    memory_efficient_layer_norm: bool = False
    """Memory-efficient layernorm (Apex only; accepted, unused)."""

    bias_dropout_fusion: bool = False
    """Use the fused bias-dropout-add."""

    apply_rope_fusion: bool = False
    """Fused RoPE kernel (Transformer Engine only; plain torch is used)."""

    ####################
    # activation recomputation
    ####################
    recompute_granularity: Optional[str] = None
    """"full" recomputes whole layers in backward, "selective" recomputes only core attention
    (the softmax and dropout of the attention scores). None = no recomputation."""

    recompute_method: Optional[str] = None
    """With full recompute: "uniform" checkpoints groups of recompute_num_layers layers,
    "block" checkpoints the first recompute_num_layers layers of each pipeline stage."""

    recompute_num_layers: Optional[int] = None
    """Layers per checkpointed group ("uniform") or checkpointed layers per stage ("block")."""

    distribute_saved_activations: Optional[bool] = None
    """Split the checkpointed layer inputs across the tensor parallel group."""

    ####################
    # fp8 (Transformer Engine only; accepted, must stay off)
    ####################
    fp8: Optional[str] = None
    """fp8 format ("e4m3" / "hybrid"); not supported."""

    fp8_margin: int = 0
    """fp8 scaling margin."""

    fp8_interval: int = 1
    """fp8 scaling update interval."""

    fp8_amax_history_len: int = 1
    """fp8 amax history length."""

    fp8_amax_compute_algo: str = "most_recent"
    """fp8 amax algorithm."""

    fp8_wgrad: bool = True
    """fp8 weight gradients."""

    fp8_dot_product_attention: bool = False
    """fp8 attention."""

    fp8_multi_head_attention: bool = False
    """fp8 multi-head attention."""

    ####################
    # mixture of experts (see megatron/core/transformer/moe and docs/moe.md)
    ####################
    moe_router_load_balancing_type: str = "aux_loss"
    """Load balancing: "aux_loss" (Switch loss over the micro-batch), "seq_aux_loss" (the same
    loss per sequence, averaged: DeepSeek-V3's sequence-wise loss), "sinkhorn" (balanced
    assignment) or "none"."""

    moe_router_topk: int = 2
    """Experts each token is routed to (k)."""

    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (probs not renormalized); the default takes the
    top-k logits and a softmax over those k."""

    moe_router_score_function: str = "softmax"
    """Routing scores: "softmax" or "sigmoid" (sigmoid scores renormalized over the top-k)."""

    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiply the top-k routing probs by this factor."""

    moe_router_num_groups: Optional[int] = None
    """Group-limited routing (DeepSeek-V3): experts form this many equal groups and each token
    picks its experts from its `moe_router_group_topk` best groups only (None = off)."""

    moe_router_group_topk: Optional[int] = None
    """Groups each token may route to under group-limited routing."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for the top-k selection
    only, updated once per global batch from the token counts."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (bias += rate * sign(mean count - count))."""

    moe_router_dtype: Optional[str] = None
    """dtype of the router GEMM and scores: None (the params dtype), "fp32" or "fp64"."""

    moe_grouped_gemm: bool = False
    """Run the local experts with grouped GEMMs (`GroupedMLP`) instead of one MLP each."""

    moe_ffn_hidden_size: Optional[int] = None
    """ffn size of each routed expert (None = ffn_hidden_size)."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """ffn size of the shared experts every token goes through (None = no shared experts)."""

    moe_shared_expert_gate: bool = False
    """Scale the shared experts' output by sigmoid(x gate^T) (Qwen2-MoE)."""

    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE: an int N makes layer i (0-based) MoE iff i % N == 0; a list of 0/1
    per layer gives the pattern."""

    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss."""

    moe_z_loss_coeff: Optional[float] = None
    """Coefficient of the router z-loss (None = off)."""

    moe_input_jitter_eps: Optional[float] = None
    """Multiply the router input by U(1 - eps, 1 + eps) noise in training."""

    moe_token_dropping: bool = False
    """Megatron's unused placeholder (token dropping is moe_expert_capacity_factor)."""

    moe_token_dispatcher_type: str = "allgather"
    """Token dispatcher: "allgather" or "alltoall"."""

    moe_per_layer_logging: bool = False
    """Log every layer's auxiliary losses, not only their mean."""

    moe_expert_capacity_factor: Optional[float] = None
    """Capacity per expert = ceil(T k / E * factor); None = dropless."""

    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity."""

    moe_token_drop_policy: str = "probs"
    """Which pairs an expert over capacity keeps: "probs" (highest routing probs) or
    "position" (earliest tokens)."""

    moe_layer_recompute: bool = False
    """Recompute the MoE layers in backward (activation checkpointing)."""

    ####################
    # multi-token prediction (see megatron/core/transformer/multi_token_prediction.py)
    ####################
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depth D: D extra layers after the decoder, depth k predicting the
    token k + 1 places ahead (None = off)."""

    mtp_loss_scaling_factor: float = 0.1
    """The MTP losses enter the backward pass as (factor / D) * sum_k L_k."""

    ####################
    # qk-clip (see megatron/core/optimizer/qk_clip.py)
    ####################
    qk_clip: bool = False
    """Record each head's largest attention logit in training, so that `clip_qk` can rescale
    the query / key weights of heads above qk_clip_threshold after the optimizer step."""

    qk_clip_alpha: float = 0.5
    """Share of the rescaling applied to the queries (the keys get 1 - alpha)."""

    qk_clip_threshold: float = 100.0
    """Largest attention logit allowed."""

    ####################
    # context parallelism
    ####################
    cp_comm_type: Optional[Union[str, List[str]]] = None
    """How attention communicates under context parallelism: 'p2p' (ring, the default when
    None), 'all_gather', 'a2a' (Ulysses) or 'a2a+p2p' (needs hierarchical_context_parallel_sizes);
    one value for every layer or a list with one value per layer."""

    ####################
    # miscellaneous
    ####################
    clone_scatter_output_in_embedding: bool = True
    """Clone the sequence-parallel scatter output of the embedding so the full embedding output
    can be freed."""

    disable_parameter_transpose_cache: bool = False
    """Do not cache transposed weights (Transformer Engine only)."""

    enable_cuda_graph: bool = False
    """CUDA graphs (not supported)."""

    config_logger_dir: str = ""
    """Directory to dump module configs to (unused)."""

    # Mamba-2 mixers of hybrid models (later Megatron's fields; core_r0.8.0 fixes them).
    mamba_state_dim: int = 128
    """State size N of each Mamba head."""

    mamba_head_dim: int = 64
    """Head dimension P of the Mamba mixer."""

    mamba_num_groups: int = 8
    """Groups G of the mixer's B / C projections (heads share them in contiguous runs)."""

    mamba_num_heads: Optional[int] = None
    """Mamba heads; None: 2 * hidden_size / mamba_head_dim (the mixer's inner size is
    heads * head dim)."""

    def __post_init__(self):
        """Fill derived defaults and check cross-field rules (ValueError naming fields and
        values), in this order: the first failing rule is the one reported."""
        super().__post_init__()
        self._check_sizes()
        self._check_pipeline_layout()
        self._check_normalization_and_dropout()
        self._check_context_parallel()
        self._check_moe_and_unsupported()
        self._check_recompute()
        check_mtp_config(self)
        self._check_bias_activation_fusion()
        self._set_init_methods()

    def _check_sizes(self) -> None:
        """Positive sizes, heads and query groups against TP; derive ffn_hidden_size,
        kv_channels and num_query_groups."""
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        # Every TP rank holds whole heads.
        if self.num_attention_heads % self.tensor_model_parallel_size:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})."
            )

        # Defaults: an MLP four times as wide as the model, heads splitting h evenly.
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = self.hidden_size * 4
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                    f"({self.num_attention_heads}) when kv_channels is not given."
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads

        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads

        if self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})."
            )

        if self.num_query_groups % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must be a multiple of "
                f"tensor_model_parallel_size ({self.tensor_model_parallel_size})."
            )

    def _check_pipeline_layout(self) -> None:
        """Layers against the pipeline and virtual-pipeline stages."""
        if uneven_split_requested(self.first_pipeline_num_layers, self.last_pipeline_num_layers):
            self._check_uneven_pipeline_layout()
            return
        # With an encoder-decoder split rank each stack is spread over its own stages (T5Model
        # checks both shares).
        if (
            self.num_layers % self.pipeline_model_parallel_size != 0
            and self.pipeline_model_parallel_split_rank is None
        ):
            raise ValueError(
                f"num_layers ({self.num_layers}) must be a multiple of "
                f"pipeline_model_parallel_size ({self.pipeline_model_parallel_size})."
            )
        if self.virtual_pipeline_model_parallel_size is not None:
            layers_per_stage = self.num_layers // self.pipeline_model_parallel_size
            if layers_per_stage % self.virtual_pipeline_model_parallel_size != 0:
                raise ValueError(
                    f"num_layers per pipeline stage ({self.num_layers} / "
                    f"{self.pipeline_model_parallel_size} = {layers_per_stage})"
                    " must be a multiple of "
                    "virtual_pipeline_model_parallel_size"
                    f" ({self.virtual_pipeline_model_parallel_size})."
                )

    def _check_uneven_pipeline_layout(self) -> None:
        """First/last stage layer counts: a plain decoder pipeline without virtual stages."""
        if self.virtual_pipeline_model_parallel_size is not None:
            raise ValueError(
                "first_pipeline_num_layers / last_pipeline_num_layers are not supported with "
                "virtual (interleaved) pipeline stages "
                f"(virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size})"
            )
        if self.pipeline_model_parallel_split_rank is not None:
            raise ValueError(
                "first_pipeline_num_layers / last_pipeline_num_layers are not supported for "
                "encoder-decoder models (pipeline_model_parallel_split_rank="
                f"{self.pipeline_model_parallel_split_rank})"
            )
        check_pipeline_layer_split(
            self.num_layers,
            self.pipeline_model_parallel_size,
            self.first_pipeline_num_layers,
            self.last_pipeline_num_layers,
        )

    def _check_normalization_and_dropout(self) -> None:
        """Normalization, dropout probabilities and the softmax precision."""
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}"
            )

        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")

        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True

    def _check_moe_and_unsupported(self) -> None:
        """Expert parallelism and the MoE fields; refuse fp8 and sliding windows."""
        if self.expert_model_parallel_size > 1 and self.num_moe_experts is None:
            raise ValueError(
                f"expert_model_parallel_size ({self.expert_model_parallel_size}) > 1 needs "
                "num_moe_experts to be set."
            )
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.num_moe_experts is not None:
            check_moe_config(self)
        if self.fp8 is not None:
            raise ValueError(
                f"fp8 ({self.fp8!r}) needs Transformer Engine, which is not supported."
            )
        if self.window_size is not None:
            raise ValueError(
                f"window_size ({self.window_size}): sliding-window attention is not supported."
            )

    def _check_recompute(self) -> None:
        """Activation recomputation: granularity, method and layer count go together."""
        if self.recompute_granularity is not None:
            if self.recompute_granularity not in ("full", "selective"):
                raise ValueError(
                    f"recompute_granularity must be 'full' or 'selective', got "
                    f"{self.recompute_granularity!r}."
                )
            if self.recompute_method is not None:
                if self.recompute_method not in ("block", "uniform"):
                    raise ValueError(
                        "recompute_method must be 'block' or 'uniform',"
                        f" got {self.recompute_method!r}."
                    )
                if self.recompute_granularity == "selective":
                    raise ValueError(
                        f"recompute_method ({self.recompute_method!r}) is only used with "
                        "recompute_granularity 'full'; with 'selective' it must be None."
                    )
            elif self.recompute_granularity == "full":
                raise ValueError(
                    "recompute_granularity 'full' needs recompute_method 'uniform' or 'block',"
                    " got None."
                )

            if self.recompute_granularity == "full":
                if self.recompute_num_layers is None:
                    raise ValueError(
                        "recompute_granularity 'full' needs recompute_num_layers (layers per "
                        "checkpointed group or checkpointed layers per stage), got None."
                    )
                layers_per_stage = max(
                    pipeline_stage_layer_counts(
                        self.num_layers,
                        self.pipeline_model_parallel_size,
                        self.first_pipeline_num_layers,
                        self.last_pipeline_num_layers,
                    )
                )
                if not 1 <= self.recompute_num_layers <= layers_per_stage:
                    raise ValueError(
                        f"recompute_num_layers ({self.recompute_num_layers}) must be between 1 and "
                        f"num_layers // pipeline_model_parallel_size ({self.num_layers} // "
                        f"{self.pipeline_model_parallel_size} = {layers_per_stage})."
                    )
            elif self.recompute_num_layers is not None:
                raise ValueError(
                    f"recompute_num_layers ({self.recompute_num_layers}) must be None with "
                    "recompute_granularity 'selective'."
                )

            if self.distribute_saved_activations and self.sequence_parallel:
                raise ValueError(
                    "distribute_saved_activations and sequence_parallel cannot both be True: "
                    "sequence parallel activations are already split across ranks."
                )
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError(
                f"recompute_method ({self.recompute_method!r}) and recompute_num_layers "
                f"({self.recompute_num_layers}) need recompute_granularity 'full'."
            )

    def _check_bias_activation_fusion(self) -> None:
        """The fused bias-activation supports gelu with a bias and gated silu."""
        if self.bias_activation_fusion:
            if self.activation_func not in (F.gelu, F.silu):
                raise ValueError(
                    "bias_activation_fusion supports activation_func F.gelu or F.silu only, got "
                    f"{getattr(self.activation_func, '__name__', self.activation_func)}."
                )
            if self.activation_func == F.gelu and not self.add_bias_linear:
                raise ValueError(
                    "bias_activation_fusion with activation_func F.gelu needs add_bias_linear=True."
                )
            if self.activation_func == F.silu and not self.gated_linear_unit:
                raise ValueError(
                    "bias_activation_fusion with activation_func F.silu"
                    " needs gated_linear_unit=True."
                )

    def _set_init_methods(self) -> None:
        """Default init methods: normal(init_method_std), output layers scaled by depth."""
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)

        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(
                self.init_method_std, self.num_layers
            )

    def _check_context_parallel(self) -> None:
        """cp_comm_type values, their per-layer list length and the a2a head split."""
        from megatron.core.transformer.context_parallel.attention import (
            check_cp_attention_shapes,
        )

        if self.cp_comm_type is None:
            return
        comm_types = self.cp_comm_type
        if isinstance(comm_types, str):
            comm_types = [comm_types]
        elif len(comm_types) != self.num_layers:
            raise ValueError(
                f"cp_comm_type has {len(comm_types)} values; give one, or one per layer "
                f"(num_layers = {self.num_layers})"
            )
        hierarchy = self.hierarchical_context_parallel_sizes
        for comm_type in comm_types:
            if comm_type == "a2a+p2p" and hierarchy is None and self.context_parallel_size > 1:
                raise ValueError("cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes")
            check_cp_attention_shapes(
                comm_type,
                self.context_parallel_size,
                self.num_attention_heads // self.tensor_model_parallel_size,
                self.num_query_groups // self.tensor_model_parallel_size,
                a2a_size=hierarchy[0] if hierarchy else None,
            )
