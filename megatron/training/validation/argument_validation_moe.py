"""The mixture-of-experts rules of `validate_args`, checked before any work starts.

Each rule raises a one-line ValueError naming the flags and the numbers. Megatron's start-up
rules, the ones it only meets at run time (inside the router or the dispatcher) and the model
config's MoE rules (`check_moe_config`, run here on the flags' values) all stop the job here.
"""

import types

from megatron.core.transformer.moe.moe_config_checks import check_moe_config

#: Args that define an MoE model, restored by --use-checkpoint-args (Megatron r0.8 restores none:
#: a converted Mixtral needed every MoE flag and --rotary-base again at run time). The
#: dispatcher and the capacity settings change which tokens are dropped, so they travel too.
MOE_CHECKPOINT_ARGS = (
    'num_experts',
    'expert_model_parallel_size',
    'moe_router_topk',
    'moe_router_pre_softmax',
    'moe_router_score_function',
    'moe_router_topk_scaling_factor',
    'moe_router_num_groups',
    'moe_router_group_topk',
    'moe_router_enable_expert_bias',
    'moe_router_load_balancing_type',
    'moe_router_dtype',
    'moe_ffn_hidden_size',
    'moe_shared_expert_intermediate_size',
    'moe_shared_expert_gate',
    'moe_layer_freq',
    'moe_grouped_gemm',
    'moe_token_dispatcher_type',
    'moe_expert_capacity_factor',
    'moe_pad_expert_input_to_capacity',
    'moe_token_drop_policy',
    'moe_extended_tp',
)


def _is_training(args) -> bool:
    return bool(args.train_iters or args.train_samples)


def validate_expert_parallel_size(args):
    """`--expert-model-parallel-size` against the expert count and the data-parallel size.

    Called once the data-parallel size (world / (TP x PP x CP)) is known. As in Megatron
    core_r0.8 (`initialize_model_parallel`, and `megatron/core/parallel_layout.py` here), expert
    parallelism splits the data-parallel ranks, not the context-parallel ones: an expert group
    holds ranks of one CP rank and of EP different DP ranks, so EP must divide DP (DP x CP is not
    enough).
    """
    ep = args.expert_model_parallel_size
    if ep == 1:
        return
    if args.num_experts is None:
        raise ValueError('--expert-model-parallel-size > 1 requires --num-experts')
    if args.num_experts % ep != 0:
        raise ValueError(
            f'--num-experts ({args.num_experts}) must be divisible by '
            f'--expert-model-parallel-size ({ep})'
        )
    dp = args.data_parallel_size
    if dp % ep:
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        cp = args.context_parallel_size
        raise ValueError(
            f'data parallel size ({dp} = world size {args.world_size} / (TP {tp} x PP {pp} x '
            f'CP {cp})) is not divisible by --expert-model-parallel-size ({ep}); expert '
            'parallelism splits the data-parallel ranks, not the context-parallel ones'
        )


def validate_moe_args(args):
    """MoE rules (called from validate_args once the parallel sizes and the ffn size are known).

    `--num-experts 0` means no MoE, as in Megatron.
    """
    if args.num_experts == 0:
        args.num_experts = None
    if args.num_experts is None:
        return
    experts, topk = args.num_experts, args.moe_router_topk
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if experts < 0:
        raise ValueError(f'--num-experts must be positive, got {experts}')
    if args.spec is not None:
        raise ValueError('Model Spec must be None when using MoEs (drop --spec)')
    if not 1 <= topk <= experts:
        raise ValueError(
            f'--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts})'
        )
    factor = args.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ValueError(f'--moe-expert-capacity-factor must be positive, got {factor}')
    if ep > 1 and tp > 1 and not args.sequence_parallel and _is_training(args):
        raise ValueError(
            f'--expert-model-parallel-size {ep} with --tensor-model-parallel-size {tp} needs '
            '--sequence-parallel'
        )
    if tp > 1 and not args.sequence_parallel and _is_training(args):
        raise ValueError(
            f'training MoE layers with --tensor-model-parallel-size {tp} needs '
            '--sequence-parallel (without it every tensor-parallel rank would add the gradient '
            'of the same tokens to the experts)'
        )
    if ep > 1 and args.fp16:
        raise ValueError(
            f'Expert parallelism (--expert-model-parallel-size {ep}) is not supported with fp16 '
            'training; use --bf16'
        )
    _refuse_inexact_under_context_parallelism(args)
    try:
        check_moe_config(_config_view(args))
    except ValueError as exc:
        raise ValueError(f'MoE flags: {exc}') from None
    _refuse_stages_without_experts(args)


