"""Flags of multi-latent attention, YaRN and DeepSeek-V3 routing (later Megatron's names and
command-line defaults); mla_config.py builds the model config and layer spec from them.

Command-line defaults differ from `MLATransformerConfig`'s, as in Megatron: `--kv-lora-rank` 32,
`--q-lora-rank` None (one full-rank query projection), `--rotary-scaling-factor` 1.0,
`--mscale-all-dim` 0.0. With `--rotary-scaling-factor` > 1 and `--mscale-all-dim 0.0` only the
rotary half of each logit gets YaRN's temperature boost; DeepSeek-V3 checkpoints need `--mscale
1.0 --mscale-all-dim 1.0` (imports from Hugging Face set them from config.json).
"""


def _add_mla_args(parser):
    group = parser.add_argument_group(title='multi-latent attention')
    group.add_argument(
        '--multi-latent-attention',
        action='store_true',
        help='Build every attention layer as multi-latent attention (MLA).',
    )
    group.add_argument(
        '--q-lora-rank',
        type=int,
        default=None,
        help='Rank of the MLA query down projection (default: one full-rank query projection).',
    )
    group.add_argument(
        '--kv-lora-rank', type=int, default=32, help='Rank of the MLA key/value latent.'
    )
    group.add_argument(
        '--qk-head-dim',
        type=int,
        default=128,
        help='MLA per-head query/key size without position embedding.',
    )
    group.add_argument(
        '--qk-pos-emb-head-dim',
        type=int,
        default=64,
        help='MLA per-head size of the rotary query/key part.',
    )
    group.add_argument('--v-head-dim', type=int, default=128, help='MLA per-head value size.')
    group.add_argument(
        '--rope-type',
        type=str,
        default=None,
        choices=['rope', 'yarn'],
        help='Rotary type of MLA\'s decoupled part (default: yarn).',
    )
    group.add_argument(
        '--rotary-scaling-factor',
        type=float,
        default=1.0,
        help='YaRN context extension factor.',
    )
    group.add_argument(
        '--mscale', type=float, default=1.0, help='YaRN: numerator of the cos/sin scale.'
    )
    group.add_argument(
        '--mscale-all-dim',
        type=float,
        default=0.0,
        help='YaRN: denominator of the cos/sin scale; also squares into the softmax scale.',
    )
    group.add_argument(
        '--yarn-original-max-position-embeddings',
        type=int,
        default=4096,
        help='YaRN: the pretraining context length.',
    )
    group.add_argument(
        '--yarn-beta-fast', type=float, default=32.0, help='YaRN: fast end of the ramp.'
    )
    group.add_argument(
        '--yarn-beta-slow', type=float, default=1.0, help='YaRN: slow end of the ramp.'
    )
    group.add_argument(
        '--yarn-correction-range-round-to-int',
        action='store_true',
        default=True,
        help='YaRN: round the ramp ends to whole channels (default).',
    )
    group.add_argument(
        '--no-yarn-correction-range-round-to-int',
        action='store_false',
        dest='yarn_correction_range_round_to_int',
        help='YaRN: keep the ramp ends fractional.',
    )
    group.add_argument(
        '--use-rope-scaling',
        action='store_true',
        help='Apply Llama-3.1 frequency scaling to RoPE.',
    )
    group.add_argument(
        '--rope-scaling-factor',
        type=float,
        default=8.0,
        help='Factor of the Llama-3.1 RoPE scaling.',
    )
    mtp = parser.add_argument_group(title='multi-token prediction')
    mtp.add_argument(
        '--mtp-num-layers',
        type=int,
        default=None,
        help='Multi-token prediction depth: extra layers after the decoder (default: off).',
    )
    mtp.add_argument(
        '--mtp-loss-scaling-factor',
        type=float,
        default=0.1,
        help='Weight of the averaged multi-token-prediction losses in the backward pass.',
    )
    routing = parser.add_argument_group(title='moe group-limited routing')
    routing.add_argument(
        '--moe-router-num-groups',
        type=int,
        default=None,
        help='Group-limited routing: split the experts into this many equal groups.',
    )
    routing.add_argument(
        '--moe-router-group-topk',
        type=int,
        default=None,
        help='Group-limited routing: the groups each token may choose experts from.',
    )
    return parser


#: Architecture args restored by --use-checkpoint-args (Megatron restores none of them: a model
#: with qk-norm, Llama-3.1 rope scaling or MLA would otherwise silently change at load).
ARCHITECTURE_CHECKPOINT_ARGS = (
    'qk_layernorm',
    'use_rope_scaling',
    'rope_scaling_factor',
    'multi_latent_attention',
    'q_lora_rank',
    'kv_lora_rank',
    'qk_head_dim',
    'qk_pos_emb_head_dim',
    'v_head_dim',
    'rope_type',
    'rotary_scaling_factor',
    'mscale',
    'mscale_all_dim',
    'yarn_original_max_position_embeddings',
    'yarn_beta_fast',
    'yarn_beta_slow',
    'yarn_correction_range_round_to_int',
    'mtp_num_layers',
    'mtp_loss_scaling_factor',
)
