"""Megatron core_r0.8.0 flags for features this package does not have, and the one table of them.

Every flag of Megatron's `megatron/training/arguments.py` parses here with Megatron's attribute
name, type and default, so a Megatron command line is accepted as written. A flag whose feature is
missing must not be silently ignored: `UNSUPPORTED_FLAGS` (flag -> reason) lists them, and
`check_unsupported_flags` (run first by `validate_args`, before any work starts) stops start-up
with one line naming the flag when a run sets one of them to anything but its default.

The argument groups below (biencoder, vision, retro, one logger, the TE communication-overlap
flags of the training group) are the ones whose features are entirely absent; flags of a
supported group that are unsupported (fp8, ...) are defined with their group in
`arguments.py` and listed in the same table.
"""

_TE_COMM = (
    'Transformer Engine userbuffers overlap (its fused all-gather/reduce-scatter GEMM kernels) is '
    'not available: the sequence-parallel collectives here are whole torch.distributed calls'
)
_FP8 = 'fp8 training needs Transformer Engine, which this package does not use'
_VISION = 'vision models (ViT/MiT/Swin, inpainting, DINO) are not included'
_BIENCODER = 'ICT / biencoder (REALM-style retriever) models are not included'
_RETRO = 'Retro models are not included'
_ONE_LOGGER = 'one_logger (an NVIDIA-internal E2E metrics tool) is not available'
_HYBRID = 'hybrid (Mamba) models are not included'

#: flag -> why it cannot take a non-default value here. Audited list: nothing else is refused
#: at start-up for being unimplemented, and code that reads one of these (e.g. num_experts for
#: the layer spec) only ever sees its default.
UNSUPPORTED_FLAGS = {
    # Transformer Engine communication/GEMM overlap (training group).
    '--tp-comm-overlap': _TE_COMM,
    '--tp-comm-overlap-cfg': _TE_COMM,
    '--disable-tp-comm-overlap-ag': _TE_COMM,
    '--disable-tp-comm-overlap-rs': _TE_COMM,
    '--tp-comm-overlap-rs-dgrad': _TE_COMM,
    '--disable-tp-comm-bulk-dgrad': _TE_COMM,
    '--disable-tp-comm-bulk-wgrad': _TE_COMM,
    '--disable-tp-comm-split-ag': _TE_COMM,
    '--disable-tp-comm-split-rs': _TE_COMM,
    # Transformer Engine fp8.
    '--fp8-format': _FP8,
    '--fp8-margin': _FP8,
    '--fp8-interval': _FP8,
    '--fp8-amax-history-len': _FP8,
    '--fp8-amax-compute-algo': _FP8,
    '--no-fp8-wgrad': _FP8,
    # Hybrid Mamba models (experimental group).
    '--hybrid-attention-ratio': _HYBRID,
    '--hybrid-mlp-ratio': _HYBRID,
    '--hybrid-override-pattern': _HYBRID,
    # Vision.
    '--num-classes': _VISION,
    '--img-h': _VISION,
    '--img-w': _VISION,
    '--num-channels': _VISION,
    '--patch-dim': _VISION,
    '--classes-fraction': _VISION,
    '--data-per-class-fraction': _VISION,
    '--head-lr-mult': _VISION,
    '--vision-pretraining': _VISION,
    '--vision-pretraining-type': _VISION,
    '--vision-backbone-type': _VISION,
    '--swin-backbone-type': _VISION,
    '--mask-type': _VISION,
    '--mask-factor': _VISION,
    '--iter-per-epoch': _VISION,
    '--dino-local-img-size': _VISION,
    '--dino-local-crops-number': _VISION,
    '--dino-head-hidden-size': _VISION,
    '--dino-bottleneck-size': _VISION,
    '--dino-freeze-last-layer': _VISION,
    '--dino-norm-last-layer': _VISION,
    '--dino-warmup-teacher-temp': _VISION,
    '--dino-teacher-temp': _VISION,
    '--dino-warmup-teacher-temp-epochs': _VISION,
    # ICT / biencoder retriever.
    '--ict-head-size': _BIENCODER,
    '--biencoder-projection-dim': _BIENCODER,
    '--biencoder-shared-query-context-model': _BIENCODER,
    '--ict-load': _BIENCODER,
    '--bert-load': _BIENCODER,
    '--titles-data-path': _BIENCODER,
    '--query-in-block-prob': _BIENCODER,
    '--use-one-sent-docs': _BIENCODER,
    '--evidence-data-path': _BIENCODER,
    '--retriever-report-topk-accuracies': _BIENCODER,
    '--retriever-score-scaling': _BIENCODER,
    '--block-data-path': _BIENCODER,
    '--embedding-path': _BIENCODER,
    '--indexer-batch-size': _BIENCODER,
    '--indexer-log-interval': _BIENCODER,
    '--retriever-seq-length': _BIENCODER,
    # Retro.
    '--retro-project-dir': _RETRO,
    '--retro-add-retriever': _RETRO,
    '--retro-cyclic-train-iters': _RETRO,
    '--retro-encoder-layers': _RETRO,
    '--retro-encoder-hidden-dropout': _RETRO,
    '--retro-encoder-attention-dropout': _RETRO,
    '--retro-num-neighbors': _RETRO,
    '--retro-num-retrieved-chunks': _RETRO,
    '--retro-attention-gate': _RETRO,
    '--retro-no-verify-neighbor-count': _RETRO,
    # one_logger. (--no-one-logger is accepted: without one_logger it is what happens anyway.)
    '--one-logger-project': _ONE_LOGGER,
    '--one-logger-run-name': _ONE_LOGGER,
    '--one-logger-async': _ONE_LOGGER,
    '--app-tag-run-name': _ONE_LOGGER,
    '--app-tag-run-version': _ONE_LOGGER,
    # Straggler detection: the run-time on/off HTTP controller is not implemented.
    '--straggler-ctrlr-port': 'the straggler detector\'s HTTP on/off controller is not implemented',
    # Others.
    '--adlr-autoresume': 'ADLR autoresume (a cluster-internal service) is not available',
    '--adlr-autoresume-interval': 'ADLR autoresume (a cluster-internal service) is not available',
    '--s3-cache-path': 'S3 dataset loading is not implemented',
    '--standalone-embedding-stage': 'a pipeline stage holding only the input embedding exists in '
    'Megatron core_r0.8.0\'s legacy models only (its core TransformerBlock leaves it as a TODO '
    'and splits the layers over every stage), which this package does not include',
    '--onnx-safe': 'ONNX export workarounds are not implemented',
    '--test-mode': 'Megatron\'s real-time tests run alongside training (its CI checks) are not '
    'included',
    '--output-bert-embeddings': 'the Retro BERT embedders are not included',
    '--bert-embedder-type': 'the Retro BERT embedders are not included',
}


