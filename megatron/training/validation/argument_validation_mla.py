"""Start-up checks of the multi-latent attention, multi-token prediction and Muon flags (one
`ValueError` line each, raised before any work starts)."""

from megatron.training.cli.arguments_muon import validate_muon_args


def validate_mla_args(args):
    """MLA sizes against TP and the features MLA cannot run with; the layouts multi-token
    prediction cannot run."""
    validate_mtp_args(args)
    validate_muon_args(args)
    if not getattr(args, 'multi_latent_attention', False):
        return
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp != 0:
        raise ValueError(
            f'--multi-latent-attention: --num-attention-heads ({args.num_attention_heads}) must be '
            f'a multiple of --tensor-model-parallel-size ({tp}) (MLA splits whole heads)'
        )
    if args.qk_pos_emb_head_dim % 2 != 0:
        raise ValueError(
            f'--qk-pos-emb-head-dim ({args.qk_pos_emb_head_dim}) must be even (rotary pairs)'
        )
    if args.group_query_attention:
        raise ValueError('--multi-latent-attention excludes --group-query-attention')
    if args.context_parallel_size > 1:
        raise ValueError(
            f'--multi-latent-attention with --context-parallel-size '
            f'({args.context_parallel_size}) > 1 is not supported'
        )
    if args.rotary_interleaved:
        raise ValueError('--multi-latent-attention does not take --rotary-interleaved')
    if args.rotary_percent != 1.0:
        raise ValueError(
            f'--multi-latent-attention rotates the whole decoupled part: --rotary-percent must be '
            f'1.0, got {args.rotary_percent}'
        )


def validate_mtp_args(args):
    """--mtp-num-layers: positive, no interleaved schedule (the MTP layers run on the last
    pipeline stage), no context parallelism, rope or no position embedding (sequence and
    pipeline parallelism are supported)."""
    depth = getattr(args, 'mtp_num_layers', None)
    if depth is None:
        return
    if depth < 1:
        raise ValueError(f'--mtp-num-layers must be positive, got {depth}')
    if getattr(args, 'num_layers_per_virtual_pipeline_stage', None) is not None:
        raise ValueError(
            '--mtp-num-layers is not supported with the interleaved schedule '
            '(--num-layers-per-virtual-pipeline-stage '
            f'{args.num_layers_per_virtual_pipeline_stage})'
        )
    if args.context_parallel_size > 1:
        raise ValueError(
            f'--mtp-num-layers with --context-parallel-size ({args.context_parallel_size}) > 1 '
            'is not supported'
        )
    if args.position_embedding_type not in ('rope', 'none'):
        raise ValueError(
            f'--mtp-num-layers needs --position-embedding-type rope or none, got '
            f'{args.position_embedding_type}'
        )
