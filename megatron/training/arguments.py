"""Megatron's command-line arguments: the parser, the cross-flag checks and the args -> config
bridge.

`parse_args()` builds the argparse parser from one `_add_*_args(parser)` function per concern, with
Megatron core_v0.8.0 flag names and defaults. `validate_args(args, defaults)` (in
`argument_validation.py`, re-exported here) checks every cross-flag rule before any work starts
(one-line `ValueError`s naming the flags and the numbers) and derives the values the rest of the
training layer reads (`data_parallel_size`, `params_dtype`, ...).
`core_transformer_config_from_args(args)` is the one place where args become a `TransformerConfig`.
"""

import argparse
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

from megatron.core.transformer.utils import openai_gelu, squared_relu
from megatron.training.argument_validation import validate_args  # noqa: F401 (re-exported)
from megatron.training.arguments_unsupported import (
    add_biencoder_args,
    add_one_logger_args,
    add_retro_args,
    add_tp_comm_overlap_args,
    add_vision_args,
)


def parse_args(extra_args_provider=None, ignore_unknown_args=False, args_list=None):
    """Parse Megatron's command-line arguments.

    Args:
        extra_args_provider: optional callable(parser) -> parser adding script-specific flags.
        ignore_unknown_args: if True, unknown flags are dropped instead of failing.
        args_list: argument strings to parse instead of `sys.argv[1:]` (tests, notebooks).

    Returns:
        argparse.Namespace with `rank` and `world_size` filled from torchrun's environment (or from
        the already-initialized default process group).
    """
    parser = get_args_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(args_list)
    else:
        args = parser.parse_args(args_list)

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        args.rank = torch.distributed.get_rank()
        args.world_size = torch.distributed.get_world_size()
    else:
        args.rank = int(os.getenv('RANK', '0'))
        args.world_size = int(os.getenv('WORLD_SIZE', '1'))
    if args.local_rank is None:
        args.local_rank = int(os.getenv('LOCAL_RANK', '0'))
    return args


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a parse error prints one line (not the full usage of every flag), once for
    the job (global rank 0), and exits with argparse's code 2."""

    def error(self, message):
        from megatron.training.errors import global_rank

        if global_rank() == 0:
            sys.stderr.write(f'{self.prog}: error: {message}\n')
            sys.stderr.flush()
        sys.exit(2)


