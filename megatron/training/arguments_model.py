"""Megatron's command-line flags, model and optimization groups: network size, regularization,
training, initialization, learning rate, mixed precision, MoE (in arguments_moe.py), inference,
Transformer Engine and experimental flags (one `_add_*_args(parser)` per argparse group, names
and defaults of Megatron core_r0.8.0 megatron/training/arguments.py). `arguments.get_args_parser`
assembles them.
"""

from megatron.training.arguments_moe import _add_moe_args  # noqa: F401 (re-exported)
from megatron.training.arguments_unsupported import add_tp_comm_overlap_args


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
    group.add_argument(
        '--profile',
        action='store_true',
        help='Enable nsys profiling (a CUDA profiler range over the profiled steps; run under '
        'nsys profile --capture-range=cudaProfilerApi). With --use-pytorch-profiler, the torch '
        'profiler writes a trace (CPU and GPU) to --tensorboard-dir instead.',
    )
    group.add_argument(
        '--use-pytorch-profiler',
        action='store_true',
        help='Use the built-in pytorch profiler with --profile: one Chrome trace per profiled '
        'rank in --tensorboard-dir (open it in Perfetto or TensorBoard).',
    )
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
    # Dynamic batching (later Megatron's flag names; see docs/inference_engine.md).
    group.add_argument(
        '--inference-dynamic-batching',
        action='store_true',
        help='Serve / generate with the dynamic (continuous) batching engine over a paged KV '
        'cache instead of static batches.',
    )
    group.add_argument(
        '--inference-max-seq-length',
        type=int,
        default=None,
        help='Longest request (prompt + generated tokens) of the dynamic engine '
        '(default: --max-position-embeddings).',
    )
    group.add_argument(
        '--inference-dynamic-batching-buffer-size-gb',
        type=float,
        default=1.0,
        help='KV cache memory per rank, in GiB (Megatron defaults to 40 on GPUs).',
    )
    group.add_argument(
        '--inference-dynamic-batching-block-size',
        type=int,
        default=256,
        help='Tokens per KV cache block.',
    )
    group.add_argument(
        '--inference-dynamic-batching-max-requests',
        type=int,
        default=None,
        help='Most requests holding KV blocks at once (default: the number of blocks, at most '
        'the token budget and 256).',
    )
    group.add_argument(
        '--inference-dynamic-batching-max-tokens',
        type=int,
        default=None,
        help='Most tokens in one forward of the dynamic engine (default 16384).',
    )
    group.add_argument(
        '--enable-chunked-prefill',
        action='store_true',
        help='Split prompts that do not fit the remaining token budget of a step into chunks.',
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
        help='Megatron\'s experimental YAML run configuration: flags at the top level, the '
        'model in language_model / model_parallel; its values replace the command line\'s.',
    )
    return parser