def _refuse_stages_without_experts(args):
    """With expert parallelism every pipeline stage must hold an expert (MoE) layer: the expert
    optimizer's gradient-norm and overflow reductions run over the tensor x pipeline x expert
    group, and a stage with no expert parameters builds no expert optimizer, so the others would
    wait for it forever. (Megatron core_r0.8.0 has every layer MoE; later Megatron's
    --moe-layer-freq can leave a stage dense.)"""
    pp, ep = args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if pp == 1 or ep == 1 or args.num_layers is None:
        return
    from megatron.core.transformer.moe.moe_config_checks import moe_layer_pattern
    from megatron.core.transformer.pipeline_layer_split import pipeline_stage_layer_counts

    view = _config_view(args)
    pattern = moe_layer_pattern(view)
    first = args.decoder_first_pipeline_num_layers
    last = args.decoder_last_pipeline_num_layers
    if getattr(args, 'num_layers_per_virtual_pipeline_stage', None) is not None:
        return  # interleaved chunks interleave the pattern too; every chunk rule is the model's
    counts = pipeline_stage_layer_counts(args.num_layers, pp, first, last)
    start = 0
    for stage, count in enumerate(counts):
        moe = sum(pattern[start : start + count])
        # The last stage also holds the MTP layers, built with the last decoder layer's spec.
        if stage == pp - 1 and getattr(args, 'mtp_num_layers', None) and pattern[-1]:
            moe += 1
        if moe == 0:
            raise ValueError(
                f'--moe-layer-freq {args.moe_layer_freq} leaves pipeline stage {stage} (layers '
                f'{start}-{start + count - 1}) without an MoE layer, which --expert-model-'
                f'parallel-size {ep} with --pipeline-model-parallel-size {pp} cannot run (its '
                'expert optimizer reductions span every stage): give each stage an MoE layer '
                '(e.g. --decoder-first-pipeline-num-layers) or use --expert-model-parallel-size 1'
            )
        start += count


def _refuse_inexact_under_context_parallelism(args):
    """MoE under context parallelism routes each rank's s / cp tokens as more tokens of the
    batch: the router, the dispatch and the auxiliary losses (counts summed over the CP group)
    give exactly the CP = 1 result. Two settings decide over the tokens of one rank instead, and
    would silently train another model than CP = 1: they are refused."""
    cp = args.context_parallel_size
    if cp == 1:
        return
    factor = args.moe_expert_capacity_factor
    if factor is not None:
        raise ValueError(
            f'--moe-expert-capacity-factor {factor} with --context-parallel-size {cp}: each '
            f'context-parallel rank would choose the dropped tokens among its own 1/{cp} of the '
            'sequence, not among the whole sequence, so training would differ from '
            '--context-parallel-size 1; use dropless MoE (no capacity factor) with context '
            'parallelism'
        )
    if args.moe_router_load_balancing_type == 'sinkhorn':
        raise ValueError(
            f'--moe-router-load-balancing-type sinkhorn with --context-parallel-size {cp}: '
            f'Sinkhorn balances the routing over the tokens of one rank, which holds only 1/{cp} '
            'of the sequence, so training would differ from --context-parallel-size 1; use '
            'aux_loss or none'
        )


def _config_view(args):
    """The TransformerConfig MoE fields check_moe_config reads, taken from the flags."""
    fields = {name: getattr(args, name) for name in vars(args) if name.startswith('moe_')}
    fields.update(
        num_moe_experts=args.num_experts,
        num_layers=args.num_layers,
        expert_model_parallel_size=args.expert_model_parallel_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        add_bias_linear=args.add_bias_linear,
    )
    if fields.get('moe_ffn_hidden_size') is None:
        fields['moe_ffn_hidden_size'] = args.ffn_hidden_size
    return types.SimpleNamespace(**fields)
