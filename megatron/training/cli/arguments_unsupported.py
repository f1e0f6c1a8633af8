"""Megatron core_r0.8.0 flags for features this package does not have, and the one table of them.

Every flag of Megatron's `megatron/training/arguments.py` parses here with Megatron's attribute
name, type and default, so a Megatron command line is accepted as written. A flag whose feature is
missing must not be silently ignored: `UNSUPPORTED_FLAGS` (flag -> reason) lists them, and
`check_unsupported_flags` (run first by `validate_args`, before any work starts) stops start-up
with one line naming the flag when a run sets one of them to anything but its default.

The argument groups below (biencoder, retro, one logger) are the ones whose features are
entirely absent (the communication-overlap flags defined here are supported); flags of a
supported group that are unsupported (fp8, ...) are defined with their group in
`arguments.py` and listed in the same table.
"""

_FP8 = 'fp8 training needs Transformer Engine, which this package does not use'
_VISION = 'the Swin and MiT vision backbones are not included (the ViT is)'
_BIENCODER = 'ICT / biencoder (REALM-style retriever) models are not included'
_RETRO = 'Retro models are not included'
_ONE_LOGGER = 'one_logger (an NVIDIA-internal E2E metrics tool) is not available'

#: flag -> why it cannot take a non-default value here. Audited list: nothing else is refused
#: at start-up for being unimplemented, and code that reads one of these (e.g. num_experts for
#: the layer spec) only ever sees its default.
UNSUPPORTED_FLAGS = {
    # Transformer Engine userbuffers tuning (--tp-comm-overlap itself is supported).
    # Transformer Engine fp8.
    '--fp8-format': _FP8,
    '--fp8-margin': _FP8,
    '--fp8-interval': _FP8,
    '--fp8-amax-history-len': _FP8,
    '--fp8-amax-compute-algo': _FP8,
    '--no-fp8-wgrad': _FP8,
    # Vision: the Swin / MiT backbones.
    '--swin-backbone-type': _VISION,
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
    # Others.
    '--adlr-autoresume': 'ADLR autoresume (a cluster-internal service) is not available',
    '--adlr-autoresume-interval': 'ADLR autoresume (a cluster-internal service) is not available',
    '--s3-cache-path': 'S3 dataset loading is not implemented',
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
        help='YAML file choosing the --tp-comm-overlap method per GEMM (TE ub_cfgs form).',
    )
    group.add_argument(
        '--disable-tp-comm-overlap-ag',
        action='store_false',
        dest='tp_comm_overlap_ag',
        help='With --tp-comm-overlap: all-gather the sequence before the GEMM instead of '
        'passing it round the ring chunk by chunk alongside the GEMM.',
    )
    group.add_argument(
        '--disable-tp-comm-overlap-rs',
        action='store_false',
        dest='tp_comm_overlap_rs',
        help='With --tp-comm-overlap: reduce-scatter after the GEMM instead of passing the '
        'partial sums round the ring chunk by chunk alongside the GEMM.',
    )
    group.add_argument(
        '--tp-comm-overlap-rs-dgrad',
        action='store_true',
        dest='tp_comm_overlap_rs_dgrad',
        help='With --tp-comm-overlap: pipeline the backward reduce-scatter of the input '
        'gradient with its own GEMM (instead of hiding it behind the weight-gradient GEMM).',
    )
    group.add_argument(
        '--disable-tp-comm-bulk-dgrad',
        action='store_false',
        dest='tp_comm_bulk_dgrad',
        help='With --tp-comm-overlap: do not hide the backward all-gather of the input behind '
        'the input-gradient GEMM.',
    )
    group.add_argument(
        '--disable-tp-comm-bulk-wgrad',
        action='store_false',
        dest='tp_comm_bulk_wgrad',
        help='With --tp-comm-overlap: do not hide the backward reduce-scatter of the input '
        'gradient behind the weight-gradient GEMM.',
    )
    return parser