def get_args_parser(extra_args_provider=None):
    """The full argparse parser (all `_add_*_args` groups plus the script's extra flags)."""
    parser = _OneLineErrorParser(description='Megatron-LM Arguments', allow_abbrev=False)
    parser = _add_network_size_args(parser)
    parser = _add_regularization_args(parser)
    parser = _add_training_args(parser)
    parser = _add_initialization_args(parser)
    parser = _add_learning_rate_args(parser)
    parser = _add_checkpointing_args(parser)
    parser = _add_mixed_precision_args(parser)
    parser = _add_distributed_args(parser)
    parser = _add_validation_args(parser)
    parser = _add_data_args(parser)
    parser = _add_tokenizer_args(parser)
    parser = _add_autoresume_args(parser)
    parser = add_biencoder_args(parser)
    parser = add_vision_args(parser)
    parser = _add_moe_args(parser)
    parser = _add_logging_args(parser)
    parser = _add_straggler_detector_args(parser)
    parser = _add_inference_args(parser)
    parser = _add_transformer_engine_args(parser)
    parser = add_retro_args(parser)
    parser = _add_experimental_args(parser)
    parser = add_one_logger_args(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def core_transformer_config_from_args(args, config_class=None):
    """Build the core `TransformerConfig` from args: the one place args become a model config.

    Every dataclass field with a same-named arg is copied; the remaining fields are mapped from
    Megatron's differently named flags.
    """
    if config_class is None:
        from megatron.core.transformer.transformer_config import TransformerConfig

        config_class = TransformerConfig
    kw_args = {}
    for f in dataclasses.fields(config_class):
        if hasattr(args, f.name):
            kw_args[f.name] = getattr(args, f.name)
    names = {f.name for f in dataclasses.fields(config_class)}

    def put(name, value):
        if name in names:
            kw_args[name] = value

    put('persist_layer_norm', not args.no_persist_layer_norm)
    put('layernorm_zero_centered_gamma', args.apply_layernorm_1p)
    put('layernorm_epsilon', args.norm_epsilon)
    put('deallocate_pipeline_outputs', True)
    put('pipeline_dtype', args.params_dtype)
    put('batch_p2p_comm', not args.overlap_p2p_comm)
    put('num_moe_experts', args.num_experts)
    put('rotary_interleaved', args.rotary_interleaved)
    if args.swiglu:
        put('activation_func', F.silu)
        put('gated_linear_unit', True)
        put('bias_activation_fusion', args.bias_swiglu_fusion)
    else:
        put('bias_activation_fusion', args.bias_gelu_fusion)
    if args.squared_relu:
        if args.swiglu:
            raise ValueError('--squared-relu and --swiglu are mutually exclusive')

        put('activation_func', squared_relu)
    if args.openai_gelu:
        put('activation_func', openai_gelu)
    if args.init_method_xavier_uniform:
        put('init_method', torch.nn.init.xavier_uniform_)
        put('scaled_init_method', torch.nn.init.xavier_uniform_)
    put('num_query_groups', args.num_query_groups if args.group_query_attention else None)
    return config_class(**kw_args)


# ---------------------------------------------------------------------------------------------
# argument groups


def _add_network_size_args(parser):
    group = parser.add_argument_group(title='network size')
    group.add_argument('--num-layers', type=int, default=None, help='Number of transformer layers.')
    group.add_argument(
        '--encoder-num-layers', type=int, default=None, help='Number of encoder transformer layers.'
    )
    group.add_argument(
        '--decoder-num-layers', type=int, default=None, help='Number of decoder transformer layers.'
    )
    group.add_argument('--hidden-size', type=int, default=None, help='Transformer hidden size.')
    group.add_argument(
        '--ffn-hidden-size',
        type=int,
        default=None,
        help='Transformer Feed-Forward Network hidden size. Defaults to 4*hidden-size '
        '(about 8/3*hidden-size rounded to 64 with --swiglu).',
    )
    group.add_argument(
        '--num-attention-heads',
        type=int,
        default=None,
        help='Number of transformer attention heads.',
    )
    group.add_argument(
        '--kv-channels',
        type=int,
        default=None,
        help='Projection weights dimension in multi-head attention. Defaults to '
        'hidden-size / num-attention-heads.',
    )
    group.add_argument(
        '--group-query-attention', action='store_true', help='Use group-query attention.'
    )
    group.add_argument(
        '--num-query-groups',
        type=int,
        default=1,
        help='Number of query groups with --group-query-attention.',
    )
    group.add_argument(
        '--max-position-embeddings',
        type=int,
        default=None,
        help='Maximum number of position embeddings to use. This is the size of '
        'position embedding.',
    )
    group.add_argument(
        '--position-embedding-type',
        type=str,
        default='learned_absolute',
        choices=['learned_absolute', 'rope', 'none'],
        help='Position embedding type.',
    )
    group.add_argument(
        '--use-rotary-position-embeddings',
        action='store_true',
        help='Use rotary positional embeddings or not. Deprecated: use '
        '--position-embedding-type rope.',
    )
    group.add_argument(
        '--rotary-base',
        type=int,
        default=10000,
        help='Base to use for rotary positional embeddings.',
    )
    group.add_argument(
        '--rotary-percent', type=float, default=1.0, help='Percent of rotary dimension to use.'
    )
    group.add_argument(
        '--rotary-interleaved', action='store_true', help='Use interleaved rotary embedding.'
    )
    group.add_argument(
        '--rotary-seq-len-interpolation-factor',
        type=int,
        default=None,
        help='Sequence length interpolation factor for rotary embeddings.',
    )
    group.add_argument(
        '--no-position-embedding',
        action='store_false',
        dest='add_position_embedding',
        help='Disable position embedding. Deprecated: use --position-embedding-type none.',
    )
    group.add_argument(
        '--make-vocab-size-divisible-by',
        type=int,
        default=128,
        help='Pad the vocab size to be divisible by this value times the tensor '
        'model parallel size.',
    )
    group.add_argument(
        '--normalization',
        default='LayerNorm',
        choices=['LayerNorm', 'RMSNorm'],
        help='Which normalization technique to use.',
    )
    group.add_argument(
        '--norm-epsilon', type=float, default=1e-5, help='Epsilon for layer norm and RMS norm.'
    )
    group.add_argument(
        '--apply-layernorm-1p',
        action='store_true',
        help='Adjust LayerNorm weights such that they are centered around zero.',
    )
    group.add_argument(
        '--apply-residual-connection-post-layernorm',
        action='store_true',
        help='If set, use original BERT residual connection ordering.',
    )
    group.add_argument(
        '--openai-gelu',
        action='store_true',
        help='Use OpenAIs GeLU implementation (for backward compatibility).',
    )
    group.add_argument(
        '--squared-relu',
        action='store_true',
        help='Use squared relu activation instead of default gelu.',
    )
    group.add_argument(
        '--swiglu',
        action='store_true',
        help='Use gated linear units and SiLU activation instead of default gelu.',
    )
    group.add_argument(
        '--onnx-safe',
        type=bool,
        required=False,
        help='Use workarounds for known problems with Torch ONNX exporter.',
    )
    group.add_argument(
        '--bert-no-binary-head',
        action='store_false',
        dest='bert_binary_head',
        help='Disable BERT binary head.',
    )
    group.add_argument(
        '--qk-layernorm',
        action='store_true',
        help='Whether to layer normalize the q and k attention embeddings.',
    )
    group.add_argument(
        '--untie-embeddings-and-output-weights',
        action='store_true',
        help='Untie embeddings and output weights.',
    )
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group(title='regularization')
    group.add_argument(
        '--attention-dropout', type=float, default=0.1, help='Post attention dropout probability.'
    )
    group.add_argument(
        '--hidden-dropout',
        type=float,
        default=0.1,
        help='Dropout probability for hidden state transformer.',
    )
    group.add_argument(
        '--weight-decay',
        type=float,
        default=0.01,
        help='Weight decay coefficient for L2 regularization.',
    )
    group.add_argument(
        '--start-weight-decay',
        type=float,
        help='Initial weight decay coefficient for L2 regularization.',
    )
    group.add_argument(
        '--end-weight-decay',
        type=float,
        help='End of run weight decay coefficient for L2 regularization.',
    )
    group.add_argument(
        '--weight-decay-incr-style',
        type=str,
        default='constant',
        choices=['constant', 'linear', 'cosine'],
        help='Weight decay increment function.',
    )
    group.add_argument(
        '--clip-grad', type=float, default=1.0, help='Gradient clipping based on global L2 norm.'
    )
    group.add_argument(
        '--adam-beta1',
        type=float,
        default=0.9,
        help='First coefficient for computing running averages of gradient and its square',
    )
    group.add_argument(
        '--adam-beta2',
        type=float,
        default=0.999,
        help='Second coefficient for computing running averages of gradient and its square',
    )
    group.add_argument(
        '--adam-eps',
        type=float,
        default=1e-08,
        help='Term added to the denominator to improve numerical stability',
    )
    group.add_argument('--sgd-momentum', type=float, default=0.9, help='Momentum factor for sgd')
    return parser


def _add_training_args(parser):
    group = parser.add_argument_group(title='training')
    group.add_argument(
        '--micro-batch-size',
        type=int,
        default=None,
        help='Batch size per model instance (local batch size). Global batch size is '
        'local batch size times data parallel size times number of micro batches.',
    )
    group.add_argument(
        '--batch-size',
        type=int,
        default=None,
        help='Old batch size parameter, do not use. Use --micro-batch-size instead',
    )
    group.add_argument(
        '--global-batch-size',
        type=int,
        default=None,
        help='Training batch size. If set, it should be a multiple of micro-batch-size '
        'times data-parallel-size. Defaults to micro-batch-size times data-parallel-size.',
    )
    group.add_argument(
        '--rampup-batch-size',
        nargs='*',
        default=None,
        help='Batch size ramp up with the following values: <start batch size> '
        '<batch size increment> <ramp-up samples>.',
    )
    group.add_argument(
        '--decrease-batch-size-if-needed',
        action='store_true',
        help='If set, decrease batch size if microbatch_size * dp_size does not divide '
        'batch_size (useful for KSO).',
    )
    group.add_argument(
        '--recompute-activations',
        action='store_true',
        help='recompute activation to allow for training with larger models, sequences, '
        'and batch sizes.',
    )
    group.add_argument(
        '--recompute-granularity',
        type=str,
        default=None,
        choices=['full', 'selective'],
        help='Checkpoint activations to allow for training with larger models, sequences, '
        'and batch sizes: full or selective.',
    )
    group.add_argument(
        '--no-check-for-nan-in-loss-and-grad',
        action='store_false',
        dest='check_for_nan_in_loss_and_grad',
        help='Check for NaNs in loss and grad',
    )
    group.add_argument(
        '--distribute-saved-activations',
        action='store_true',
        help='If set, distribute recomputed activations across model parallel group.',
    )
    group.add_argument(
        '--recompute-method',
        type=str,
        default=None,
        choices=['uniform', 'block'],
        help='uniform: divide the layers into chunks and recompute each chunk; block: '
        'recompute the first --recompute-num-layers layers of each stage.',
    )
    group.add_argument(
        '--recompute-num-layers',
        type=int,
        default=None,
        help='Number of layers (per chunk or per stage) recomputed with --recompute-method.',
    )
    group.add_argument(
        '--no-clone-scatter-output-in-embedding',
        action='store_false',
        dest='clone_scatter_output_in_embedding',
        help=(
            'If not set, clone the output of the scatter in embedding layer to GC original tensor.'
        ),
    )
    group.add_argument('--profile', action='store_true', help='Enable torch profiling.')
    group.add_argument(
        '--profile-step-start', type=int, default=10, help='Global step to start profiling.'
    )
    group.add_argument(
        '--profile-step-end', type=int, default=12, help='Global step to stop profiling.'
    )
    group.add_argument(
        '--profile-ranks', nargs='+', type=int, default=[0], help='Global ranks to profile.'
    )
    group.add_argument(
        '--tp-comm-overlap',
        action='store_true',
        default=False,
        help=(
            'Enables the overlap of Tensor parallel communication and GEMM kernels'
            ' (TE only; unused).'
        ),
    )
    group.add_argument(
        '--checkpoint-activations',
        action='store_true',
        help='Checkpoint activation (deprecated: use --recompute-activations).',
    )
    group.add_argument(
        '--train-iters',
        type=int,
        default=None,
        help='Total number of iterations to train over all training runs. Note that '
        'either train-iters or train-samples should be provided.',
    )
    group.add_argument(
        '--train-samples',
        type=int,
        default=None,
        help='Total number of samples to train over all training runs. Note that either '
        'train-iters or train-samples should be provided.',
    )
    group.add_argument(
        '--log-interval', type=int, default=100, help='Report loss and timing interval.'
    )
    group.add_argument(
        '--exit-interval',
        type=int,
        default=None,
        help='Exit the program after the iteration is divisible by this value.',
    )
    group.add_argument(
        '--exit-duration-in-mins',
        type=int,
        default=None,
        help='Exit the program after this many minutes.',
    )
    group.add_argument(
        '--exit-signal-handler',
        action='store_true',
        help='Dynamically save the checkpoint and shutdown the training if SIGTERM is received',
    )
    group.add_argument(
        '--tensorboard-dir',
        type=str,
        default=None,
        help='Write TensorBoard logs to this directory.',
    )
    group.add_argument(
        '--no-masked-softmax-fusion',
        action='store_false',
        dest='masked_softmax_fusion',
        help='Disable fusion of query_key_value scaling, masking, and softmax.',
    )
    group.add_argument(
        '--no-bias-gelu-fusion',
        action='store_false',
        dest='bias_gelu_fusion',
        help='Disable bias and gelu fusion.',
    )
    group.add_argument(
        '--no-bias-swiglu-fusion',
        action='store_false',
        dest='bias_swiglu_fusion',
        help=(
            'Disable bias and swiglu fusion, the fusion is available only when using megatron-core.'
        ),
    )
    group.add_argument(
        '--no-bias-dropout-fusion',
        action='store_false',
        dest='bias_dropout_fusion',
        help='Disable bias and dropout fusion.',
    )
    group.add_argument(
        '--no-rope-fusion',
        action='store_false',
        dest='apply_rope_fusion',
        help='Disable rope fusion, the fusion is available only when using megatron-core.',
    )
    group.add_argument(
        '--cross-entropy-loss-fusion',
        action='store_true',
        help='Enabled fusion of cross entropy loss calculation.',
    )
    group.add_argument(
        '--use-flash-attn',
        action='store_true',
        help='use FlashAttention implementation of attention.',
    )
    group.add_argument(
        '--disable-bias-linear',
        action='store_false',
        dest='add_bias_linear',
        help='Disable bias in the linear layers',
    )
    group.add_argument(
        '--add-qkv-bias', action='store_true', help='Enable bias only in the QKV linear layers'
    )
    group.add_argument(
        '--optimizer', type=str, default='adam', choices=['adam', 'sgd'], help='Optimizer function'
    )
    group.add_argument(
        '--dataloader-type',
        type=str,
        default=None,
        choices=['single', 'cyclic', 'external'],
        help='Single pass vs multiple pass data loader',
    )
    group.add_argument(
        '--no-async-tensor-model-parallel-allreduce',
        action='store_false',
        dest='async_tensor_model_parallel_allreduce',
        help='DEPRECATED. This flag is ignored.',
    )
    group.add_argument(
        '--no-persist-layer-norm',
        action='store_true',
        help='Disable using persistent fused layer norm kernel.',
    )
    group.add_argument(
        '--sequence-parallel', action='store_true', help='Enable sequence parallel optimization.'
    )
    group.add_argument(
        '--no-gradient-accumulation-fusion',
        action='store_false',
        dest='gradient_accumulation_fusion',
        help='Disable fusing gradient accumulation to weight gradient computation of linear layers',
    )
    group.add_argument(
        '--use-mcore-models',
        action='store_true',
        dest='deprecated_use_mcore_models',
        help='DEPRECATED. Use the implementation from megatron core. Now ignored and mcore '
        'models are the default, use --use-legacy-models to not use core models.',
    )
    group.add_argument(
        '--use-legacy-models',
        action='store_true',
        help='Use the legacy Megatron models, not Megatron-Core models.',
    )
    group.add_argument(
        '--manual-gc',
        action='store_true',
        help='Disable the threshold-based default garbage collector.',
    )
    group.add_argument(
        '--manual-gc-interval',
        type=int,
        default=0,
        help='Training step interval to trigger manual garbage collection.',
    )
    group.add_argument(
        '--no-manual-gc-eval',
        action='store_false',
        dest='manual_gc_eval',
        help='When using manual garbage collection, disable garbage collection at the start '
        'and the end of each evaluation run.',
    )
    group.add_argument(
        '--disable-tp-comm-split-ag',
        action='store_false',
        dest='tp_comm_split_ag',
        help='Disables the All-Gather overlap with fprop GEMM (TE only; unused).',
    )
    group.add_argument(
        '--disable-tp-comm-split-rs',
        action='store_false',
        dest='tp_comm_split_rs',
        help='Disables the Reduce-Scatter overlap with fprop GEMM (TE only; unused).',
    )
    group.add_argument(
        '--calculate-per-token-loss',
        action='store_true',
        help='Scale cross entropy loss by the number of non-padded tokens in the global '
        'batch, versus the default behavior of assuming all tokens are non-padded.',
    )
    group.add_argument(
        '--deterministic-mode',
        action='store_true',
        help='Choose code that has deterministic execution.',
    )
    group.add_argument(
        '--defer-embedding-wgrad-compute',
        action='store_true',
        default=False,
        dest='defer_embedding_wgrad_compute',
        help='If set, defers the vocabulary projection linear layer weight gradient '
        'compute to pipeline flush (only with pipeline parallelism).',
    )
    group.add_argument(
        '--wgrad-deferral-limit',
        type=int,
        default=0,
        dest='wgrad_deferral_limit',
        help='Number of micro-batches for which weight gradient computation of '
        'vocabulary projection is deferred, defaults to 0 which means all the '
        'micro-batches are deferred. Invalid if `defer-embedding-wgrad-compute` '
        'is not set',
    )
    group.add_argument(
        '--check-weight-hash-across-dp-replicas-interval',
        type=int,
        default=None,
        help='Interval to check weight hashes are same across DP replicas. If not '
        'specified, weight hashes not checked.',
    )
    return add_tp_comm_overlap_args(parser)


def _add_initialization_args(parser):
    group = parser.add_argument_group(title='initialization')
    group.add_argument(
        '--seed',
        type=int,
        default=1234,
        help='Random seed used for python, numpy, pytorch, and cuda.',
    )
    group.add_argument(
        '--data-parallel-random-init',
        action='store_true',
        help='Enable random initialization of params across data parallel ranks',
    )
    group.add_argument(
        '--init-method-std',
        type=float,
        default=0.02,
        help=(
            'Standard deviation of the zero mean normal distribution used'
            ' for weight initialization.'
        ),
    )
    group.add_argument(
        '--init-method-xavier-uniform',
        action='store_true',
        help='Enable Xavier uniform parameter initialization',
    )
    return parser


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title='learning rate')
    group.add_argument(
        '--lr',
        type=float,
        default=None,
        help='Initial learning rate. Depending on decay style and initial warmup, the '
        'learning rate at each iteration would be different.',
    )
    group.add_argument(
        '--lr-decay-style',
        type=str,
        default='linear',
        choices=['constant', 'linear', 'cosine', 'inverse-square-root', 'WSD'],
        help='Learning rate decay function.',
    )
    group.add_argument(
        '--lr-wsd-decay-style',
        type=str,
        default='exponential',
        choices=['exponential', 'linear', 'cosine'],
        help='Decay style for the annealing phase of WSD',
    )
    group.add_argument(
        '--lr-decay-iters',
        type=int,
        default=None,
        help=(
            'number of iterations to decay learning rate over, If None defaults to `--train-iters`'
        ),
    )
    group.add_argument(
        '--lr-decay-samples',
        type=int,
        default=None,
        help='number of samples to decay learning rate over, If None defaults to `--train-samples`',
    )
    group.add_argument(
        '--lr-wsd-decay-samples',
        type=int,
        default=None,
        help='number of samples for the annealing phase in the wsd schedule',
    )
    group.add_argument(
        '--lr-wsd-decay-iters',
        type=int,
        default=None,
        help='number of iterations for the annealing phase in the wsd schedule',
    )
    group.add_argument(
        '--lr-warmup-fraction',
        type=float,
        default=None,
        help='fraction of lr-warmup-(iters/samples) to use for warmup (as a float)',
    )
    group.add_argument(
        '--lr-warmup-iters',
        type=int,
        default=0,
        help='number of iterations to linearly warmup learning rate over.',
    )
    group.add_argument(
        '--lr-warmup-samples',
        type=int,
        default=0,
        help='number of samples to linearly warmup learning rate over.',
    )
    group.add_argument(
        '--lr-warmup-init',
        type=float,
        default=0.0,
        help='Initial value for learning rate warmup. The scheduler starts warmup from this value.',
    )
    group.add_argument(
        '--warmup',
        type=int,
        default=None,
        help='Old lr warmup argument, do not use. Use one of the --lr-warmup-* arguments above',
    )
    group.add_argument(
        '--min-lr',
        type=float,
        default=0.0,
        help='Minimum value for learning rate. The scheduler clip values below this threshold.',
    )
    group.add_argument(
        '--override-opt_param-scheduler',
        action='store_true',
        help='Reset the values of the scheduler (learning rate, warmup iterations, minimum '
        'learning rate, maximum number of iterations, and decay style from input arguments '
        'and ignore values from checkpoints.',
    )
    group.add_argument(
        '--use-checkpoint-opt_param-scheduler',
        action='store_true',
        help='Use checkpoint to set the values of the scheduler (learning rate, warmup '
        'iterations, minimum learning rate, maximum number of iterations, and decay style '
        'from checkpoint and ignore input arguments.',
    )
    group.add_argument(
        '--decoupled-lr',
        type=float,
        default=None,
        help='Separate learning rate for the input and output layer',
    )
    group.add_argument(
        '--decoupled-min-lr',
        type=float,
        default=None,
        help='Minimum value for learning rate for the input and output layer.',
    )
    return parser


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title='checkpointing')
    group.add_argument(
        '--save', type=str, default=None, help='Output directory to save checkpoints to.'
    )
    group.add_argument(
        '--save-interval',
        type=int,
        default=None,
        help='Number of iterations between checkpoint saves.',
    )
    group.add_argument(
        '--no-save-optim', action='store_true', default=None, help='Do not save current optimizer.'
    )
    group.add_argument(
        '--no-save-rng', action='store_true', default=None, help='Do not save current rng state.'
    )
    group.add_argument(
        '--load', type=str, default=None, help='Directory containing a model checkpoint.'
    )
    group.add_argument(
        '--no-load-optim',
        action='store_true',
        default=None,
        help='Do not load optimizer when loading checkpoint.',
    )
    group.add_argument(
        '--no-load-rng',
        action='store_true',
        default=None,
        help='Do not load rng state when loading checkpoint.',
    )
    group.add_argument(
        '--non-persistent-save-interval',
        type=int,
        default=None,
        help='Number of iterations between non-persistent saves.',
    )
    group.add_argument(
        '--non-persistent-ckpt-type',
        type=str,
        default=None,
        choices=['global', 'local', 'in_memory', None],
        help='Type of non-persistent model checkpoints.',
    )
    group.add_argument(
        '--non-persistent-global-ckpt-dir',
        type=str,
        default=None,
        help='Directory containing global non-persistent model checkpoints.',
    )
    group.add_argument(
        '--finetune',
        action='store_true',
        help='Load model for finetuning. Do not load optimizer or rng state from checkpoint '
        'and set iteration to 0. Assumed when loading a release checkpoint.',
    )
    group.add_argument(
        '--pretrained-checkpoint',
        type=str,
        default=None,
        help='Directory containing a pretrained model checkpoint for finetuning.',
    )
    group.add_argument(
        '--ckpt-step', type=int, default=None, help='Checkpoint step to load model from.'
    )
    group.add_argument(
        '--no-initialization',
        action='store_false',
        dest='perform_initialization',
        help='Do not perform initialization when building model, can reduce startup time '
        'when definitely loading from a checkpoint',
    )
    group.add_argument(
        '--use-checkpoint-args',
        action='store_true',
        help='Override any command line arguments with arguments from the checkpoint',
    )
    group.add_argument(
        '--exit-on-missing-checkpoint',
        action='store_true',
        help="If '--load' is set, but checkpoint is not found (e.g., path typo), then exit "
        'instead of random initialization.',
    )
    group.add_argument(
        '--use-dist-ckpt', action='store_true', help='Use distributed checkpoint format.'
    )
    group.add_argument(
        '--auto-detect-ckpt-format',
        action='store_true',
        help='Determine if the checkpoint format is in legacy or distributed format.',
    )
    group.add_argument(
        '--dist-ckpt-format',
        type=str,
        default='torch_dist',
        choices=['zarr', 'torch_dist'],
        help='Distributed checkpoint format to use.',
    )
    group.add_argument(
        '--ckpt-fully-parallel-save',
        action='store_true',
        dest='ckpt_fully_parallel_save_deprecated',
        help='Deprecated: see --no-ckpt-fully-parallel-save.',
    )
    group.add_argument(
        '--no-ckpt-fully-parallel-save',
        action='store_false',
        dest='ckpt_fully_parallel_save',
        help='Disable applying full save parallelization across DP for distributed '
        'checkpoints (no effect here: checkpoints are written in the torch format).',
    )
    group.add_argument(
        '--async-save',
        action='store_true',
        default=None,
        help='Apply async checkpointing save. Currently works only with '
        '`torch_dist` distributed checkpoint format.',
    )
    group.add_argument(
        '--ckpt-fully-parallel-load',
        action='store_true',
        help='Apply full load parallelization across DP for distributed checkpoints.',
    )
    group.add_argument(
        '--ckpt-assume-constant-structure',
        action='store_true',
        help='If the model and optimizer state dict structure is constant throughout a '
        'single training job, it allows for different checkpointing performance optimizations.',
    )
    group.add_argument(
        '--dist-ckpt-strictness',
        type=str,
        default='assume_ok_unexpected',
        choices=[
            'assume_ok_unexpected',
            'log_unexpected',
            'log_all',
            'raise_unexpected',
            'raise_all',
            'return_unexpected',
            'return_all',
            'ignore_all',
        ],
        help='Determine handling of key mismatch during checkpoint load (used by '
        'distributed checkpoints only; the torch format loads strictly).',
    )
    return parser


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title='mixed precision')
    group.add_argument('--fp16', action='store_true', help='Run model in fp16 mode.')
    group.add_argument('--bf16', action='store_true', help='Run model in bfloat16 mode.')
    group.add_argument(
        '--loss-scale',
        type=float,
        default=None,
        help='Static loss scaling, positive power of 2 values can improve fp16 convergence. '
        'If None, dynamic loss scaling is used.',
    )
    group.add_argument(
        '--initial-loss-scale',
        type=float,
        default=2**32,
        help='Initial loss-scale for dynamic loss scaling.',
    )
    group.add_argument(
        '--min-loss-scale',
        type=float,
        default=1.0,
        help='Minimum loss scale for dynamic loss scaling.',
    )
    group.add_argument(
        '--loss-scale-window',
        type=float,
        default=1000,
        help='Window over which to raise/lower dynamic scale.',
    )
    group.add_argument(
        '--hysteresis', type=int, default=2, help='hysteresis for dynamic loss scaling'
    )
    group.add_argument(
        '--fp32-residual-connection', action='store_true', help='Move residual connections to fp32.'
    )
    group.add_argument(
        '--apply-query-key-layer-scaling',
        action='store_true',
        help='Scale Q * K^T by 1 / layer-number. Useful for fp16 training.',
    )
    group.add_argument(
        '--attention-softmax-in-fp32',
        action='store_true',
        help='Run attention masking and softmax in fp32.',
    )
    group.add_argument(
        '--accumulate-allreduce-grads-in-fp32',
        action='store_true',
        help='Gradient accumulation and all-reduce in fp32.',
    )
    group.add_argument(
        '--fp16-lm-cross-entropy',
        action='store_true',
        help='Move the cross entropy unreduced loss calculation for lm head to fp16.',
    )
    return parser


