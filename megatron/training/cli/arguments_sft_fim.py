"""Flags of supervised fine-tuning on chat data (`--sft`, later Megatron's group `sft`) and of
fill-in-the-middle data (`--fim-*`, later Megatron's data group), with their names and defaults,
plus two flags of this package (`--sft-one-row-per-sample`, `--sft-long-conversations`).
Checked by `argument_validation_sft_fim.py`."""


def _add_sft_args(parser):
    group = parser.add_argument_group(title='sft')
    group.add_argument('--sft', action='store_true', help='Megatron SFT training')
    group.add_argument(
        '--sft-tokenizer-prompt-format',
        type=str,
        default='nemotron-h-aligned',
        help='SFT prompt format: nemotron-h-aligned, nemotron-nano-v2, identity, or default (the '
        "tokenizer's own chat template).",
    )
    group.add_argument(
        '--sft-one-row-per-sample',
        action='store_true',
        help="Megatron's SFT packing: each JSONL row is one sample (its conversations packed in "
        'order). By default conversations of different rows share samples.',
    )
    group.add_argument(
        '--sft-long-conversations',
        type=str,
        default='truncate',
        choices=['truncate', 'error'],
        help='A conversation (with --sft-one-row-per-sample, a row) longer than --seq-length + 1 '
        'tokens: truncate it (with a warning and a count) or stop with an error.',
    )
    return parser


def _add_fim_args(parser):
    group = parser.add_argument_group(title='fill-in-the-middle data')
    group.add_argument('--fim-data', action='store_true', help='Whether to use the FIM dataset.')
    group.add_argument(
        '--fim-rate', type=float, default=0.5, help='Probability to convert a training sample.'
    )
    group.add_argument(
        '--fim-spm-rate',
        type=float,
        default=0.5,
        help='Probability that the a FIM sample uses the SPM format over the PSM format.',
    )
    group.add_argument(
        '--fim-split-sample',
        type=str,
        default=None,
        help='String around which to split the sample for FIM.',
    )
    group.add_argument(
        '--fim-fragment-rate',
        type=float,
        default=None,
        help='Rate of FIM on each fragment when --fim-split-sample is not None.',
    )
    group.add_argument(
        '--fim-no-prefix',
        type=str,
        default=None,
        help='Do not apply FIM to fragments that start with this prefix',
    )
    group.add_argument(
        '--fim-prefix-token', type=str, default='<fim_prefix>', help='FIM prefix token'
    )
    group.add_argument(
        '--fim-middle-token', type=str, default='<fim_middle>', help='FIM middle token'
    )
    group.add_argument(
        '--fim-suffix-token', type=str, default='<fim_suffix>', help='FIM suffix token'
    )
    group.add_argument('--fim-pad-token', type=str, default='<fim_pad>', help='FIM PAD token')
    group.add_argument('--fim-eod-token', type=str, default='<|endoftext|>', help='FIM EOD token')
    return parser


def add_sft_and_fim_args(parser):
    """Add the `sft` and fill-in-the-middle argument groups."""
    return _add_fim_args(_add_sft_args(parser))
