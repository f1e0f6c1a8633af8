"""Write cli_flags.json: every flag of megatron/training/arguments.py (name, dest, type,
default...).

Run after changing a flag on purpose:  python tests/unit_tests/training/freeze_cli_flags.py
test_cli_flags.py diffs the live parser against the file, so flags change only deliberately.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FROZEN = os.path.join(HERE, 'cli_flags.json')


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, range)):
        return [_jsonable(v) for v in value]
    return repr(value)


def live_flags():
    """{first option string: description} of every flag the real parser registers."""
    from megatron.training.arguments import get_args_parser

    parser = get_args_parser()
    flags = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == 'help':
            continue
        flags[action.option_strings[0]] = {
            'option_strings': list(action.option_strings),
            'dest': action.dest,
            'action': type(action).__name__,
            'type': getattr(action.type, '__name__', None) if action.type is not None else None,
            'default': _jsonable(action.default),
            'nargs': _jsonable(action.nargs),
            'choices': _jsonable(action.choices),
            'has_help': bool(action.help),
        }
    return flags


def main():
    flags = live_flags()
    with open(FROZEN, 'w') as f:
        json.dump(flags, f, indent=1, sort_keys=True)
        f.write('\n')
    print(f'wrote {len(flags)} flags to {FROZEN}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
