"""Argument rules of `--sft` and `--fim-data`, checked before any work starts (one line each).

Later Megatron checks almost none of these up front: `--sft` with `--reset-position-ids`, an
attention mask, another tokenizer or an unknown prompt format fails at the first sample or at
tokenizer construction; `--fim-split-sample` without `--fim-fragment-rate` fails at the first
matching sample. Rules that need the tokenizer or the data (sentinel tokens in the vocabulary,
rows of the JSONL files) run when the datasets are built, before the first training step.
"""

import os

from megatron.core.datasets.utils import get_blend_from_list
from megatron.training.tokenizer.sft_tokenizer import PROMPT_FORMATS

_SFT_OWN_DEFAULTS = {
    'sft_tokenizer_prompt_format': 'nemotron-h-aligned',
    'sft_one_row_per_sample': False,
    'sft_long_conversations': 'truncate',
}
_FIM_DEFAULTS = {
    'fim_rate': 0.5,
    'fim_spm_rate': 0.5,
    'fim_split_sample': None,
    'fim_fragment_rate': None,
    'fim_no_prefix': None,
    'fim_prefix_token': '<fim_prefix>',
    'fim_middle_token': '<fim_middle>',
    'fim_suffix_token': '<fim_suffix>',
    'fim_pad_token': '<fim_pad>',
    'fim_eod_token': '<|endoftext|>',
}


def _flag(dest):
    return '--' + dest.replace('_', '-')


def _note(args, message):
    if args.rank == 0:
        print(f'NOTE: {message}', flush=True)


def _unused(args, switch, defaults):
    changed = [_flag(k) for k, v in defaults.items() if getattr(args, k, v) != v]
    if changed:
        verb = 'has' if len(changed) == 1 else 'have'
        _note(args, f'{", ".join(changed)} {verb} no effect without {switch}')


def _check_sft(args):
    if args.sft_tokenizer_prompt_format not in PROMPT_FORMATS:
        raise ValueError(
            f'--sft-tokenizer-prompt-format {args.sft_tokenizer_prompt_format!r} is not a prompt '
            f'format; choose one of {", ".join(PROMPT_FORMATS)}'
        )
    if args.tokenizer_type == 'HuggingFaceTokenizer':
        _note(args, '--sft: --tokenizer-type HuggingFaceTokenizer -> SFTTokenizer (same files)')
        args.tokenizer_type = 'SFTTokenizer'
    if args.tokenizer_type != 'SFTTokenizer':
        raise ValueError(
            f'--sft needs --tokenizer-type SFTTokenizer with --tokenizer-model (a Hugging Face '
            f'tokenizer directory); got --tokenizer-type {args.tokenizer_type}'
        )
    if args.tokenizer_model is None:
        raise ValueError('--sft needs --tokenizer-model (a Hugging Face tokenizer directory)')
    for name, value in (
        ('--mock-data', args.mock_data),
        ('--fim-data', args.fim_data),
        ('--reset-position-ids', args.reset_position_ids),
        ('--reset-attention-mask', args.reset_attention_mask),
        ('--eod-mask-loss', args.eod_mask_loss),
    ):
        if value:
            raise ValueError(
                f'--sft cannot be combined with {name}: SFT samples carry their own positions, '
                'attention boundaries and loss mask (chat JSONL from --data-path)'
            )
    paths = []
    for flag in ('data_path', 'train_data_path', 'valid_data_path', 'test_data_path'):
        blend = get_blend_from_list(getattr(args, flag))
        if blend is not None:
            paths += [(_flag(flag), path) for path in blend[0]]
    if not paths:
        raise ValueError('--sft needs chat JSONL files: give --data-path (or --train-data-path)')
    for flag, path in paths:
        if not os.path.isfile(path):
            raise ValueError(f'{flag} {path}: no such file (--sft reads chat .jsonl files)')
    # Packed samples carry cu_seqlens instead of a [s, s] mask (Megatron requires
    # --no-create-attention-mask-in-dataloader; here it is implied).
    args.create_attention_mask_in_dataloader = False


def _check_fim(args):
    if args.mock_data:
        raise ValueError('--fim-data cannot be combined with --mock-data (FIM rewrites real text)')
    for name in ('fim_rate', 'fim_spm_rate', 'fim_fragment_rate'):
        value = getattr(args, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f'{_flag(name)} must be a probability in [0, 1], got {value}')
    if args.fim_split_sample is not None and args.fim_fragment_rate is None:
        raise ValueError(
            f'--fim-split-sample {args.fim_split_sample!r} needs --fim-fragment-rate (the '
            'probability of FIM on each fragment)'
        )
    for name in ('fim_prefix_token', 'fim_middle_token', 'fim_suffix_token', 'fim_pad_token'):
        if not getattr(args, name):
            raise ValueError(f'{_flag(name)} must name a token of the vocabulary')
    if not args.fim_eod_token:
        raise ValueError('--fim-eod-token must name a token of the vocabulary')


def validate_sft_and_fim_args(args):
    """Check the `--sft` and `--fim-*` flags (one-line ValueErrors naming them).

    With --sft: a known prompt format, an SFTTokenizer (a HuggingFaceTokenizer is taken as one),
    existing JSONL files, none of --mock-data, --fim-data, --reset-position-ids,
    --reset-attention-mask or --eod-mask-loss; sets create_attention_mask_in_dataloader False.
    With --fim-data: real data, probabilities in [0, 1], --fim-fragment-rate with
    --fim-split-sample, non-empty token names. Flags of either feature given without its switch
    get a note.
    """
    if getattr(args, 'sft', False):
        _check_sft(args)
    else:
        unused = dict(_SFT_OWN_DEFAULTS)
        if args.tokenizer_type == 'SFTTokenizer':
            unused.pop('sft_tokenizer_prompt_format')  # the tokenizer renders with it
        _unused(args, '--sft', unused)
    if getattr(args, 'fim_data', False):
        _check_fim(args)
    else:
        _unused(args, '--fim-data', _FIM_DEFAULTS)