def _add_distributed_args(parser):
    group = parser.add_argument_group(title='distributed')
    group.add_argument(
        '--tensor-model-parallel-size',
        type=int,
        default=1,
        help='Degree of tensor model parallelism.',
    )
    group.add_argument(
        '--pipeline-model-parallel-size',
        type=int,
        default=1,
        help='Degree of pipeline model parallelism.',
    )
    group.add_argument(
        '--pipeline-model-parallel-split-rank',
        type=int,
        default=None,
        help='Rank where encoder and decoder should be split.',
    )
    group.add_argument(
        '--model-parallel-size',
        type=int,
        default=None,
        help='Old model parallel argument, do not use. Use --tensor-model-parallel-size instead.',
    )
    group.add_argument(
        '--num-layers-per-virtual-pipeline-stage',
        type=int,
        default=None,
        help='Number of layers per virtual pipeline stage',
    )
    group.add_argument(
        '--no-overlap-p2p-communication',
        action='store_false',
        dest='overlap_p2p_comm',
        help='overlap pipeline parallel communication with forward and backward chunks',
    )
    group.add_argument(
        '--distributed-backend',
        default='nccl',
        choices=['nccl', 'gloo'],
        help='Which backend to use for distributed training (gloo is used when no GPU exists).',
    )
    group.add_argument(
        '--watchdog-timeout',
        type=float,
        default=300.0,
        help='Seconds a rank may go without progress (a training step or '
        'evaluation running that long, or no heartbeat from a rank) before the '
        'job reports which rank, which operation and how long, and exits with '
        'code 3. 0 disables. Not a Megatron flag.',
    )
    group.add_argument(
        '--distributed-timeout-minutes',
        type=int,
        default=10,
        help='Timeout minutes for torch.distributed.',
    )
    group.add_argument(
        '--overlap-grad-reduce',
        action='store_true',
        default=False,
        help='If set, overlap DDP grad reduce.',
    )
    group.add_argument(
        '--no-delay-grad-reduce',
        action='store_false',
        dest='delay_grad_reduce',
        help='If not set, delay / synchronize grad reductions in all but first PP stage.',
    )
    group.add_argument(
        '--ddp-bucket-size',
        type=int,
        default=None,
        help='Bucket size for data-parallel communication',
    )
    group.add_argument(
        '--ddp-average-in-collective',
        action='store_true',
        default=False,
        help='If set, average directly in data-parallel communication collective.',
    )
    group.add_argument(
        '--overlap-param-gather',
        action='store_true',
        default=False,
        help='If set, overlap param all-gather in distributed optimizer.',
    )
    group.add_argument(
        '--delay-param-gather',
        action='store_true',
        default=False,
        help='If set, delay / synchronize param all-gathers in all but first PP stage.',
    )
    group.add_argument(
        '--no-scatter-gather-tensors-in-pipeline',
        action='store_false',
        dest='scatter_gather_tensors_in_pipeline',
        help='If not set, use scatter/gather to optimize communication of tensors in pipeline.',
    )
    group.add_argument(
        '--use-ring-exchange-p2p',
        action='store_true',
        default=False,
        help='If set, use custom-built ring exchange for p2p communications.',
    )
    group.add_argument(
        '--local-rank',
        '--local_rank',
        type=int,
        default=None,
        dest='local_rank',
        help='local rank passed from distributed launcher (defaults to $LOCAL_RANK).',
    )
    group.add_argument(
        '--lazy-mpu-init',
        type=bool,
        required=False,
        help='If set to True, initialize_megatron() skips DDP initialization and returns '
        'function to complete it instead.',
    )
    group.add_argument(
        '--standalone-embedding-stage',
        action='store_true',
        default=False,
        help='If set, *input* embedding layer is placed on its own pipeline stage.',
    )
    group.add_argument(
        '--use-distributed-optimizer', action='store_true', help='Use distributed optimizer.'
    )
    group.add_argument(
        '--context-parallel-size', type=int, default=1, help='Degree of context parallelism.'
    )
    group.add_argument(
        '--use-cpu-initialization',
        action='store_true',
        default=None,
        help='If set, initialize weights on the CPU. This eliminates init '
        'differences based on tensor parallelism.',
    )
    group.add_argument(
        '--empty-unused-memory-level',
        default=0,
        type=int,
        choices=[0, 1, 2],
        help='Call torch.cuda.empty_cache() each iteration (training and eval), '
        'to reduce fragmentation. 0=off, 1=moderate, 2=aggressive (no-op without '
        'CUDA).',
    )
    group.add_argument(
        '--nccl-communicator-config-path',
        type=str,
        default=None,
        help='Path to the yaml file with NCCL communicator configurations.',
    )
    group.add_argument(
        '--use-tp-pp-dp-mapping',
        action='store_true',
        default=False,
        help='If set, distributed ranks initialize order is changed from tp-dp-pp to tp-pp-dp.',
    )
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group(title='validation')
    group.add_argument(
        '--eval-iters',
        type=int,
        default=100,
        help='Number of iterations to run for evaluation validation/test for.',
    )
    group.add_argument(
        '--eval-interval',
        type=int,
        default=1000,
        help='Interval between running evaluation on validation set.',
    )
    group.add_argument(
        '--test-mode', action='store_true', help='Run all real-time test alongside the experiment.'
    )
    group.add_argument(
        '--skip-train',
        action='store_true',
        default=False,
        help=(
            'If set, bypass the training loop, optionally do evaluation'
            ' for validation/test, and exit.'
        ),
    )
    return parser


