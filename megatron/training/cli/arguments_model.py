"""Megatron's command-line flags, model and optimization groups: network size, regularization,
training, initialization, learning rate, mixed precision, MoE (in arguments_moe.py), inference,
Transformer Engine and experimental flags (one `_add_*_args(parser)` per argparse group, names
and defaults of Megatron core_r0.8.0 megatron/training/arguments.py). `arguments.get_args_parser`
assembles them.
"""

from megatron.training.cli.arguments_moe import _add_moe_args  # noqa: F401 (re-exported)
from megatron.training.cli.arguments_unsupported import add_tp_comm_overlap_args


def _add_network_size_args(parser):
    group = parser.add_argument_group(title='network size')
    group.add_argument(
        '--num-layers', type=int, default=None, help='Transformer layers of the model.'
    )
    group.add_argument(
        '--encoder-num-layers',
        type=int,
        default=None,
        help='Transformer layers of the encoder (encoder-decoder models).',
    )
    group.add_argument(
        '--decoder-num-layers',
        type=int,
        default=None,
        help='Transformer layers of the decoder (encoder-decoder models).',
    )
    group.add_argument('--hidden-size', type=int, default=None, help='Width of the hidden states.')
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
        help='Attention heads per layer.',
    )
    group.add_argument(
        '--kv-channels',
        type=int,
        default=None,
        help='Width of each attention head (default: hidden size / heads).',
    )
    group.add_argument(
        '--group-query-attention',
        action='store_true',
        help='Share key/value heads between groups of query heads (GQA).',
    )
    group.add_argument(
        '--num-query-groups',
        type=int,
        default=1,
        help='Key/value head count with --group-query-attention.',
    )
    group.add_argument(
        '--max-position-embeddings',
        type=int,
        default=None,
        help='Rows of the position-embedding table: the longest position the model can take.',
    )
    group.add_argument(
        '--position-embedding-type',
        type=str,
        default='learned_absolute',
        choices=['learned_absolute', 'rope', 'none'],
        help='How positions enter the model.',
    )
    group.add_argument(
        '--use-rotary-position-embeddings',
        action='store_true',
        help='Rotary position embeddings (deprecated; say --position-embedding-type rope).',
    )
    group.add_argument(
        '--rotary-base',
        type=int,
        default=10000,
        help='Base of the rotary frequencies.',
    )
    group.add_argument(
        '--rotary-percent',
        type=float,
        default=1.0,
        help='Fraction of each head the rotary embedding rotates.',
    )
    group.add_argument(
        '--rotary-interleaved',
        action='store_true',
        help='Rotate interleaved pairs of channels instead of the two halves.',
    )
    group.add_argument(
        '--rotary-seq-len-interpolation-factor',
        type=int,
        default=None,
        help='Divide rotary positions by this factor (position interpolation).',
    )
    group.add_argument(
        '--no-position-embedding',
        action='store_false',
        dest='add_position_embedding',
        help='No learned absolute positions (deprecated; say --position-embedding-type none).',
    )
    group.add_argument(
        '--make-vocab-size-divisible-by',
        type=int,
        default=128,
        help='Round the vocabulary up to a multiple of this times the tensor-parallel size.',
    )
    group.add_argument(
        '--normalization',
        default='LayerNorm',
        choices=['LayerNorm', 'RMSNorm'],
        help='Normalization layer of the blocks.',
    )
    group.add_argument(
        '--norm-epsilon', type=float, default=1e-5, help='Epsilon of LayerNorm / RMSNorm.'
    )
    group.add_argument(
        '--apply-layernorm-1p',
        action='store_true',
        help='LayerNorm weights stored as offsets from 1 (zero-centred).',
    )
    group.add_argument(
        '--apply-residual-connection-post-layernorm',
        action='store_true',
        help='Take the residual after the layer norm (the original BERT order).',
    )
    group.add_argument(
        '--openai-gelu',
        action='store_true',
        help='The tanh approximation of GeLU (as GPT-2), kept for old checkpoints.',
    )
    group.add_argument(
        '--squared-relu',
        action='store_true',
        help='Squared ReLU as the MLP activation instead of GeLU.',
    )
    group.add_argument(
        '--swiglu',
        action='store_true',
        help='SwiGLU MLP (SiLU-gated linear unit) instead of GeLU.',
    )
    group.add_argument(
        '--onnx-safe',
        type=bool,
        required=False,
        help='Avoid operations the torch ONNX exporter mishandles.',
    )
    group.add_argument(
        '--bert-no-binary-head',
        action='store_false',
        dest='bert_binary_head',
        help='BERT without the sentence-order (binary) head.',
    )
    group.add_argument(
        '--qk-layernorm',
        action='store_true',
        help='Normalize queries and keys before the attention product.',
    )
    group.add_argument(
        '--untie-embeddings-and-output-weights',
        action='store_true',
        help='Separate output-layer weights instead of the transposed input embedding.',
    )
    return parser


