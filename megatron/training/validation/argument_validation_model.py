"""Rules of the model flags (`_add_network_size_args`, `_add_mixed_precision_args`,
`_add_transformer_engine_args` and the recomputation flags of `_add_training_args` in
`arguments_model.py`).

The transformer implementation, mixed precision, the network sizes, the sequence lengths and
activation recomputation. Each step is called by `validate_args` in its order (the first failing
rule is the one reported) and derives what it checks (`params_dtype`, `ffn_hidden_size`,
`kv_channels`, `encoder_seq_length`, ...).
"""

import torch

from megatron.training.run_control.errors import note


def select_transformer_impl(args):
    """Fall back to the local transformer without Transformer Engine; refuse the legacy models."""
    if args.transformer_impl == 'transformer_engine':
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            note(args, 'transformer_engine is not installed: --transformer-impl -> local')
            args.transformer_impl = 'local'
    if args.use_legacy_models:
        raise ValueError('--use-legacy-models: only the megatron.core models exist in this package')


def validate_mixed_precision(args):
    """fp16 / bf16 and their companions; derive `params_dtype`."""
    if args.fp16 and args.bf16:
        raise ValueError('--fp16 and --bf16 are mutually exclusive; pass at most one of them')
    args.params_dtype = torch.float
    if args.fp16:
        args.params_dtype = torch.half
    if args.bf16:
        args.params_dtype = torch.bfloat16
        # bfloat16 has too few mantissa bits to accumulate gradients: keep them in fp32.
        if not args.accumulate_allreduce_grads_in_fp32:
            args.accumulate_allreduce_grads_in_fp32 = True
            if args.rank == 0:
                print(
                    'accumulate and all-reduce gradients in fp32 for bfloat16 data type.',
                    flush=True,
                )
    if args.rank == 0:
        print('using {} for parameters ...'.format(args.params_dtype), flush=True)
    if args.fp16_lm_cross_entropy and not args.fp16:
        raise ValueError('--fp16-lm-cross-entropy requires --fp16')
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        raise ValueError('--fp32-residual-connection only makes sense with --fp16 or --bf16')
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ValueError(f'--loss-scale must be positive, got {args.loss_scale}')


def validate_network_sizes(args):
    """Required sizes, divisible by TP and PP; derive `ffn_hidden_size` and `kv_channels`."""
    _check_required_sizes(args)
    _check_parallel_divisibility(args)
    if args.ffn_hidden_size is None:
        if args.swiglu:
            # Keep the parameter count of a 4h MLP with a gated unit, rounded to a multiple of 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads


def _check_required_sizes(args):
    if args.num_layers is not None and args.encoder_num_layers is not None:
        raise ValueError('--num-layers and --encoder-num-layers are mutually exclusive')
    if args.num_layers is None and args.encoder_num_layers is not None:
        args.num_layers = args.encoder_num_layers
    for flag, value in (
        ('--num-layers', args.num_layers),
        ('--hidden-size', args.hidden_size),
        ('--num-attention-heads', args.num_attention_heads),
        ('--max-position-embeddings', args.max_position_embeddings),
    ):
        if value is None:
            raise ValueError(f'{flag} is required')
        if value <= 0:
            raise ValueError(f'{flag} must be positive, got {value}')
    if args.encoder_num_layers is None:
        args.encoder_num_layers = args.num_layers


def _check_parallel_divisibility(args):
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        raise ValueError(
            f'--hidden-size ({args.hidden_size}) is not divisible by --num-attention-heads '
            f'({args.num_attention_heads}); pass --kv-channels'
        )
    if args.num_attention_heads % args.tensor_model_parallel_size != 0:
        raise ValueError(
            f'--num-attention-heads ({args.num_attention_heads}) is not divisible by '
            f'--tensor-model-parallel-size ({args.tensor_model_parallel_size})'
        )
    if args.group_query_attention and args.num_query_groups % args.tensor_model_parallel_size:
        raise ValueError(
            f'--num-query-groups ({args.num_query_groups}) is not divisible by '
            f'--tensor-model-parallel-size ({args.tensor_model_parallel_size})'
        )
    if validate_pipeline_layer_split(args):
        return
    if (
        args.num_layers % args.pipeline_model_parallel_size != 0
        and args.pipeline_model_parallel_split_rank is None
    ):
        raise ValueError(
            f'--num-layers ({args.num_layers}) is not divisible by --pipeline-model-parallel-size '
            f'({args.pipeline_model_parallel_size})'
        )