def unsupported_flag_defaults(parser):
    """{dest: (flag, default)} of every flag in `UNSUPPORTED_FLAGS`, read from `parser`.

    Tools that merge args saved in a Megatron checkpoint (where e.g. --use-flash-attn may be set)
    can use it to put these back to their defaults before `validate_args`.
    """
    actions = {}
    for action in parser._actions:
        for option in action.option_strings:
            actions[option] = action
    return {actions[flag].dest: (flag, actions[flag].default) for flag in UNSUPPORTED_FLAGS}


def check_unsupported_flags(args, parser):
    """Stop start-up if a flag of `UNSUPPORTED_FLAGS` was set to anything but its default.

    Args:
        args: the parsed namespace (before any other validation changes it).
        parser: the parser that produced `args` (its actions give each flag's dest and default).

    Raises:
        ValueError: one line naming the first offending flag, its value and why it is refused.
    """
    for dest, (flag, default) in unsupported_flag_defaults(parser).items():
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value != default:
            raise ValueError(
                f'{flag} (got {value!r}) is not supported by this package: '
                f'{UNSUPPORTED_FLAGS[flag]}'
            )


def add_tp_comm_overlap_args(parser):
    """Megatron's Transformer Engine communication-overlap flags (part of its training group)."""
    group = parser.add_argument_group(title='training')
    group.add_argument(
        '--tp-comm-overlap-cfg',
        type=str,
        default=None,
        help='Config file when tp_comm_overlap is enabled (Transformer Engine only).',
    )
    group.add_argument(
        '--disable-tp-comm-overlap-ag',
        action='store_false',
        dest='tp_comm_overlap_ag',
        help='Disables the All-Gather overlap with GEMM by pipelining the GEMM and '
        'All-Gather (Transformer Engine only).',
    )
    group.add_argument(
        '--disable-tp-comm-overlap-rs',
        action='store_false',
        dest='tp_comm_overlap_rs',
        help='Disables the Reduce-Scatter overlap with GEMM by pipelining the GEMM '
        'and Reduce-Scatter (Transformer Engine only).',
    )
    group.add_argument(
        '--tp-comm-overlap-rs-dgrad',
        action='store_true',
        dest='tp_comm_overlap_rs_dgrad',
        help='Enables the Reduce-Scatter overlap with dgrad GEMM (Transformer Engine only).',
    )
    group.add_argument(
        '--disable-tp-comm-bulk-dgrad',
        action='store_false',
        dest='tp_comm_bulk_dgrad',
        help='Disables the All-Gather overlap with bprop activation gradient GEMM '
        '(Transformer Engine only).',
    )
    group.add_argument(
        '--disable-tp-comm-bulk-wgrad',
        action='store_false',
        dest='tp_comm_bulk_wgrad',
        help='Disables the Reduce-Scatter overlap with bprop weight gradient GEMM '
        '(Transformer Engine only).',
    )
    return parser


