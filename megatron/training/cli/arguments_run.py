"""Megatron's command-line flags, run groups: checkpointing, distributed, validation, data,
tokenizer, autoresume, logging and straggler-detector flags (one `_add_*_args(parser)` per argparse
group, names and defaults of Megatron core_r0.8.0 megatron/training/arguments.py).
`arguments.get_args_parser` assembles them.
"""


def _add_checkpointing_args(parser):
    group = parser.add_argument_group(title='checkpointing')
    group.add_argument(
        '--save', type=str, default=None, help='Directory checkpoints are written to.'
    )
    group.add_argument(
        '--save-interval',
        type=int,
        default=None,
        help='Iterations between checkpoint saves.',
    )
    group.add_argument(
        '--no-save-optim',
        action='store_true',
        default=None,
        help='Leave the optimizer state out of saved checkpoints.',
    )
    group.add_argument(
        '--no-save-rng',
        action='store_true',
        default=None,
        help='Leave the RNG states out of saved checkpoints.',
    )
    group.add_argument('--load', type=str, default=None, help='Checkpoint directory to start from.')
    group.add_argument(
        '--no-load-optim',
        action='store_true',
        default=None,
        help='Ignore the optimizer state of the loaded checkpoint.',
    )
    group.add_argument(
        '--no-load-rng',
        action='store_true',
        default=None,
        help='Ignore the RNG states of the loaded checkpoint.',
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
        help='Start a new run from the loaded weights: no optimizer or RNG state, '
        'iteration 0 (implied by a release checkpoint).',
    )
    group.add_argument(
        '--pretrained-checkpoint',
        type=str,
        default=None,
        help='Checkpoint of a pretrained model to fine-tune from.',
    )
    group.add_argument(
        '--ckpt-step',
        type=int,
        default=None,
        help='Iteration of the checkpoint to load (default: the latest).',
    )
    group.add_argument(
        '--no-initialization',
        action='store_false',
        dest='perform_initialization',
        help='Skip weight initialization (faster start when a checkpoint is surely loaded).',
    )
    group.add_argument(
        '--use-checkpoint-args',
        action='store_true',
        help='Take the model-defining flags from the checkpoint, over the command line.',
    )
    group.add_argument(
        '--exit-on-missing-checkpoint',
        action='store_true',
        help="If '--load' is set, but checkpoint is not found (e.g., path typo), then exit "
        'instead of random initialization.',
    )
    group.add_argument(
        '--use-dist-ckpt',
        action='store_true',
        help='Use distributed checkpoint format (torch_dist): it loads at any parallel layout.',
    )
    group.add_argument(
        '--ckpt-format',
        type=str,
        default=None,
        choices=['torch', 'torch_dist', 'fsdp_dtensor'],
        help='Checkpoint format to save (later Megatron\'s flag; default torch, the legacy '
        'format; torch_dist = --use-dist-ckpt; fsdp_dtensor, later Megatron\'s FSDP format '
        'name, is an alias of torch_dist). Loading detects the format.',
    )
    group.add_argument(
        '--auto-detect-ckpt-format',
        action='store_true',
        help='Determine if the checkpoint format is in legacy or distributed format (loading '
        'always detects it here).',
    )
    group.add_argument(
        '--dist-ckpt-format',
        type=str,
        default='torch_dist',
        choices=['zarr', 'torch_dist'],
        help='Backend of the distributed checkpoint format.',
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
        'checkpoints (then the distributed optimizer state is gathered on DP rank 0: '
        'dp_zero_gather_scatter, reloadable at the same TP/PP only).',
    )
    group.add_argument(
        '--async-save',
        action='store_true',
        default=None,
        help='Write checkpoints in the background (torch_dist format only).',
    )
    group.add_argument(
        '--ckpt-fully-parallel-load',
        action='store_true',
        help='Spread the reads of a distributed checkpoint over the data-parallel ranks.',
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
        help='Determine handling of key mismatch during checkpoint load (distributed '
        'checkpoints; the torch format loads strictly).',
    )
    return parser