def _add_regularization_args(parser):
    group = parser.add_argument_group(title='regularization')
    group.add_argument(
        '--attention-dropout',
        type=float,
        default=0.1,
        help='Dropout on the attention probabilities.',
    )
    group.add_argument(
        '--hidden-dropout',
        type=float,
        default=0.1,
        help='Dropout on the hidden states after attention and MLP.',
    )
    group.add_argument(
        '--weight-decay',
        type=float,
        default=0.01,
        help='L2 weight-decay coefficient.',
    )
    group.add_argument(
        '--start-weight-decay',
        type=float,
        help='Weight decay at the first iteration (with an increment style).',
    )
    group.add_argument(
        '--end-weight-decay',
        type=float,
        help='Weight decay at the last iteration (with an increment style).',
    )
    group.add_argument(
        '--weight-decay-incr-style',
        type=str,
        default='constant',
        choices=['constant', 'linear', 'cosine'],
        help='How weight decay moves from its start to its end value.',
    )
    group.add_argument(
        '--clip-grad', type=float, default=1.0, help='Clip gradients to this global L2 norm.'
    )
    group.add_argument(
        '--adam-beta1',
        type=float,
        default=0.9,
        help='Adam decay rate of the first-moment (mean) estimate.',
    )
    group.add_argument(
        '--adam-beta2',
        type=float,
        default=0.999,
        help='Adam decay rate of the second-moment (squared) estimate.',
    )
    group.add_argument(
        '--adam-eps',
        type=float,
        default=1e-08,
        help='Adam epsilon, added to the denominator for stability.',
    )
    group.add_argument('--sgd-momentum', type=float, default=0.9, help='SGD momentum.')
    return parser


