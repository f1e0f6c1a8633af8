"""Every float flag is checked at start-up: NaN and infinity are refused for all of them, and
the flags with a range refuse values outside it (one ValueError line naming the flag)."""

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.cli.arguments_parser import get_args_parser
from megatron.training.validation.argument_validation_floats import RANGES, float_flags
from tests.unit_tests.training.test_moe_arguments import BASE


def _validate(extra):
    args = parse_args(args_list=BASE + list(extra))
    args.world_size = 1
    args.rank = 0
    return validate_args(args, {})


@pytest.mark.parametrize(
    'flags,message',
    [
        (['--moe-expert-capacity-factor', 'inf'], '--moe-expert-capacity-factor must be a finite'),
        (['--moe-expert-capacity-factor', 'nan'], '--moe-expert-capacity-factor must be a finite'),
        (['--moe-input-jitter-eps', '-1'], r'--moe-input-jitter-eps must be in \(0, 1\), got -1'),
        (['--lr', 'nan'], '--lr must be a finite number, got nan'),
        (['--adam-beta2', '1.5'], r'--adam-beta2 must be in \[0, 1\), got 1.5'),
        (['--hidden-dropout', '-0.1'], r'--hidden-dropout must be in \[0, 1\), got -0.1'),
        (['--clip-grad=-inf'], '--clip-grad must be a finite number, got -inf'),
    ],
)
def test_float_flags_refused_at_start_up(flags, message):
    with pytest.raises(ValueError, match=message):
        _validate(flags)


def test_every_float_flag_refuses_nan_and_defaults_pass():
    flags = float_flags(get_args_parser())
    assert 'moe_input_jitter_eps' in flags and len(flags) >= 40
    assert set(RANGES) <= set(flags), set(RANGES) - set(flags)
    args = parse_args(args_list=BASE)
    args.world_size, args.rank = 1, 0
    from megatron.training.validation.argument_validation_floats import validate_float_flags

    validate_float_flags(args, get_args_parser())  # every default is inside its range
    for dest, flag in flags.items():
        setattr(args, dest, float('nan'))
        with pytest.raises(ValueError, match=f'^{flag} must be a finite number, got nan$'):
            validate_float_flags(args, get_args_parser())
        setattr(args, dest, None)