def _add_distributed_args(parser):
    group = parser.add_argument_group(title='distributed')
    group.add_argument(
        '--tensor-model-parallel-size',
        type=int,
        default=1,
        help='Tensor-parallel size.',
    )
    group.add_argument(
        '--pipeline-model-parallel-size',
        type=int,
        default=1,
        help='Pipeline-parallel size.',
    )
    group.add_argument(
        '--pipeline-model-parallel-split-rank',
        type=int,
        default=None,
        help='First pipeline stage of the decoder (encoder-decoder models).',
    )
    group.add_argument(
        '--model-parallel-size',
        type=int,
        default=None,
        help='Removed; use --tensor-model-parallel-size.',
    )
    group.add_argument(
        '--num-layers-per-virtual-pipeline-stage',
        type=int,
        default=None,
        help='Layers of each virtual pipeline chunk (interleaved schedule).',
    )
    group.add_argument(
        '--decoder-first-pipeline-num-layers',
        type=int,
        default=None,
        help='Layers on the first pipeline stage (the other stages share the rest evenly).',
    )
    group.add_argument(
        '--decoder-last-pipeline-num-layers',
        type=int,
        default=None,
        help='Layers on the last pipeline stage (the other stages share the rest evenly).',
    )
    group.add_argument(
        '--no-overlap-p2p-communication',
        action='store_false',
        dest='overlap_p2p_comm',
        help='Do not overlap pipeline sends and receives with the forward and backward chunks.',
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
        help='Timeout of torch.distributed collectives, in minutes.',
    )
    group.add_argument(
        '--overlap-grad-reduce',
        action='store_true',
        default=False,
        help='Reduce gradient buckets while the backward pass continues.',
    )
    group.add_argument(
        '--no-delay-grad-reduce',
        action='store_false',
        dest='delay_grad_reduce',
        help='Start gradient reductions on every pipeline stage at once, not only the first.',
    )
    group.add_argument(
        '--ddp-bucket-size',
        type=int,
        default=None,
        help='Elements per data-parallel communication bucket.',
    )
    group.add_argument(
        '--ddp-average-in-collective',
        action='store_true',
        default=False,
        help='Average inside the data-parallel collective instead of scaling before it.',
    )
    group.add_argument(
        '--overlap-param-gather',
        action='store_true',
        default=False,
        help='All-gather distributed-optimizer parameters while the next forward runs.',
    )
    group.add_argument(
        '--delay-param-gather',
        action='store_true',
        default=False,
        help='Delay parameter all-gathers on all but the first pipeline stage.',
    )
    group.add_argument(
        '--no-scatter-gather-tensors-in-pipeline',
        action='store_false',
        dest='scatter_gather_tensors_in_pipeline',
        help='Send whole tensors between pipeline stages instead of scatter / gather over TP.',
    )
    group.add_argument(
        '--use-ring-exchange-p2p',
        action='store_true',
        default=False,
        help='Custom ring exchange for pipeline point-to-point transfers.',
    )
    group.add_argument(
        '--local-rank',
        '--local_rank',
        type=int,
        default=None,
        dest='local_rank',
        help='Rank on this node, set by the launcher (default: $LOCAL_RANK).',
    )
    group.add_argument(
        '--lazy-mpu-init',
        type=bool,
        required=False,
        help='initialize_megatron() returns a function that finishes the distributed set-up later.',
    )
    group.add_argument(
        '--standalone-embedding-stage',
        action='store_true',
        default=False,
        help='Give the input embedding a pipeline stage of its own, with no transformer layer.',
    )
    group.add_argument(
        '--use-distributed-optimizer',
        action='store_true',
        help='Shard the optimizer state over the data-parallel ranks.',
    )
    group.add_argument(
        '--context-parallel-size',
        type=int,
        default=1,
        help='Context-parallel size (the sequence split over ranks).',
    )
    group.add_argument(
        '--cp-comm-type',
        nargs='+',
        type=str,
        default=['p2p'],
        help='Inter-rank communication of context parallel attention: p2p (ring), all_gather '
        '(also spelled allgather), a2a (Ulysses) or a2a+p2p. One value for all layers, or one '
        'per layer, e.g. --cp-comm-type p2p p2p a2a a2a.',
    )
    group.add_argument(
        '--hierarchical-context-parallel-sizes',
        nargs='+',
        type=int,
        default=None,
        help='Two sizes whose product is --context-parallel-size, for --cp-comm-type a2a+p2p: '
        'all-to-all inside groups of the first size, ring across groups of the second.',
    )
    group.add_argument(
        '--use-cpu-initialization',
        action='store_true',
        default=None,
        help='Initialize weights on the CPU, identical for any tensor-parallel size.',
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
        help='YAML file of NCCL communicator settings.',
    )
    group.add_argument(
        '--use-tp-pp-dp-mapping',
        action='store_true',
        default=False,
        help='Order ranks tensor-pipeline-data instead of tensor-data-pipeline.',
    )
    return parser