def _add_training_args(parser):
    group = parser.add_argument_group(title='training')
    group.add_argument(
        '--micro-batch-size',
        type=int,
        default=None,
        help='Samples per forward pass on one model replica; the global batch is this '
        'x data-parallel size x micro-batches.',
    )
    group.add_argument(
        '--batch-size',
        type=int,
        default=None,
        help='Removed; use --micro-batch-size.',
    )
    group.add_argument(
        '--global-batch-size',
        type=int,
        default=None,
        help='Samples per optimizer step, a multiple of micro-batch x data-parallel '
        'size (its default).',
    )
    group.add_argument(
        '--rampup-batch-size',
        nargs='*',
        default=None,
        help='Grow the global batch: <start size> <increment> <samples over which to ramp>.',
    )
    group.add_argument(
        '--decrease-batch-size-if-needed',
        action='store_true',
        help='Shrink the global batch to a multiple of micro-batch x data-parallel '
        'size when needed.',
    )
    group.add_argument(
        '--recompute-activations',
        action='store_true',
        help='Recompute activations in the backward pass to save memory (selective granularity).',
    )
    group.add_argument(
        '--recompute-granularity',
        type=str,
        default=None,
        choices=['full', 'selective'],
        help='Which activations to recompute in the backward pass: full layers or selected parts.',
    )
    group.add_argument(
        '--no-check-for-nan-in-loss-and-grad',
        action='store_false',
        dest='check_for_nan_in_loss_and_grad',
        help='Skip the NaN check of the loss and gradients.',
    )
    group.add_argument(
        '--distribute-saved-activations',
        action='store_true',
        help='Shard recomputation checkpoints over the tensor-parallel group.',
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
        '--profile-step-start', type=int, default=10, help='First profiled global step.'
    )
    group.add_argument(
        '--profile-step-end', type=int, default=12, help='Global step where profiling stops.'
    )
    group.add_argument(
        '--profile-ranks', nargs='+', type=int, default=[0], help='Ranks that profile.'
    )
    group.add_argument(
        '--tp-comm-overlap',
        action='store_true',
        default=False,
        help=(
            'Pipeline the sequence-parallel all-gather and reduce-scatter of the linear layers '
            'with their GEMMs (point-to-point sends round the tensor parallel ring); needs '
            '--sequence-parallel.'
        ),
    )
    group.add_argument(
        '--checkpoint-activations',
        action='store_true',
        help='Old name of --recompute-activations (deprecated).',
    )
    group.add_argument(
        '--train-iters',
        type=int,
        default=None,
        help='Iterations to train in all, over every restart (or give --train-samples).',
    )
    group.add_argument(
        '--train-samples',
        type=int,
        default=None,
        help='Samples to train in all, over every restart (or give --train-iters).',
    )
    group.add_argument(
        '--log-interval', type=int, default=100, help='Iterations between training log lines.'
    )
    group.add_argument(
        '--exit-interval',
        type=int,
        default=None,
        help='Stop once the iteration number is a multiple of this.',
    )
    group.add_argument(
        '--exit-duration-in-mins',
        type=int,
        default=None,
        help='Stop after this many minutes of training.',
    )
    group.add_argument(
        '--exit-signal-handler',
        action='store_true',
        help='On SIGTERM, save a checkpoint and stop.',
    )
    group.add_argument(
        '--tensorboard-dir',
        type=str,
        default=None,
        help='TensorBoard event-file directory.',
    )
    group.add_argument(
        '--no-masked-softmax-fusion',
        action='store_false',
        dest='masked_softmax_fusion',
        help='Unfused scale, mask and softmax in attention.',
    )
    group.add_argument(
        '--no-bias-gelu-fusion',
        action='store_false',
        dest='bias_gelu_fusion',
        help='Unfused bias add and GeLU.',
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
        help='Unfused bias add and dropout.',
    )
    group.add_argument(
        '--no-rope-fusion',
        action='store_false',
        dest='apply_rope_fusion',
        help='Unfused rotary embedding (the fused one exists for megatron-core models only).',
    )
    group.add_argument(
        '--cross-entropy-loss-fusion',
        action='store_true',
        help='Fused cross-entropy loss.',
    )
    group.add_argument(
        '--use-flash-attn',
        action='store_true',
        help='FlashAttention kernels for attention.',
    )
    group.add_argument(
        '--disable-bias-linear',
        action='store_false',
        dest='add_bias_linear',
        help='No biases in the linear layers.',
    )
    group.add_argument(
        '--add-qkv-bias', action='store_true', help='Biases in the QKV projection only.'
    )
    group.add_argument(
        '--optimizer',
        type=str,
        default='adam',
        choices=['adam', 'sgd', 'muon'],
        help='Optimizer.',
    )
    group.add_argument(
        '--dataloader-type',
        type=str,
        default=None,
        choices=['single', 'cyclic', 'external'],
        help='One pass over the data, or cycling through it.',
    )
    group.add_argument(
        '--no-async-tensor-model-parallel-allreduce',
        action='store_false',
        dest='async_tensor_model_parallel_allreduce',
        help='No effect (deprecated).',
    )
    group.add_argument(
        '--no-persist-layer-norm',
        action='store_true',
        help='Without the persistent fused LayerNorm kernel.',
    )
    group.add_argument(
        '--sequence-parallel',
        action='store_true',
        help='Shard activations along the sequence over the tensor-parallel group '
        'outside attention and MLP.',
    )
    group.add_argument(
        '--no-gradient-accumulation-fusion',
        action='store_false',
        dest='gradient_accumulation_fusion',
        help='Accumulate weight gradients in a separate step, not fused into the GEMM.',
    )
    group.add_argument(
        '--use-mcore-models',
        action='store_true',
        dest='deprecated_use_mcore_models',
        help='No effect: megatron-core models are the default (deprecated; see '
        '--use-legacy-models).',
    )
    group.add_argument(
        '--use-legacy-models',
        action='store_true',
        help='The legacy Megatron models instead of the megatron-core ones.',
    )
    group.add_argument(
        '--manual-gc',
        action='store_true',
        help='Turn off automatic garbage collection and collect at fixed intervals.',
    )
    group.add_argument(
        '--manual-gc-interval',
        type=int,
        default=0,
        help='Steps between manual garbage collections.',
    )
    group.add_argument(
        '--no-manual-gc-eval',
        action='store_false',
        dest='manual_gc_eval',
        help='With --manual-gc, no collection around evaluation runs.',
    )
    group.add_argument(
        '--disable-tp-comm-split-ag',
        action='store_false',
        dest='tp_comm_split_ag',
        help='With --tp-comm-overlap: no pipelined all-gather in the forward GEMMs.',
    )
    group.add_argument(
        '--disable-tp-comm-split-rs',
        action='store_false',
        dest='tp_comm_split_rs',
        help='With --tp-comm-overlap: no pipelined reduce-scatter in the forward GEMMs.',
    )
    group.add_argument(
        '--calculate-per-token-loss',
        action='store_true',
        help='Average the loss over the non-padded tokens of the global batch rather '
        'than per micro-batch.',
    )
    group.add_argument(
        '--deterministic-mode',
        action='store_true',
        help='Deterministic kernels only.',
    )
    group.add_argument(
        '--defer-embedding-wgrad-compute',
        action='store_true',
        default=False,
        dest='defer_embedding_wgrad_compute',
        help='Compute the output-layer weight gradient at the pipeline flush (pipeline '
        'parallelism only).',
    )
    group.add_argument(
        '--wgrad-deferral-limit',
        type=int,
        default=0,
        dest='wgrad_deferral_limit',
        help='Micro-batches whose output-layer weight gradient is deferred (0: all); '
        'needs --defer-embedding-wgrad-compute.',
    )
    group.add_argument(
        '--check-weight-hash-across-dp-replicas-interval',
        type=int,
        default=None,
        help='Every this many iterations, check that data-parallel replicas hold the '
        'same weights (off if unset).',
    )
    return add_tp_comm_overlap_args(parser)


