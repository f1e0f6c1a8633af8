"""Flags of the resilience features of later Megatron versions: the rerun state machine (v0.10+,
`megatron/core/rerun_state_machine.py`), node-local non-persistent checkpoints (v0.11) and the
CPU-offloading optimizer (v0.12). The r0.8 non-persistent checkpoint flags are defined with the
checkpointing group (`arguments_run.py`); their rules and these flags' rules are in
`argument_validation_resilience.py`.
"""


def add_resilience_args(parser):
    """The rerun state machine, local non-persistent checkpoint and CPU-offload flags."""
    group = parser.add_argument_group(title='resilience')
    group.add_argument(
        '--rerun-mode',
        type=str,
        default='disabled',
        choices=['disabled', 'validate_results', 'report_stats', 'report_determinism_stats'],
        help='What the rerun state machine does with a step whose loss or gradient check fails: '
        'disabled (raise for a fatal check), validate_results (run the step again in place to '
        'tell a transient fault from a persistent one, exiting with code 16 or 17), '
        'report_stats / report_determinism_stats (run every step twice and log how much the '
        'checked values differ).',
    )
    group.add_argument(
        '--error-injection-rate',
        type=int,
        default=0,
        help='Pretend about one validation in this many fails (per rank, at most once a step), '
        'to exercise the rerun state machine. 0: never.',
    )
    group.add_argument(
        '--error-injection-type',
        type=str,
        default='transient_error',
        choices=['correct_result', 'transient_error', 'persistent_error'],
        help='The kind of fault --error-injection-rate simulates.',
    )
    group.add_argument(
        '--check-for-nan-in-loss-and-grad',
        action='store_true',
        dest='check_for_nan_in_loss_and_grad',
        default=True,
        help='Check the loss and the gradient norms for NaN and Inf (the default; '
        '--no-check-for-nan-in-loss-and-grad turns it off).',
    )
    group.add_argument(
        '--check-for-spiky-loss',
        action='store_true',
        help='Reject (non-fatally) a loss 10x larger than the largest of the first 100.',
    )
    group.add_argument(
        '--check-for-large-grads',
        action='store_true',
        help='Reject (non-fatally) a gradient-bucket norm 10x larger than the largest of its '
        'first 100.',
    )
    group.add_argument(
        '--result-rejected-tracker-filename',
        type=str,
        default=None,
        help='Append one line per rejected result (and per rerun verdict) to this file.',
    )
    group.add_argument(
        '--non-persistent-local-ckpt-dir',
        type=str,
        default=None,
        help='Directory of the "local" non-persistent checkpoints (--non-persistent-ckpt-type '
        'local): every rank writes its own files there.',
    )
    group.add_argument(
        '--optimizer-cpu-offload',
        action='store_true',
        help='Keep --optimizer-offload-fraction of the distributed optimizer\'s fp32 state on the '
        'host and step that part there (a no-op without a GPU).',
    )
    group.add_argument(
        '--optimizer-offload-fraction',
        type=float,
        default=1.0,
        help='Fraction of the optimizer state (by elements) that --optimizer-cpu-offload moves '
        'to the host.',
    )
    return parser