def add_biencoder_args(parser):
    """Megatron's `_add_biencoder_args` (ICT / REALM retriever)."""
    group = parser.add_argument_group(title='biencoder')
    group.add_argument(
        '--ict-head-size',
        type=int,
        default=None,
        help='Size of block embeddings to be used in ICT and REALM (paper default: 128)',
    )
    group.add_argument(
        '--biencoder-projection-dim',
        type=int,
        default=0,
        help='Size of projection head used in biencoder (paper default: 128)',
    )
    group.add_argument(
        '--biencoder-shared-query-context-model',
        action='store_true',
        help='Whether to share the parameters of the query and context models or not',
    )
    group.add_argument(
        '--ict-load', type=str, default=None, help='Directory containing an ICTBertModel checkpoint'
    )
    group.add_argument(
        '--bert-load',
        type=str,
        default=None,
        help='Directory containing an BertModel checkpoint (needed to start ICT and REALM)',
    )
    group.add_argument(
        '--titles-data-path', type=str, default=None, help='Path to titles dataset used for ICT'
    )
    group.add_argument(
        '--query-in-block-prob',
        type=float,
        default=0.1,
        help='Probability of keeping query in block for ICT dataset',
    )
    group.add_argument(
        '--use-one-sent-docs',
        action='store_true',
        help='Whether to use one sentence documents in ICT',
    )
    group.add_argument(
        '--evidence-data-path',
        type=str,
        default=None,
        help='Path to Wikipedia Evidence frm DPR paper',
    )
    group.add_argument(
        '--retriever-report-topk-accuracies',
        nargs='+',
        type=int,
        default=[],
        help='Which top-k accuracies to report (e.g. \'1 5 20\')',
    )
    group.add_argument(
        '--retriever-score-scaling',
        action='store_true',
        help='Whether to scale retriever scores by inverse square root of hidden size',
    )
    group.add_argument(
        '--block-data-path', type=str, default=None, help='Where to save/load BlockData to/from'
    )
    group.add_argument(
        '--embedding-path',
        type=str,
        default=None,
        help='Where to save/load Open-Retrieval Embedding data to/from',
    )
    group.add_argument(
        '--indexer-batch-size',
        type=int,
        default=128,
        help='How large of batches to use when doing indexing jobs',
    )
    group.add_argument(
        '--indexer-log-interval',
        type=int,
        default=1000,
        help='After how many batches should the indexer report progress',
    )
    return parser