def _add_data_args(parser):
    group = parser.add_argument_group(title='data and dataloader')
    group.add_argument(
        '--data-path',
        nargs='*',
        default=None,
        help='The weight and prefix list for a set of train, validation, and test datasets '
        'which split according to --split. The accepted formats are: (1) a single prefix, '
        '(2) a list of weight prefix pairs e.g. weight1 prefix1 weight2 prefix2.',
    )
    group.add_argument(
        '--renormalize-blend-weights',
        action='store_true',
        help='Renormalize the blend weights to account for the mid-level dataset oversampling '
        'done to ensure fulfillment of the requested number of samples.',
    )
    group.add_argument(
        '--split',
        type=str,
        default=None,
        help='Comma-separated list of proportions for training, validation, and test split. '
        'Defaults to "969, 30, 1" when --data-path is given.',
    )
    group.add_argument(
        '--train-data-path',
        nargs='*',
        default=None,
        help='The weight and prefix list for an independent train dataset.',
    )
    group.add_argument(
        '--valid-data-path',
        nargs='*',
        default=None,
        help='The weight and prefix list for an independent validation dataset.',
    )
    group.add_argument(
        '--test-data-path',
        nargs='*',
        default=None,
        help='The weight and prefix list for an independent test dataset.',
    )
    group.add_argument(
        '--data-cache-path', default=None, help='Path to a directory to hold cached index files.'
    )
    group.add_argument(
        '--no-mmap-bin-files',
        action='store_false',
        dest='mmap_bin_files',
        help='Disable mmap-ing of .bin files.',
    )
    group.add_argument(
        '--mock-data',
        action='store_true',
        help='Skip data loading and validation and opt for artificial '
        'generation of mock data when an implementation is available.',
    )
    group.add_argument(
        '--seq-length', type=int, default=None, help='Maximum sequence length to process.'
    )
    group.add_argument(
        '--encoder-seq-length',
        type=int,
        default=None,
        help='Maximum encoder sequence length to process. This should be exclusive of --seq-length',
    )
    group.add_argument(
        '--decoder-seq-length',
        type=int,
        default=None,
        help='Maximum decoder sequence length to process.',
    )
    group.add_argument(
        '--retriever-seq-length',
        type=int,
        default=256,
        help='Maximum sequence length for the biencoder model for retriever',
    )
    group.add_argument(
        '--sample-rate',
        type=float,
        default=1.0,
        help='sample rate for training data. Supposed to be 0  < sample_rate < 1',
    )
    group.add_argument(
        '--mask-prob', type=float, default=0.15, help='Probability of replacing a token with mask.'
    )
    group.add_argument(
        '--short-seq-prob',
        type=float,
        default=0.1,
        help='Probability of producing a short sequence.',
    )
    group.add_argument('--num-workers', type=int, default=2, help='Dataloader number of workers.')
    group.add_argument(
        '--reset-position-ids',
        action='store_true',
        help='Reset posistion ids after end-of-document token.',
    )
    group.add_argument(
        '--reset-attention-mask',
        action='store_true',
        help='Reset self attention maske after end-of-document token.',
    )
    group.add_argument(
        '--eod-mask-loss', action='store_true', help='Mask loss for the end of document tokens.'
    )
    group.add_argument(
        '--no-create-attention-mask-in-dataloader',
        action='store_false',
        dest='create_attention_mask_in_dataloader',
        help='If set, do not create attention_masks in dataloader.',
    )
    group.add_argument(
        '--num-dataset-builder-threads',
        type=int,
        default=1,
        help='Number of parallel threads per rank for dataset builder',
    )
    group.add_argument(
        '--s3-cache-path',
        type=str,
        default=None,
        help='Path to cache index files when using s3 dataloader',
    )
    return parser