def _add_initialization_args(parser):
    group = parser.add_argument_group(title='initialization')
    group.add_argument(
        '--seed',
        type=int,
        default=1234,
        help='Seed of the python, numpy, torch and CUDA generators.',
    )
    group.add_argument(
        '--data-parallel-random-init',
        action='store_true',
        help='Initialize weights differently on each data-parallel rank.',
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
        help='Xavier-uniform weight initialization.',
    )
    return parser


def _add_learning_rate_args(parser):
    group = parser.add_argument_group(title='learning rate')
    group.add_argument(
        '--lr',
        type=float,
        default=None,
        help='Peak learning rate; warm-up and decay shape the value of each iteration.',
    )
    group.add_argument(
        '--lr-decay-style',
        type=str,
        default='linear',
        choices=['constant', 'linear', 'cosine', 'inverse-square-root', 'WSD'],
        help='Shape of the learning-rate decay.',
    )
    group.add_argument(
        '--lr-wsd-decay-style',
        type=str,
        default='exponential',
        choices=['exponential', 'linear', 'cosine'],
        help='Shape of the annealing phase of the WSD schedule.',
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
        help='Samples over which the learning rate decays (default: --train-samples).',
    )
    group.add_argument(
        '--lr-wsd-decay-samples',
        type=int,
        default=None,
        help='Samples of the WSD annealing phase.',
    )
    group.add_argument(
        '--lr-wsd-decay-iters',
        type=int,
        default=None,
        help='Iterations of the WSD annealing phase.',
    )
    group.add_argument(
        '--lr-warmup-fraction',
        type=float,
        default=None,
        help='Warm-up length as a fraction of the decay length.',
    )
    group.add_argument(
        '--lr-warmup-iters',
        type=int,
        default=0,
        help='Iterations of linear learning-rate warm-up.',
    )
    group.add_argument(
        '--lr-warmup-samples',
        type=int,
        default=0,
        help='Samples of linear learning-rate warm-up.',
    )
    group.add_argument(
        '--lr-warmup-init',
        type=float,
        default=0.0,
        help='Learning rate at the start of warm-up.',
    )
    group.add_argument(
        '--warmup',
        type=int,
        default=None,
        help='Removed; use one of the --lr-warmup-* flags.',
    )
    group.add_argument(
        '--min-lr',
        type=float,
        default=0.0,
        help='Floor of the learning rate.',
    )
    group.add_argument(
        '--override-opt_param-scheduler',
        action='store_true',
        help='Take the scheduler settings (rates, warm-up, decay) from the command '
        'line, not the checkpoint.',
    )
    group.add_argument(
        '--use-checkpoint-opt_param-scheduler',
        action='store_true',
        help='Take the scheduler settings (rates, warm-up, decay) from the checkpoint, '
        'not the command line.',
    )
    group.add_argument(
        '--decoupled-lr',
        type=float,
        default=None,
        help='Own learning rate for the input and output layers.',
    )
    group.add_argument(
        '--decoupled-min-lr',
        type=float,
        default=None,
        help='Own learning-rate floor for the input and output layers.',
    )
    return parser


