"""Start-up checks of context parallelism (`--context-parallel-size`, `--cp-comm-type`,
`--hierarchical-context-parallel-sizes`).

Context parallelism must be exact or refused: whatever it cannot compute exactly stops the run
before any work, with one line naming the flag and the numbers. `validate_context_parallel_args`
runs from `validate_args` (after the world-size and sequence-length checks);
`refuse_context_parallel` is called by the entry points that cannot split a sequence (text
generation, downstream tasks).

What CP computes exactly here: GPT pretraining with causal attention (learned absolute, RoPE or
no position embeddings), with TP (+SP), PP (1F1B and interleaved), DP and the distributed
optimizer, recompute, fp16/bf16, and hybrid Mamba models (the mixer's all-to-all from sequence
chunks to heads; `--sft` packing; `--reset-attention-mask` too when the pattern has no attention
layer).
Refused: masks other than causal (`--reset-attention-mask`'s per-document mask for attention
layers; BERT's and T5's padding masks are refused when their attention is built), the KV-cache
inference path, and the tp-pp-dp rank mapping (whose order has no cp dimension).
"""

from megatron.core.transformer.context_parallel import CP_COMM_TYPES, check_cp_attention_shapes

#: Megatron's help text spells the all-gather type "allgather"; Transformer Engine and its
#: TransformerConfig docstring say "all_gather". Both are accepted.
_ALIASES = {'allgather': 'all_gather'}


def _normalize_comm_types(args) -> list:
    comm_types = args.cp_comm_type
    if isinstance(comm_types, str):
        comm_types = [comm_types]
    comm_types = [_ALIASES.get(c, c) for c in comm_types]
    for comm_type in comm_types:
        if comm_type not in CP_COMM_TYPES:
            raise ValueError(
                f'--cp-comm-type {comm_type!r} is not one of {", ".join(CP_COMM_TYPES)}'
            )
    if len(comm_types) not in (1, args.num_layers):
        raise ValueError(
            f'--cp-comm-type has {len(comm_types)} values; give one, or one per layer '
            f'(--num-layers {args.num_layers})'
        )
    # As Megatron: one value applies to every layer and is stored as a string.
    args.cp_comm_type = comm_types[0] if len(comm_types) == 1 else comm_types
    return comm_types


def _check_hierarchy(args, comm_types) -> None:
    sizes = args.hierarchical_context_parallel_sizes
    cp = args.context_parallel_size
    if sizes is not None:
        product = 1
        for size in sizes:
            product *= size
        if len(sizes) != 2 or product != cp:
            raise ValueError(
                f'--hierarchical-context-parallel-sizes {" ".join(map(str, sizes))} must be two '
                f'sizes whose product is --context-parallel-size ({cp})'
            )
    elif 'a2a+p2p' in comm_types and cp > 1:
        raise ValueError(
            '--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm'
        )


def _documents_without_attention(args) -> bool:
    """A hybrid Mamba run without attention layers: its Mamba layers take the document ids of
    --reset-attention-mask under CP (gathered over the CP group), and no attention layer needs
    the per-document mask."""
    from megatron.training.validation.argument_validation_mamba import is_mamba_run

    if not is_mamba_run(args):
        return False
    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, check_hybrid_allocation

    pattern = check_hybrid_allocation(
        args.num_layers,
        args.hybrid_attention_ratio,
        args.hybrid_mlp_ratio,
        args.hybrid_override_pattern,
    )
    return Symbols.ATTENTION not in pattern


def validate_context_parallel_args(args) -> None:
    """Normalise `--cp-comm-type` and refuse what context parallelism cannot do exactly.

    Raises:
        ValueError: one line naming the flag and the numbers.
    """
    comm_types = _normalize_comm_types(args)
    cp = args.context_parallel_size
    if cp == 1:
        return
    _check_hierarchy(args, comm_types)
    if args.use_tp_pp_dp_mapping:
        raise ValueError(
            f'--context-parallel-size {cp}: context_parallel and expert_model_parallel can\'t be '
            'used with tp-pp-dp mapping (--use-tp-pp-dp-mapping)'
        )
    if args.reset_attention_mask and not _documents_without_attention(args):
        raise ValueError(
            f'--reset-attention-mask: its per-document attention mask cannot be split over the '
            f'sequence by --context-parallel-size {cp} (only causal attention is exact there); '
            'drop --reset-attention-mask or use --context-parallel-size 1'
        )
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and args.seq_length is not None and (args.seq_length // cp) % tp:
        raise ValueError(
            f'--sequence-parallel: the local sequence --seq-length / --context-parallel-size '
            f'({args.seq_length} / {cp} = {args.seq_length // cp}) must be divisible by '
            f'--tensor-model-parallel-size ({tp})'
        )
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    if heads is not None and groups is not None:
        hierarchy = args.hierarchical_context_parallel_sizes
        for comm_type in set(comm_types):
            check_cp_attention_shapes(
                comm_type,
                cp,
                heads // tp,
                groups // tp,
                a2a_size=hierarchy[0] if hierarchy else None,
            )


def refuse_context_parallel(args, what: str) -> None:
    """Stop `what` (an entry point that cannot split a sequence) when run with CP > 1."""
    if args.context_parallel_size > 1:
        raise ValueError(
            f'--context-parallel-size {args.context_parallel_size}: {what} does not support '
            'context parallelism; run it with --context-parallel-size 1 (checkpoints do not '
            'depend on it)'
        )