def _add_tokenizer_args(parser):
    group = parser.add_argument_group(title='tokenizer')
    group.add_argument(
        '--vocab-size', type=int, default=None, help='Size of vocab before EOD or padding.'
    )
    group.add_argument('--vocab-file', type=str, default=None, help='Path to the vocab file.')
    group.add_argument('--merge-file', type=str, default=None, help='Path to the BPE merge file.')
    group.add_argument(
        '--vocab-extra-ids',
        type=int,
        default=0,
        help=(
            'Number of additional vocabulary tokens. They are used for span masking in the T5 model'
        ),
    )
    group.add_argument(
        '--tokenizer-type',
        type=str,
        default=None,
        choices=[
            'BertWordPieceLowerCase',
            'BertWordPieceCase',
            'GPT2BPETokenizer',
            'SentencePieceTokenizer',
            'GPTSentencePieceTokenizer',
            'HuggingFaceTokenizer',
            'Llama2Tokenizer',
            'Llama3Tokenizer',
            'MistralTokenizer',
            'TikTokenizer',
            'NullTokenizer',
        ],
        help='What type of tokenizer to use.',
    )
    group.add_argument(
        '--tokenizer-model', type=str, default=None, help='Sentencepiece tokenizer model.'
    )
    group.add_argument(
        '--tiktoken-pattern',
        type=str,
        default=None,
        help='Which tiktoken pattern to use. Options: [v1, v2]',
    )
    group.add_argument(
        '--tiktoken-num-special-tokens',
        type=int,
        default=1000,
        help='Number of special tokens in tiktoken tokenizer',
    )
    group.add_argument(
        '--tiktoken-special-tokens',
        type=str,
        nargs='+',
        default=None,
        help='List of tiktoken special tokens, needs to have ["<unk>", "<s>", "</s>"]',
    )
    return parser