def _add_mixed_precision_args(parser):
    group = parser.add_argument_group(title='mixed precision')
    group.add_argument(
        '--fp16', action='store_true', help='Half-precision (fp16) weights and compute.'
    )
    group.add_argument('--bf16', action='store_true', help='bfloat16 weights and compute.')
    group.add_argument(
        '--loss-scale',
        type=float,
        default=None,
        help='Fixed loss scale for fp16 (a power of 2 helps); dynamic scaling when unset.',
    )
    group.add_argument(
        '--initial-loss-scale',
        type=float,
        default=2**32,
        help='Starting value of the dynamic loss scale.',
    )
    group.add_argument(
        '--min-loss-scale',
        type=float,
        default=1.0,
        help='Lowest value of the dynamic loss scale.',
    )
    group.add_argument(
        '--loss-scale-window',
        type=float,
        default=1000,
        help='Clean iterations before the dynamic loss scale grows.',
    )
    group.add_argument(
        '--hysteresis',
        type=int,
        default=2,
        help='Overflows tolerated before the dynamic loss scale shrinks.',
    )
    group.add_argument(
        '--fp32-residual-connection', action='store_true', help='Keep the residual stream in fp32.'
    )
    group.add_argument(
        '--apply-query-key-layer-scaling',
        action='store_true',
        help='Divide Q K^T by the layer number (helps fp16).',
    )
    group.add_argument(
        '--attention-softmax-in-fp32',
        action='store_true',
        help='Masking and softmax of attention in fp32.',
    )
    group.add_argument(
        '--accumulate-allreduce-grads-in-fp32',
        action='store_true',
        help='Accumulate and all-reduce gradients in fp32.',
    )
    group.add_argument(
        '--fp16-lm-cross-entropy',
        action='store_true',
        help='Unreduced LM-head cross entropy in fp16.',
    )
    return parser


def _add_inference_args(parser):
    group = parser.add_argument_group(title='inference')
    group.add_argument(
        '--inference-batch-times-seqlen-threshold',
        type=int,
        default=512,
        help='At inference, pipeline micro-batches only when batch x sequence length reaches this.',
    )
    group.add_argument(
        '--max-tokens-to-oom',
        type=int,
        default=12000,
        help='Most prompt + generated tokens a request may ask for (refused before '
        'running out of memory).',
    )
    group.add_argument(
        '--output-bert-embeddings',
        action='store_true',
        help='Return mean-pooled BERT embeddings instead of the binary head output or '
        'hidden states.',
    )
    group.add_argument(
        '--bert-embedder-type',
        default='megatron',
        choices=['megatron', 'huggingface'],
        help='BERT embedder implementation: Megatron or Hugging Face.',
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
    group.add_argument('--fp8-margin', type=int, default=0, help='fp8 scaling margin.')
    group.add_argument(
        '--fp8-interval', type=int, default=1, help='Steps between fp8 scale updates.'
    )
    group.add_argument(
        '--fp8-amax-history-len',
        type=int,
        default=1,
        help='Length of the per-tensor amax history for fp8.',
    )
    group.add_argument(
        '--fp8-amax-compute-algo',
        default='most_recent',
        choices=['most_recent', 'max'],
        help='How the fp8 amax is derived from its history.',
    )
    group.add_argument(
        '--no-fp8-wgrad',
        action='store_false',
        dest='fp8_wgrad',
        help='Weight gradients in higher precision in fp8 runs.',
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
        help='MODULE FUNCTION returning a custom spec of the model, block or layer.',
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
