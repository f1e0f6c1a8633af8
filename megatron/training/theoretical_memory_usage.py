"""Theoretical per-GPU memory of a GPT run: weights + optimizer state, and activations.

The formulas of Megatron's megatron/training/theoretical_memory_usage.py (activations from
"Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198): the activation
estimate exists only with --sequence-parallel and --recompute-granularity selective; without them
only the weight and optimizer line is printed. MB in the printed lines means MiB (1024^2 bytes).
"""

import math

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def compute_weight_and_optimizer_memory(args, verbose=False):
    """Bytes of weights and optimizer state on the most loaded (first-stage) shard.

    Side effect as in Megatron: without --group-query-attention, args.num_query_groups is set to
    the number of attention heads.
    """
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_experts is not None:
        # Per rank: E / ep experts, expert optimizer state over the expert-data-parallel ranks.
        from megatron.training.memory.theoretical_memory_moe import (
            compute_moe_weight_and_optimizer_memory,
        )

        return compute_moe_weight_and_optimizer_memory(args, verbose=verbose)
    num_experts = 1
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1
    h, layers = args.hidden_size, args.num_layers
    num_parameters_in_transformer_layers = (
        2
        * layers
        * h
        * h
        * (
            # Attention: Q and O projections plus K and V of the query groups.
            (1 + (args.num_query_groups / args.num_attention_heads))
            * (args.kv_channels * args.num_attention_heads / h)
            # MLP.
            + ((args.ffn_hidden_size / h) * num_experts * gated_linear_multiplier)
            # Two layer norms (weight and bias) per layer.
            + (2 / h)
            # Final layer norm.
            + (1 / (layers * h))
        )
    )
    embedding_size = h * args.padded_vocab_size
    if args.untie_embeddings_and_output_weights:
        num_parameters_in_embedding_layers = 2 * embedding_size
    else:
        num_parameters_in_embedding_layers = embedding_size
    num_total_parameters = num_parameters_in_transformer_layers + num_parameters_in_embedding_layers
    if verbose:
        print(
            f"Number of parameters in transformer layers in billions: "
            f"{num_parameters_in_transformer_layers / 10**9: .2f}"
        )
        print(
            f"Number of parameters in embedding layers in billions: "
            f"{num_parameters_in_embedding_layers / 10**9:.2f}"
        )
        print(f"Total number of parameters in billions: {num_total_parameters / 10**9:.2f}")

    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    num_parameters_on_most_loaded_model_shard = (
        (num_parameters_in_transformer_layers / pp) + embedding_size
    ) / tp
    if args.untie_embeddings_and_output_weights and pp == 1:
        num_parameters_on_most_loaded_model_shard += embedding_size / tp
    if verbose:
        print(
            f"Number of parameters in most loaded shard in billions: "
            f"{num_parameters_on_most_loaded_model_shard / 10**9:.4f}"
        )
    if pp > 1:
        num_parameters_on_other_model_shards = num_parameters_in_transformer_layers / (pp * tp)
        if verbose:
            print(
                f"Number of parameters in other shards in billions: "
                f"{num_parameters_on_other_model_shards / 10**9:.4f}"
            )

    # Mixed precision with Adam: 2 (fp16 weight) + 4 (fp32 grad) + 12 (fp32 main weight and two
    # moments) bytes; the distributed optimizer shards the 12 over data parallelism.
    num_bytes_per_parameter = (
        18 if not args.use_distributed_optimizer else 6 + (12 / args.data_parallel_size)
    )
    if getattr(args, 'use_torch_fsdp2', False):
        # FSDP2 (and Megatron-FSDP's optim_grads / optim_grads_params) shards all of it: fp32
        # weight + fp32 grad + two moments (bf16 default), or bf16 weight + bf16 grad + fp32 main
        # weight + moments (--torch-fsdp2-reduce-in-bf16): 16 bytes over data parallelism. The
        # gathered unit (one layer's weights and grads, transient) is not counted.
        # With HSDP (--num-distributed-optimizer-instances N) each replica shards over DP / N.
        instances = getattr(args, 'num_distributed_optimizer_instances', 1)
        num_bytes_per_parameter = 16 / (args.data_parallel_size / instances)
    return num_parameters_on_most_loaded_model_shard * num_bytes_per_parameter


def compute_activation_memory(args, num_microbatches, verbose=False):
    """Activation bytes of the first stage with sequence parallelism and selective recompute."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    vp = args.virtual_pipeline_model_parallel_size
    # Table 2 of arXiv 2205.05198: 34 s b h per layer with a 4h MLP, generalised to ffn size f.
    activation_memory = (s * b * h) * (18 + (4 * (args.ffn_hidden_size / h)))
    if verbose:
        print(
            f"Activation memory footprint per transformer layer: "
            f"{activation_memory / NUM_BYTES_IN_MEGABYTE / tp:.1f} MB"
        )
    # The first stage holds L / pp layers with pp micro-batches in flight: L layers' worth.
    activation_memory *= args.num_layers
    activation_memory += 8 * s * b * pp  # input to the embedding
    activation_memory += s * b * h * pp  # dropout mask of the embedding
    if vp is not None:
        interleaved_schedule_memory_penalty = 1 + ((pp - 1) / (pp * vp))
        in_flight_microbatches = math.ceil(interleaved_schedule_memory_penalty * pp)
        if verbose:
            print(
                f"Memory penalty from interleaved schedule: "
                f"{interleaved_schedule_memory_penalty:.2f}"
            )
            print(f"Number of in-flight microbatches: {in_flight_microbatches}")
        activation_memory *= interleaved_schedule_memory_penalty
    if vp is None and pp > 1:
        if num_microbatches is not None:
            activation_memory *= min(1, num_microbatches / pp)
            in_flight_microbatches = min(num_microbatches, pp)
        else:
            in_flight_microbatches = pp
        if verbose:
            print(f"Number of in-flight microbatches: {in_flight_microbatches}")
    if pp == 1:
        # Output layer and cross-entropy loss.
        activation_memory += s * b * h * 4 * (1 + (args.padded_vocab_size / h))
    return activation_memory / tp


def report_theoretical_memory(args, num_microbatches=None, verbose=False):
    """Print Megatron's "Theoretical memory footprints" line (and the verbose breakdown)."""
    weight_and_optimizer_memory = (
        compute_weight_and_optimizer_memory(args, verbose=verbose) / NUM_BYTES_IN_MEGABYTE
    )
    if not args.sequence_parallel or args.recompute_granularity != 'selective':
        print(
            f"Theoretical memory footprints: weight and optimizer="
            f"{weight_and_optimizer_memory:.2f} MB"
        )
        return
    activation_memory = (
        compute_activation_memory(args, num_microbatches=num_microbatches, verbose=verbose)
        / NUM_BYTES_IN_MEGABYTE
    )
    total_memory = weight_and_optimizer_memory + activation_memory
    print(
        f"Theoretical memory footprints: weight and optimizer="
        f"{weight_and_optimizer_memory:.2f} MB, activation={activation_memory:.2f} MB, "
        f"total={total_memory:.2f} MB\n"
    )