def _add_autoresume_args(parser):
    group = parser.add_argument_group(title='autoresume')
    group.add_argument(
        '--adlr-autoresume',
        action='store_true',
        help='Enable autoresume on adlr cluster (not available in this package).',
    )
    group.add_argument(
        '--adlr-autoresume-interval',
        type=int,
        default=1000,
        help='Intervals over which check for autoresume termination signal',
    )
    return parser


def _add_moe_args(parser):
    group = parser.add_argument_group(title='moe')
    group.add_argument(
        '--expert-model-parallel-size',
        type=int,
        default=1,
        help='Degree of expert model parallelism.',
    )
    group.add_argument(
        '--num-experts', type=int, default=None, help='Number of Experts in MoE (None means no MoE)'
    )
    group.add_argument(
        '--moe-router-topk',
        type=int,
        default=2,
        help='Number of experts to route to for each token.',
    )
    group.add_argument(
        '--moe-router-load-balancing-type',
        type=str,
        default='aux_loss',
        choices=['aux_loss', 'sinkhorn', 'none'],
        help='Determines the load balancing strategy for the router.',
    )
    group.add_argument(
        '--moe-aux-loss-coeff',
        type=float,
        default=0.0,
        help='Scaling coefficient for the aux loss.',
    )
    group.add_argument(
        '--moe-z-loss-coeff', type=float, default=None, help='Scaling coefficient for the z-loss.'
    )
    group.add_argument(
        '--moe-grouped-gemm', action='store_true', help='Use grouped GEMM for experts.'
    )
    group.add_argument(
        '--moe-token-dispatcher-type',
        type=str,
        choices=['allgather', 'alltoall'],
        default='allgather',
        help='The type of token dispatcher to use.',
    )
    group.add_argument(
        '--moe-router-pre-softmax',
        action='store_true',
        help='Enable pre-softmax routing for MoE, which means softmax is before the '
        'top-k selection.',
    )
    group.add_argument(
        '--moe-input-jitter-eps',
        type=float,
        default=None,
        help='Add noise to the input tensor by applying jitter with a specified epsilon value.',
    )
    group.add_argument(
        '--moe-per-layer-logging',
        action='store_true',
        help='Enable per-layer logging for MoE, currently supports auxiliary loss and z loss.',
    )
    group.add_argument(
        '--moe-expert-capacity-factor',
        type=float,
        default=None,
        help='The capacity factor for each expert, None means no token will be dropped.',
    )
    group.add_argument(
        '--moe-pad-expert-input-to-capacity',
        action='store_true',
        help='Pads the input for each expert to match the expert capacity length.',
    )
    group.add_argument(
        '--moe-token-drop-policy',
        type=str,
        default='probs',
        choices=['probs', 'position'],
        help='The policy to drop tokens. Can be either "probs" or "position".',
    )
    group.add_argument(
        '--moe-layer-recompute',
        action='store_true',
        help='Enable checkpointing for moe_layer, should be used when memory is not sufficient.',
    )
    group.add_argument(
        '--moe-extended-tp',
        action='store_true',
        help='Alternative to expert parallelism, all experts are sharded across TPXEP domain.',
    )
    return parser


