"""Cross-field rules of the MoE fields of TransformerConfig (called from its __post_init__).

Each rule raises a one-line ValueError naming the fields and their values, at construction,
before any module is built. Megatron's rules (several of which it only checks at run time) plus
the ones its later versions or this implementation need.
"""

_DISPATCHERS = ("allgather", "alltoall")
_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
_DROP_POLICIES = ("probs", "position")
_SCORE_FUNCTIONS = ("softmax", "sigmoid")
_ROUTER_DTYPES = (None, "fp32", "fp64")


def _one_of(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_moe_config(config) -> None:
    """Raise ValueError for an impossible MoE configuration (num_moe_experts is set)."""
    num_experts = config.num_moe_experts
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_moe_experts must be a positive integer, got {num_experts!r}")
    _one_of("moe_token_dispatcher_type", config.moe_token_dispatcher_type, _DISPATCHERS)
    _one_of(
        "moe_router_load_balancing_type", config.moe_router_load_balancing_type, _LOAD_BALANCING
    )
    _one_of("moe_token_drop_policy", config.moe_token_drop_policy, _DROP_POLICIES)
    _one_of("moe_router_score_function", config.moe_router_score_function, _SCORE_FUNCTIONS)
    _one_of("moe_router_dtype", config.moe_router_dtype, _ROUTER_DTYPES)

    topk = config.moe_router_topk
    if not 1 <= topk <= num_experts:
        raise ValueError(
            f"moe_router_topk ({topk}) must be between 1 and num_moe_experts ({num_experts})"
        )
    if topk == 1 and config.moe_router_score_function == "softmax":
        if (
            not config.moe_router_pre_softmax
            and config.moe_router_load_balancing_type != "sinkhorn"
        ):
            # The softmax of a single logit is 1: the router would get no gradient.
            raise ValueError("Please use --moe-router-pre-softmax when topk is 1.")
    _check_group_limited_routing(config, num_experts, topk)
    if config.moe_router_load_balancing_type == "sinkhorn" and config.moe_aux_loss_coeff:
        raise ValueError("Sinkhorn routing does not support aux loss.")

    ep = config.expert_model_parallel_size
    if config.moe_extended_tp:
        if config.moe_token_dispatcher_type != "allgather":
            raise ValueError(
                "Moe extended TP parallelism only applies to allgather based token dispatcher."
            )
        extended_tp_size = config.tensor_model_parallel_size * ep
        if config.moe_ffn_hidden_size % extended_tp_size != 0:
            raise ValueError(
                f"ffn_hidden_size: {config.moe_ffn_hidden_size} must be divisible by "
                f"extended_tp_size {extended_tp_size}"
            )
        if config.add_bias_linear:
            raise ValueError("moe_extended_tp does not support biases in the expert layers")
    elif num_experts % ep != 0:
        raise ValueError(
            f"num_moe_experts ({num_experts}) must be a multiple of expert_model_parallel_size "
            f"({ep})"
        )

    factor = config.moe_expert_capacity_factor
    if factor is not None:
        if factor <= 0:
            raise ValueError(f"moe_expert_capacity_factor must be positive, got {factor}")
        if config.moe_token_dispatcher_type != "alltoall":
            raise ValueError("moe_expert_capacity_factor only works with alltoall token dispatcher")
        if config.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
            raise ValueError(
                "moe_expert_capacity_factor only works with aux_loss or none load balancing"
            )
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError(
            "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"
        )
    if config.moe_grouped_gemm and config.add_bias_linear:
        raise ValueError(
            "bias in the expert layer is not supported in Grouped GEMM yet, please set "
            "'--disable-bias-linear' instead."
        )

    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and shared <= 0:
        raise ValueError(f"moe_shared_expert_intermediate_size must be positive, got {shared}")
    if config.moe_shared_expert_gate and shared is None:
        raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size")
    if config.moe_ffn_hidden_size <= 0:
        raise ValueError(f"moe_ffn_hidden_size must be positive, got {config.moe_ffn_hidden_size}")
    if config.moe_router_bias_update_rate < 0:
        raise ValueError(
            f"moe_router_bias_update_rate must be >= 0, got {config.moe_router_bias_update_rate}"
        )
    moe_layer_pattern(config)


def moe_layer_pattern(config) -> list:
    """[num_layers] 0/1 list: which layers are MoE (from moe_layer_freq)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {freq}")
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    pattern = list(freq)
    if len(pattern) != config.num_layers or any(x not in (0, 1) for x in pattern):
        raise ValueError(
            f"moe_layer_freq as a list needs num_layers ({config.num_layers}) entries of 0 or 1, "
            f"got {pattern}"
        )
    return pattern


def _check_group_limited_routing(config, num_experts: int, topk: int) -> None:
    """moe_router_num_groups / moe_router_group_topk: both or neither, groups that divide the
    experts, a group top-k within the groups, and enough experts in the chosen groups."""
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        raise ValueError(
            f"moe_router_num_groups ({groups}) and moe_router_group_topk ({group_topk}) must be "
            "set together"
        )
    if groups <= 0 or num_experts % groups != 0:
        raise ValueError(
            f"moe_router_num_groups ({groups}) must divide num_moe_experts ({num_experts})"
        )
    if not 1 <= group_topk <= groups:
        raise ValueError(
            f"moe_router_group_topk ({group_topk}) must be between 1 and moe_router_num_groups "
            f"({groups})"
        )
    if topk % group_topk != 0 or topk > group_topk * (num_experts // groups):
        raise ValueError(
            f"moe_router_topk ({topk}) must be a multiple of moe_router_group_topk ({group_topk}) "
            f"and at most the {group_topk * (num_experts // groups)} experts of the chosen groups"
        )
    if config.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError("group-limited routing (moe_router_num_groups) excludes sinkhorn routing")