def _add_validation_args(parser):
    group = parser.add_argument_group(title='validation')
    group.add_argument(
        '--eval-iters',
        type=int,
        default=100,
        help='Iterations of each validation / test evaluation.',
    )
    group.add_argument(
        '--eval-interval',
        type=int,
        default=1000,
        help='Iterations between validation runs.',
    )
    group.add_argument(
        '--test-mode',
        action='store_true',
        help='Run the real-time tests along with the experiment.',
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
        help='Rescale blend weights after each dataset is oversampled to cover its share.',
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
        help='Weights and prefixes of a separate training set.',
    )
    group.add_argument(
        '--valid-data-path',
        nargs='*',
        default=None,
        help='Weights and prefixes of a separate validation set.',
    )
    group.add_argument(
        '--test-data-path',
        nargs='*',
        default=None,
        help='Weights and prefixes of a separate test set.',
    )
    group.add_argument(
        '--data-cache-path', default=None, help='Directory of the cached dataset index files.'
    )
    group.add_argument(
        '--no-mmap-bin-files',
        action='store_false',
        dest='mmap_bin_files',
        help='Read .bin files without memory-mapping them.',
    )
    group.add_argument(
        '--mock-data',
        action='store_true',
        help='Synthetic data instead of files, where the dataset has a mock variant.',
    )
    group.add_argument('--seq-length', type=int, default=None, help='Tokens per training sequence.')
    group.add_argument(
        '--encoder-seq-length',
        type=int,
        default=None,
        help='Tokens per encoder sequence (in place of --seq-length).',
    )
    group.add_argument(
        '--decoder-seq-length',
        type=int,
        default=None,
        help='Tokens per decoder sequence.',
    )
    group.add_argument(
        '--retriever-seq-length',
        type=int,
        default=256,
        help='Sequence length of the retriever biencoder.',
    )
    group.add_argument(
        '--sample-rate',
        type=float,
        default=1.0,
        help='Fraction of the training data to use (0 < rate < 1).',
    )
    group.add_argument(
        '--mask-prob', type=float, default=0.15, help='Chance that a token is masked.'
    )
    group.add_argument(
        '--short-seq-prob',
        type=float,
        default=0.1,
        help='Chance that a sample is made shorter than the sequence length.',
    )
    group.add_argument('--num-workers', type=int, default=2, help='Data-loader worker processes.')
    group.add_argument(
        '--reset-position-ids',
        action='store_true',
        help='Restart positions after each end-of-document token.',
    )
    group.add_argument(
        '--reset-attention-mask',
        action='store_true',
        help='Keep attention inside documents (the mask resets at each end-of-document token).',
    )
    group.add_argument(
        '--eod-mask-loss', action='store_true', help='No loss on end-of-document tokens.'
    )
    group.add_argument(
        '--no-create-attention-mask-in-dataloader',
        action='store_false',
        dest='create_attention_mask_in_dataloader',
        help='The data loader builds no attention masks.',
    )
    group.add_argument(
        '--num-dataset-builder-threads',
        type=int,
        default=1,
        help='Threads per rank that build the datasets.',
    )
    group.add_argument(
        '--s3-cache-path',
        type=str,
        default=None,
        help='Local cache of index files for S3 data.',
    )
    return parser


