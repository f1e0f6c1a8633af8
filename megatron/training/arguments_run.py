"""Megatron's command-line flags, run groups: checkpointing, distributed, validation, data,
tokenizer, autoresume, logging and straggler-detector flags (one `_add_*_args(parser)` per argparse
group, names and defaults of Megatron core_r0.8.0 megatron/training/arguments.py).
`arguments.get_args_parser` assembles them.
"""


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
        '--use-dist-ckpt',
        action='store_true',
        help='Use distributed checkpoint format (torch_dist): it loads at any parallel layout.',
    )
    group.add_argument(
        '--ckpt-format',
        type=str,
        default=None,
        choices=['torch', 'torch_dist'],
        help='Checkpoint format to save (later Megatron\'s flag; default torch, the legacy '
        'format; torch_dist = --use-dist-ckpt). Loading detects the format.',
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
        'checkpoints (then the distributed optimizer state is gathered on DP rank 0: '
        'dp_zero_gather_scatter, reloadable at the same TP/PP only).',
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
            'SFTTokenizer',
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