def _add_logging_args(parser):
    group = parser.add_argument_group(title='logging')
    group.add_argument(
        '--log-params-norm', action='store_true', help='If set, calculate and log parameters norm.'
    )
    group.add_argument(
        '--log-num-zeros-in-grad',
        action='store_true',
        help='If set, calculate and log the number of zeros in gradient.',
    )
    group.add_argument(
        '--log-throughput',
        action='store_true',
        help='If set, calculate and log throughput per GPU.',
    )
    group.add_argument(
        '--log-progress',
        action='store_true',
        help='If set, log progress (in terms of number of processed tokens and number of '
        'floating-point operations) to progress.txt file in checkpoint directory.',
    )
    group.add_argument(
        '--timing-log-level',
        type=int,
        default=0,
        choices=range(0, 3),
        help='Granularity level to measure and report timing. 0: report only iteration time; '
        '1: also forward-backward, optimizer and other one-off timers; 2: also finer '
        'timers such as forward-compute and communication.',
    )
    group.add_argument(
        '--no-barrier-with-level-1-timing',
        action='store_false',
        dest='barrier_with_L1_time',
        help='If not set, use barrier with level 1 time measurements.',
    )
    group.add_argument(
        '--timing-log-option',
        type=str,
        default='minmax',
        choices=['max', 'minmax', 'all'],
        help='Options for logging timing: max, minmax (min and max over ranks) or all ranks.',
    )
    group.add_argument(
        '--tensorboard-log-interval', type=int, default=1, help='Report to tensorboard interval.'
    )
    group.add_argument(
        '--tensorboard-queue-size',
        type=int,
        default=1000,
        help='Size of the tensorboard queue for pending events and summaries before one of the '
        "'add' calls forces a flush to disk.",
    )
    group.add_argument(
        '--log-timers-to-tensorboard',
        action='store_true',
        help='If set, write timers to tensorboard.',
    )
    group.add_argument(
        '--log-batch-size-to-tensorboard',
        action='store_true',
        help='If set, write batch-size to tensorboard.',
    )
    group.add_argument(
        '--no-log-learnig-rate-to-tensorboard',
        action='store_false',
        dest='log_learning_rate_to_tensorboard',
        help='Disable learning rate logging to tensorboard.',
    )
    group.add_argument(
        '--no-log-loss-scale-to-tensorboard',
        action='store_false',
        dest='log_loss_scale_to_tensorboard',
        help='Disable loss-scale logging to tensorboard.',
    )
    group.add_argument(
        '--log-validation-ppl-to-tensorboard',
        action='store_true',
        help='If set, write validation perplexity to tensorboard.',
    )
    group.add_argument(
        '--log-memory-to-tensorboard',
        action='store_true',
        help='Enable memory logging to tensorboard.',
    )
    group.add_argument(
        '--log-world-size-to-tensorboard',
        action='store_true',
        help='Enable world size logging to tensorboard.',
    )
    group.add_argument(
        '--wandb-project',
        type=str,
        default='',
        help='The wandb project name. Ignore wandb by default.',
    )
    group.add_argument('--wandb-exp-name', type=str, default='', help='The wandb experiment name.')
    group.add_argument(
        '--wandb-save-dir', type=str, default='', help='Path to save the wandb results locally.'
    )
    group.add_argument('--logging-level', type=int, default=None, help='Set default logging level')
    return parser


