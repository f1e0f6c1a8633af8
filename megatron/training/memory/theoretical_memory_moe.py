"""Theoretical weight and optimizer memory of an MoE GPT run, per rank.

Megatron counts every layer's MLP times the number of experts and ignores expert parallelism, the
router and shared experts, so its figure for an expert-parallel run is the memory of all experts
on every rank. Here each rank holds:

- dense parameters (attention, norms, dense MLP layers, routers, shared experts, embeddings)
  split over tensor x pipeline parallelism, with optimizer state sharded over the data-parallel
  ranks by the distributed optimizer;
- its E / ep experts of each MoE layer of its stage, split over tensor parallelism, with optimizer
  state sharded over the expert-data-parallel ranks (dp / ep).

Printed lines keep Megatron's wording; "experts" lines are added.
"""

from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern


def _layer_pattern(args):
    class _View:
        num_layers = args.num_layers
        moe_layer_freq = args.moe_layer_freq

    return moe_layer_pattern(_View)


def moe_parameter_counts(args):
    """(dense transformer parameters, expert parameters) of the whole model (all ranks)."""
    h, heads = args.hidden_size, args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    kv = args.kv_channels or h // heads
    glu = 2 if args.swiglu else 1
    pattern = _layer_pattern(args)
    moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    attention = h * kv * heads * 2 + h * kv * groups * 2  # Q, O; K, V of the query groups
    norms = 4 * h  # two norms (weight and bias) per layer, as Megatron counts
    dense = 0
    experts = 0
    for is_moe in pattern:
        dense += attention + norms
        if is_moe:
            experts += args.num_experts * (glu + 1) * h * moe_ffn
            dense += args.num_experts * h  # router
            shared = args.moe_shared_expert_intermediate_size
            if shared:
                dense += (glu + 1) * h * shared + (h if args.moe_shared_expert_gate else 0)
        else:
            dense += (glu + 1) * h * args.ffn_hidden_size
    dense += 2 * h  # final norm
    return dense, experts


def compute_moe_weight_and_optimizer_memory(args, verbose=False):
    """Bytes of weights and optimizer state on the most loaded (first-stage) rank of an MoE run."""
    dense, experts = moe_parameter_counts(args)
    embedding_size = args.hidden_size * args.padded_vocab_size
    embeddings = embedding_size * (2 if args.untie_embeddings_and_output_weights else 1)
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    ep = args.expert_model_parallel_size
    dp = args.data_parallel_size
    if verbose:
        print(
            f"Number of parameters in transformer layers in billions: "
            f"{(dense + experts) / 10**9: .2f}"
        )
        print(f"Number of parameters in experts in billions: {experts / 10**9:.2f}")
        print(f"Number of parameters in embedding layers in billions: {embeddings / 10**9:.2f}")
        print(
            f"Total number of parameters in billions: {(dense + experts + embeddings) / 10**9:.2f}"
        )
    dense_on_shard = (dense / pp + embedding_size) / tp
    if args.untie_embeddings_and_output_weights and pp == 1:
        dense_on_shard += embedding_size / tp
    experts_on_shard = experts / (pp * tp * ep)
    if verbose:
        print(
            f"Number of parameters in most loaded shard in billions: "
            f"{(dense_on_shard + experts_on_shard) / 10**9:.4f}"
        )
        print(f"Number of expert parameters per rank in billions: {experts_on_shard / 10**9:.4f}")
    if getattr(args, 'use_torch_fsdp2', False):
        # FSDP2: 16 bytes per parameter sharded over the (HSDP: partial) data-parallel group,
        # experts over their expert-data-parallel group (HSDP does not replicate them).
        instances = getattr(args, 'num_distributed_optimizer_instances', 1)
        dense_bytes, expert_bytes = 16 / (dp / instances), 16 / max(1, dp // ep)
    elif args.use_distributed_optimizer:
        dense_bytes, expert_bytes = 6 + 12 / dp, 6 + 12 / max(1, dp // ep)
    else:
        dense_bytes = expert_bytes = 18
    return dense_on_shard * dense_bytes + experts_on_shard * expert_bytes
