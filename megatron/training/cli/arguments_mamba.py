"""Flags of hybrid Mamba models beyond Megatron core_r0.8.0's experimental group (which keeps
`--spec`, `--hybrid-attention-ratio`, `--hybrid-mlp-ratio` and `--hybrid-override-pattern`).

Later Megatron's names and defaults: core_r0.8.0 fixes the mixer at state size 128, head dim 64
and 8 groups; these flags set them. They reach `TransformerConfig` through its same-named
fields (mamba_state_dim, mamba_head_dim, mamba_num_groups, mamba_num_heads).
"""

#: Args that define a hybrid Mamba model, taken from its checkpoint by --use-checkpoint-args
#: (a served or converted checkpoint builds the trained layer pattern and mixer sizes).
MAMBA_CHECKPOINT_ARGS = (
    'is_hybrid_model',
    'hybrid_attention_ratio',
    'hybrid_mlp_ratio',
    'hybrid_override_pattern',
    'mamba_state_dim',
    'mamba_head_dim',
    'mamba_num_groups',
    'mamba_num_heads',
    'squared_relu',
    'bias_gelu_fusion',
)


def add_mamba_args(parser):
    """Add the Mamba mixer flags (argument group 'mamba')."""
    group = parser.add_argument_group(title='mamba')
    group.add_argument(
        '--mamba-state-dim', type=int, default=128, help='State size N of each Mamba head.'
    )
    group.add_argument(
        '--mamba-head-dim', type=int, default=64, help='Head dimension P of the Mamba mixer.'
    )
    group.add_argument(
        '--mamba-num-groups',
        type=int,
        default=8,
        help='Groups of the B / C projections; contiguous heads share a group. Must divide the '
        'number of Mamba heads and be divisible by the tensor-parallel size.',
    )
    group.add_argument(
        '--mamba-num-heads',
        type=int,
        default=None,
        help='Mamba heads (the inner size is heads * head dim). Default: '
        '2 * hidden size / head dim.',
    )
    group.add_argument(
        '--is-hybrid-model',
        action='store_true',
        default=None,
        help='The model is a hybrid Mamba model (pretrain_mamba.py sets this).',
    )
    return parser
