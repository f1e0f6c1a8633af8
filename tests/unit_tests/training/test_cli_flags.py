"""The CLI surface is frozen: the live parser must match cli_flags.json (regenerate on purpose with
freeze_cli_flags.py), and every flag carries help text."""

import json

from tests.unit_tests.training.freeze_cli_flags import FROZEN, live_flags


def test_cli_flags_match_frozen_list():
    with open(FROZEN) as f:
        frozen = json.load(f)
    live = json.loads(json.dumps(live_flags()))
    added = sorted(set(live) - set(frozen))
    removed = sorted(set(frozen) - set(live))
    changed = sorted(k for k in set(live) & set(frozen) if live[k] != frozen[k])
    details = [f'{k}: frozen {frozen[k]} != live {live[k]}' for k in changed]
    assert not (added or removed or changed), (
        f'CLI flags changed (run tests/unit_tests/training/freeze_cli_flags.py if deliberate): '
        f'added {added}, removed {removed}, changed:\n' + '\n'.join(details)
    )


def test_every_flag_has_help_and_megatron_names():
    live = live_flags()
    assert len(live) > 200
    missing_help = [k for k, v in live.items() if not v['has_help']]
    assert not missing_help, missing_help
    # A few of Megatron's core_v0.8.0 names and defaults, as in megatron/training/arguments.py.
    assert live['--make-vocab-size-divisible-by']['default'] == 128
    assert live['--split']['default'] is None
    assert live['--initial-loss-scale']['default'] == 2**32
    assert live['--distributed-backend']['default'] == 'nccl'
    assert live['--eval-iters']['default'] == 100
    assert live['--eval-interval']['default'] == 1000
    assert live['--log-interval']['default'] == 100
    assert live['--lr-decay-style']['default'] == 'linear'
    assert live['--override-opt_param-scheduler']['dest'] == 'override_opt_param_scheduler'