def validate_pipeline_layer_split(args):
    """`--standalone-embedding-stage` and the first/last stage layer counts.

    r0.8's standalone embedding stage is stage 0 holding the input embedding and no transformer
    layer: it becomes `--decoder-first-pipeline-num-layers 0`, and
    `transformer_pipeline_model_parallel_size` (the stages holding layers) is derived as r0.8
    derives it. Returns whether the split is uneven (the even-split rule then does not apply).
    """
    pp = args.pipeline_model_parallel_size
    if args.standalone_embedding_stage:
        if pp < 2:
            raise ValueError(
                '--standalone-embedding-stage needs --pipeline-model-parallel-size > 1 (got '
                f'{pp}): stage 0 holds the embedding and the other stages the layers'
            )
        if args.decoder_first_pipeline_num_layers not in (None, 0):
            raise ValueError(
                '--standalone-embedding-stage puts no layer on the first stage; it contradicts '
                f'--decoder-first-pipeline-num-layers {args.decoder_first_pipeline_num_layers}'
            )
        args.decoder_first_pipeline_num_layers = 0
    standalone = args.standalone_embedding_stage
    args.transformer_pipeline_model_parallel_size = pp - 1 if standalone else pp
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return False
    flag = (
        '--standalone-embedding-stage'
        if args.standalone_embedding_stage
        else '--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers'
    )
    if args.virtual_pipeline_model_parallel_size is not None:
        raise ValueError(
            f'{flag} is not supported with the interleaved schedule '
            '(--num-layers-per-virtual-pipeline-stage '
            f'{args.num_layers_per_virtual_pipeline_stage})'
        )
    if args.pipeline_model_parallel_split_rank is not None:
        raise ValueError(
            f'{flag} is not supported for encoder-decoder models '
            f'(--pipeline-model-parallel-split-rank {args.pipeline_model_parallel_split_rank})'
        )
    if args.use_legacy_models:
        raise ValueError(
            f'{flag} is supported with the core models only (drop --use-legacy-models)'
        )
    fixed = [value for value in (first, last) if value is not None]
    if any(value < 0 for value in fixed):
        raise ValueError(f'{flag} must be >= 0 (got first={first}, last={last})')
    if pp <= len(fixed):
        raise ValueError(
            f'{flag} needs --pipeline-model-parallel-size > {len(fixed)} (got {pp}): at least one '
            'stage must share the remaining layers'
        )
    rest, others = args.num_layers - sum(fixed), pp - len(fixed)
    if rest < 0 or rest % others != 0:
        raise ValueError(
            f'--num-layers ({args.num_layers}) minus the layers fixed by {flag} ({sum(fixed)}) '
            f'must split evenly over the other {others} pipeline stages'
        )
    return True


def validate_sequence_lengths(args):
    """Sequence lengths against the position embeddings and CP; the position-embedding type."""
    if args.seq_length is not None and args.encoder_seq_length is not None:
        raise ValueError('--seq-length and --encoder-seq-length are mutually exclusive')
    if args.seq_length is not None:
        args.encoder_seq_length = args.seq_length
    else:
        args.seq_length = args.encoder_seq_length
    if args.seq_length is not None:
        if args.seq_length <= 0:
            raise ValueError(f'--seq-length must be positive, got {args.seq_length}')
        if args.position_embedding_type == 'learned_absolute' and (
            args.max_position_embeddings < args.seq_length
        ):
            raise ValueError(
                f'--max-position-embeddings ({args.max_position_embeddings}) must be >= '
                f'--seq-length ({args.seq_length})'
            )
    if (
        args.decoder_seq_length is not None
        and args.max_position_embeddings < args.decoder_seq_length
    ):
        raise ValueError(
            f'--max-position-embeddings ({args.max_position_embeddings}) must be >= '
            f'--decoder-seq-length ({args.decoder_seq_length})'
        )
    if args.seq_length is not None and args.context_parallel_size > 1:
        if args.seq_length % (2 * args.context_parallel_size) != 0:
            raise ValueError(
                f'--seq-length ({args.seq_length}) must be divisible by 2 x '
                f'--context-parallel-size ({args.context_parallel_size})'
            )
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = 'rope'
    if not args.add_position_embedding and args.position_embedding_type == 'learned_absolute':
        args.position_embedding_type = 'none'


def validate_recompute(args):
    """Activation recomputation: granularity, method and layer count go together."""
    if args.recompute_activations:
        args.recompute_granularity = 'selective'
    if args.recompute_granularity == 'selective' and args.recompute_method is not None:
        raise ValueError(
            f'--recompute-method ({args.recompute_method}) is only for --recompute-granularity full'
        )
    if args.recompute_granularity == 'full' and args.recompute_method is None:
        raise ValueError('--recompute-granularity full requires --recompute-method uniform|block')
    if args.recompute_method is not None and args.recompute_num_layers is None:
        raise ValueError(
            f'--recompute-method {args.recompute_method} requires --recompute-num-layers'
        )
    if args.distribute_saved_activations:
        if args.tensor_model_parallel_size == 1:
            raise ValueError(
                '--distribute-saved-activations requires --tensor-model-parallel-size > 1'
            )
        if args.recompute_granularity != 'full':
            raise ValueError('--distribute-saved-activations requires --recompute-granularity full')