def add_vision_args(parser):
    """Megatron's `_add_vision_args` (--no-data-sharding, defined here too, is supported)."""
    group = parser.add_argument_group(title='vision')
    group.add_argument(
        '--num-classes', type=int, default=1000, help='num of classes in vision classificaiton task'
    )
    group.add_argument(
        '--img-h', type=int, default=224, help='Image height for vision classification task'
    )
    group.add_argument(
        '--img-w', type=int, default=224, help='Image height for vision classification task'
    )
    group.add_argument(
        '--num-channels', type=int, default=3, help='Number of channels in input image data'
    )
    group.add_argument('--patch-dim', type=int, default=16, help='patch dimension')
    group.add_argument(
        '--classes-fraction', type=float, default=1.0, help='training with fraction of classes.'
    )
    group.add_argument(
        '--data-per-class-fraction',
        type=float,
        default=1.0,
        help='training with fraction of data per class.',
    )
    group.add_argument(
        '--no-data-sharding',
        action='store_false',
        dest='data_sharding',
        help='Disable data sharding (the cyclic data loader then shuffles the '
        'whole epoch instead of each data-parallel rank\'s bucket).',
    )
    group.add_argument(
        '--head-lr-mult',
        type=float,
        default=1.0,
        help='learning rate multiplier for head during finetuning',
    )
    group.add_argument(
        '--vision-pretraining', action='store_true', help='flag to indicate vision pretraining'
    )
    group.add_argument(
        '--vision-pretraining-type',
        type=str,
        default='classify',
        choices=['classify', 'inpaint', 'dino'],
        help='pretraining objectives',
    )
    group.add_argument(
        '--vision-backbone-type',
        type=str,
        default='vit',
        choices=['vit', 'mit', 'swin'],
        help='backbone types types',
    )
    group.add_argument(
        '--swin-backbone-type',
        type=str,
        default='tiny',
        choices=['tiny', 'base', 'h3'],
        help='pretraining objectives',
    )
    group.add_argument(
        '--mask-type', type=str, default='random', choices=['random', 'row'], help='mask types'
    )
    group.add_argument('--mask-factor', type=float, default=1.0, help='mask size scaling parameter')
    group.add_argument('--iter-per-epoch', type=int, default=1250, help='iterations per epoch')
    group.add_argument(
        '--dino-local-img-size',
        type=int,
        default=96,
        help='Image size for vision classification task',
    )
    group.add_argument(
        '--dino-local-crops-number', type=int, default=10, help='Number of local crops'
    )
    group.add_argument(
        '--dino-head-hidden-size', type=int, default=2048, help='Hidden dimension size in dino head'
    )
    group.add_argument(
        '--dino-bottleneck-size', type=int, default=256, help='Bottle neck dimension in dino head '
    )
    group.add_argument(
        '--dino-freeze-last-layer', type=float, default=1, help='Freezing last layer weights'
    )
    group.add_argument(
        '--dino-norm-last-layer', action='store_true', help='Disable Norm in last layer.'
    )
    group.add_argument(
        '--dino-warmup-teacher-temp', type=float, default=0.04, help='warump teacher temperature'
    )
    group.add_argument('--dino-teacher-temp', type=float, default=0.07, help='teacher temperature')
    group.add_argument(
        '--dino-warmup-teacher-temp-epochs',
        type=int,
        default=30,
        help='warmup teacher temperaure epochs',
    )
    return parser


def add_retro_args(parser):
    """Megatron's `_add_retro_args`."""
    group = parser.add_argument_group(title='retro')
    group.add_argument(
        '--retro-project-dir',
        default=None,
        help='Retro project directory, which contains the preprocessed data for pretraining.',
    )
    group.add_argument(
        '--retro-add-retriever',
        action='store_true',
        default=False,
        help='Add a retriever to the transformer, for use in pretraining a Retro model.',
    )
    group.add_argument(
        '--retro-cyclic-train-iters',
        type=int,
        default=None,
        help='Set number of training iterations for cyclic Retro training.',
    )
    group.add_argument(
        '--retro-encoder-layers',
        type=int,
        default=2,
        help='Number of layers to use for the retrieval encoder.',
    )
    group.add_argument(
        '--retro-encoder-hidden-dropout',
        type=float,
        default=0.1,
        help='Hidden dropout for retrieval encoder.',
    )
    group.add_argument(
        '--retro-encoder-attention-dropout',
        type=float,
        default=0.1,
        help='Attention dropout for retrieval encoder.',
    )
    group.add_argument(
        '--retro-num-neighbors',
        type=int,
        default=2,
        help='Number of neighbors to retrieve during pretraining.',
    )
    group.add_argument(
        '--retro-num-retrieved-chunks',
        type=int,
        default=2,
        help='Number of chunks to retrieve from the retrieval database.',
    )
    group.add_argument(
        '--retro-attention-gate', type=float, default=1, help='Gated cross attention.'
    )
    group.add_argument(
        '--retro-no-verify-neighbor-count',
        action='store_false',
        dest='retro_verify_neighbor_count',
        help='Skip verifying that len(GPT dataset) == len(saved neighbors).',
    )
    return parser


def add_one_logger_args(parser):
    """Megatron's `_add_one_logger_args`."""
    group = parser.add_argument_group(title='one logger')
    group.add_argument(
        '--no-one-logger',
        action='store_false',
        dest='enable_one_logger',
        help='If set, disable using one_logger to track E2E metrics (one_logger is '
        'never available in this package, so this changes nothing).',
    )
    group.add_argument(
        '--one-logger-project', type=str, default='megatron-lm', help='The one-logger project name.'
    )
    group.add_argument(
        '--one-logger-run-name', type=str, default=None, help='The one-logger run name displayed.'
    )
    group.add_argument(
        '--one-logger-async',
        action='store_true',
        help='If set, forces one_logger to use async mode.',
    )
    group.add_argument(
        '--app-tag-run-name',
        type=str,
        default=None,
        help='Jobs belonging to same training run, suppose to have the same name.',
    )
    group.add_argument(
        '--app-tag-run-version',
        type=str,
        default='0.0.0',
        help='The version of the training of which current job is part of.',
    )
    return parser