def add_biencoder_args(parser):
    """Megatron's `_add_biencoder_args` (ICT / REALM retriever)."""
    group = parser.add_argument_group(title='biencoder')
    group.add_argument(
        '--ict-head-size',
        type=int,
        default=None,
        help='Width of the ICT / REALM block embedding (128 in the paper)',
    )
    group.add_argument(
        '--biencoder-projection-dim',
        type=int,
        default=0,
        help='Output width of the biencoder projection head (128 in the paper)',
    )
    group.add_argument(
        '--biencoder-shared-query-context-model',
        action='store_true',
        help='One set of weights for both the query and the context encoder',
    )
    group.add_argument(
        '--ict-load', type=str, default=None, help='ICTBertModel checkpoint directory'
    )
    group.add_argument(
        '--bert-load',
        type=str,
        default=None,
        help='BertModel checkpoint directory that ICT and REALM start from',
    )
    group.add_argument(
        '--titles-data-path', type=str, default=None, help='Titles dataset of the ICT task'
    )
    group.add_argument(
        '--query-in-block-prob',
        type=float,
        default=0.1,
        help='Chance that an ICT query sentence stays inside its block',
    )
    group.add_argument(
        '--use-one-sent-docs',
        action='store_true',
        help='Keep single-sentence documents in the ICT data',
    )
    group.add_argument(
        '--evidence-data-path',
        type=str,
        default=None,
        help='Wikipedia evidence file of the DPR paper',
    )
    group.add_argument(
        '--retriever-report-topk-accuracies',
        nargs='+',
        type=int,
        default=[],
        help='Retrieval accuracies to report, as a list of k (for example 1 5 20)',
    )
    group.add_argument(
        '--retriever-score-scaling',
        action='store_true',
        help='Divide retriever scores by sqrt(hidden size)',
    )
    group.add_argument(
        '--block-data-path', type=str, default=None, help='BlockData file (written and read)'
    )
    group.add_argument(
        '--embedding-path',
        type=str,
        default=None,
        help='File of the open-retrieval embeddings (written and read)',
    )
    group.add_argument(
        '--indexer-batch-size',
        type=int,
        default=128,
        help='Batch size of indexing jobs',
    )
    group.add_argument(
        '--indexer-log-interval',
        type=int,
        default=1000,
        help='Indexer progress line every this many batches',
    )
    return parser


def add_retro_args(parser):
    """Megatron's `_add_retro_args`."""
    group = parser.add_argument_group(title='retro')
    group.add_argument(
        '--retro-project-dir',
        default=None,
        help='Retro project folder holding the preprocessed pretraining data.',
    )
    group.add_argument(
        '--retro-add-retriever',
        action='store_true',
        default=False,
        help='Give the transformer a retriever (Retro pretraining).',
    )
    group.add_argument(
        '--retro-cyclic-train-iters',
        type=int,
        default=None,
        help='Training iterations of cyclic Retro training.',
    )
    group.add_argument(
        '--retro-encoder-layers',
        type=int,
        default=2,
        help='Layers of the retrieval encoder.',
    )
    group.add_argument(
        '--retro-encoder-hidden-dropout',
        type=float,
        default=0.1,
        help='Hidden-state dropout of the retrieval encoder.',
    )
    group.add_argument(
        '--retro-encoder-attention-dropout',
        type=float,
        default=0.1,
        help='Attention dropout of the retrieval encoder.',
    )
    group.add_argument(
        '--retro-num-neighbors',
        type=int,
        default=2,
        help='Neighbours fetched per chunk while pretraining.',
    )
    group.add_argument(
        '--retro-num-retrieved-chunks',
        type=int,
        default=2,
        help='Chunks fetched from the retrieval database.',
    )
    group.add_argument(
        '--retro-attention-gate', type=float, default=1, help='Retro cross-attention gate.'
    )
    group.add_argument(
        '--retro-no-verify-neighbor-count',
        action='store_false',
        dest='retro_verify_neighbor_count',
        help='Do not check that the GPT dataset and the saved neighbours have the same length.',
    )
    return parser


def add_one_logger_args(parser):
    """Megatron's `_add_one_logger_args`."""
    group = parser.add_argument_group(title='one logger')
    group.add_argument(
        '--no-one-logger',
        action='store_false',
        dest='enable_one_logger',
        help='Turn off one_logger end-to-end metric tracking (one_logger is '
        'never available in this package, so this changes nothing).',
    )
    group.add_argument(
        '--one-logger-project', type=str, default='megatron-lm', help='one_logger project name.'
    )
    group.add_argument(
        '--one-logger-run-name', type=str, default=None, help='Run name shown by one_logger.'
    )
    group.add_argument(
        '--one-logger-async',
        action='store_true',
        help='Make one_logger report asynchronously.',
    )
    group.add_argument(
        '--app-tag-run-name',
        type=str,
        default=None,
        help='Name shared by every job of one training run.',
    )
    group.add_argument(
        '--app-tag-run-version',
        type=str,
        default='0.0.0',
        help='Version of the training run this job belongs to.',
    )
    return parser