def _add_tokenizer_args(parser):
    group = parser.add_argument_group(title='tokenizer')
    group.add_argument(
        '--vocab-size',
        type=int,
        default=None,
        help='Vocabulary size without EOD and padding (NullTokenizer).',
    )
    group.add_argument('--vocab-file', type=str, default=None, help='Vocabulary file.')
    group.add_argument('--merge-file', type=str, default=None, help='BPE merges file.')
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
            'SFTTokenizer',
            'Llama2Tokenizer',
            'Llama3Tokenizer',
            'MistralTokenizer',
            'TikTokenizer',
            'NullTokenizer',
        ],
        help='Tokenizer.',
    )
    group.add_argument(
        '--tokenizer-model',
        type=str,
        default=None,
        help='Tokenizer model file or directory (SentencePiece, Hugging Face).',
    )
    group.add_argument(
        '--tiktoken-pattern',
        type=str,
        default=None,
        help='tiktoken split pattern: v1 or v2.',
    )
    group.add_argument(
        '--tiktoken-num-special-tokens',
        type=int,
        default=1000,
        help='Special tokens of the tiktoken tokenizer.',
    )
    group.add_argument(
        '--tiktoken-special-tokens',
        type=str,
        nargs='+',
        default=None,
        help='The tiktoken special tokens; must include <unk>, <s> and </s>.',
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
        help='Iterations between checks for an autoresume request.',
    )
    return parser


def _add_logging_args(parser):
    group = parser.add_argument_group(title='logging')
    group.add_argument(
        '--log-params-norm', action='store_true', help='Log the norm of the parameters.'
    )
    group.add_argument(
        '--log-num-zeros-in-grad',
        action='store_true',
        help='Log how many gradient entries are zero.',
    )
    group.add_argument(
        '--log-throughput',
        action='store_true',
        help='Log throughput per GPU.',
    )
    group.add_argument(
        '--log-progress',
        action='store_true',
        help='Append tokens and floating-point operations done so far to progress.txt '
        'in the checkpoint directory.',
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
        help='Time level-1 sections without a barrier first.',
    )
    group.add_argument(
        '--timing-log-option',
        type=str,
        default='minmax',
        choices=['max', 'minmax', 'all'],
        help='Timer values reported over the ranks: max, minmax or all.',
    )
    group.add_argument(
        '--tensorboard-log-interval',
        type=int,
        default=1,
        help='Iterations between TensorBoard writes.',
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
        help='Write timers to TensorBoard.',
    )
    group.add_argument(
        '--log-batch-size-to-tensorboard',
        action='store_true',
        help='Write the batch size to TensorBoard.',
    )
    group.add_argument(
        '--no-log-learnig-rate-to-tensorboard',
        action='store_false',
        dest='log_learning_rate_to_tensorboard',
        help='Do not write the learning rate to TensorBoard.',
    )
    group.add_argument(
        '--no-log-loss-scale-to-tensorboard',
        action='store_false',
        dest='log_loss_scale_to_tensorboard',
        help='Do not write the loss scale to TensorBoard.',
    )
    group.add_argument(
        '--log-validation-ppl-to-tensorboard',
        action='store_true',
        help='Write validation perplexity to TensorBoard.',
    )
    group.add_argument(
        '--log-memory-to-tensorboard',
        action='store_true',
        help='Write memory use to TensorBoard.',
    )
    group.add_argument(
        '--log-world-size-to-tensorboard',
        action='store_true',
        help='Write the world size to TensorBoard.',
    )
    group.add_argument(
        '--wandb-project',
        type=str,
        default='',
        help='Weights & Biases project (no W&B logging when unset).',
    )
    group.add_argument('--wandb-exp-name', type=str, default='', help='Weights & Biases run name.')
    group.add_argument(
        '--wandb-save-dir', type=str, default='', help='Local directory of the W&B files.'
    )
    group.add_argument(
        '--logging-level', type=int, default=None, help='Default level of the Python loggers.'
    )
    return parser


def _add_straggler_detector_args(parser):
    group = parser.add_argument_group(title='straggler')
    group.add_argument(
        '--log-straggler',
        action='store_true',
        help='Measure and log per-GPU throughput to spot stragglers.',
    )
    group.add_argument(
        '--disable-straggler-on-startup',
        action='store_true',
        help='Start with the straggler detector off.',
    )
    group.add_argument(
        '--straggler-ctrlr-port',
        type=int,
        default=65535,
        help='Port that switches the straggler detector on and off at run time.',
    )
    group.add_argument(
        '--straggler-minmax-count',
        type=int,
        default=1,
        help='Ranks reported at each end of the throughput range.',
    )
    return parser