def _add_straggler_detector_args(parser):
    group = parser.add_argument_group(title='straggler')
    group.add_argument(
        '--log-straggler', action='store_true', help='If set, tracks and logs straggler per GPU.'
    )
    group.add_argument(
        '--disable-straggler-on-startup',
        action='store_true',
        help='If set, StragglerDetector is disabled on startup.',
    )
    group.add_argument(
        '--straggler-ctrlr-port',
        type=int,
        default=65535,
        help='Port number to toggle StragglerDetector on/off at runtime',
    )
    group.add_argument(
        '--straggler-minmax-count',
        type=int,
        default=1,
        help='Number of ranks to report with high/low estimated throughput',
    )
    return parser


def _add_inference_args(parser):
    group = parser.add_argument_group(title='inference')
    group.add_argument(
        '--inference-batch-times-seqlen-threshold',
        type=int,
        default=512,
        help='During inference, if batch-size times sequence-length is smaller than this '
        'threshold then we will not use pipelining, otherwise we will.',
    )
    group.add_argument(
        '--max-tokens-to-oom',
        type=int,
        default=12000,
        help='Maximum number of tokens during inference; tokens here is # in prompt + # to '
        'generate. Allows us to throw an error before OOM crashes server',
    )
    group.add_argument(
        '--output-bert-embeddings',
        action='store_true',
        help='Output Bert embeddings (via mean pooling) from model, rather than its binary head '
        'output or entire hidden batch.',
    )
    group.add_argument(
        '--bert-embedder-type',
        default='megatron',
        choices=['megatron', 'huggingface'],
        help='Select either Megatron or Huggingface as the Bert embedder.',
    )
    return parser


def _add_transformer_engine_args(parser):
    group = parser.add_argument_group(title='Transformer-Engine')
    group.add_argument(
        '--fp8-format',
        default=None,
        choices=['e4m3', 'hybrid'],
        dest='fp8',
        help='Which fp8 format scheme to use for FP8 tensors in the forward and backward pass '
        '(Transformer Engine only; not available here).',
    )
    group.add_argument('--fp8-margin', type=int, default=0, help='Scaling margin for fp8')
    group.add_argument(
        '--fp8-interval', type=int, default=1, help='Scaling update interval for fp8'
    )
    group.add_argument(
        '--fp8-amax-history-len',
        type=int,
        default=1,
        help='Number of steps for which amax history is recorded per tensor',
    )
    group.add_argument(
        '--fp8-amax-compute-algo',
        default='most_recent',
        choices=['most_recent', 'max'],
        help='Algorithm for computing amax from history',
    )
    group.add_argument(
        '--no-fp8-wgrad',
        action='store_false',
        dest='fp8_wgrad',
        help='Execute wgrad in higher precision even for FP8 runs',
    )
    group.add_argument(
        '--transformer-impl',
        default='transformer_engine',
        choices=['local', 'transformer_engine'],
        help='Which Transformer implementation to use (local is used when transformer_engine '
        'is not installed).',
    )
    return parser


def _add_experimental_args(parser):
    group = parser.add_argument_group(title='experimental')
    group.add_argument(
        '--spec',
        type=str,
        default=None,
        nargs='*',
        help='Specify the <module_location function_name> pair that returns a spec to customize '
        'a model, transformer block, or transformer layer.',
    )
    group.add_argument(
        '--hybrid-attention-ratio',
        type=float,
        default=0.0,
        help='Ratio of attention layers to total layers, in the range [0.0, 1.0].',
    )
    group.add_argument(
        '--hybrid-mlp-ratio',
        type=float,
        default=0.0,
        help='Ratio of mlp layers to total layers, in the range [0.0, 1.0].',
    )
    group.add_argument(
        '--hybrid-override-pattern',
        type=str,
        default=None,
        help='Force a specific hybrid layer pattern. If a value greater than 0.0 is '
        'supplied to any of the hybrid ratio arguments, then the number of each '
        'type of layer in the override pattern must match number in the overidden '
        'pattern',
    )
    group.add_argument(
        '--torch-compile',
        action='store_true',
        help='Compile each transformer layer with torch.compile (this package only; '
        'off by default). The first iterations pay the compilation.',
    )
    group.add_argument(
        '--yaml-cfg',
        type=str,
        default=None,
        help='Config file to add additional arguments (not required; not supported here).',
    )
    return parser
