"""Megatron's vision flags (its `_add_vision_args` group), read by pretrain_vision_*.py.

Names, types, defaults and choices are Megatron core_r0.8.0's. This package adds
`--no-image-augmentation` (the training images get the validation geometry, for data such as
digits whose label a flip or a heavy crop changes) and `--dino-out-dim` (Megatron hard-codes the
DINO head's 65536 outputs). Flags of the parts not included here (Swin/MiT, the finetuning head
multiplier) parse and are refused when set, through `arguments_unsupported.UNSUPPORTED_FLAGS`.
"""


def add_vision_args(parser):
    """The vision argument group."""
    group = parser.add_argument_group(title='vision')
    group.add_argument('--num-classes', type=int, default=1000, help='Classes of the classifier.')
    group.add_argument('--img-h', type=int, default=224, help='Input image height in pixels.')
    group.add_argument('--img-w', type=int, default=224, help='Input image width in pixels.')
    group.add_argument(
        '--num-channels', type=int, default=3, help='Image channels: 3 (RGB) or 1 (grayscale).'
    )
    group.add_argument(
        '--patch-dim', type=int, default=16, help='Side of the square ViT patches in pixels.'
    )
    group.add_argument(
        '--classes-fraction',
        type=float,
        default=1.0,
        help='Keep this share of the (sorted) classes of the image folders.',
    )
    group.add_argument(
        '--data-per-class-fraction',
        type=float,
        default=1.0,
        help='Keep this share of the (sorted) images of every class.',
    )
    group.add_argument(
        '--no-data-sharding',
        action='store_false',
        dest='data_sharding',
        help='The cyclic data loader shuffles the whole epoch instead of each data-parallel '
        'rank\'s own bucket.',
    )
    group.add_argument(
        '--head-lr-mult',
        type=float,
        default=1.0,
        help='Learning-rate multiplier of the classification head when finetuning.',
    )
    group.add_argument(
        '--vision-pretraining',
        action='store_true',
        help='Set by the vision scripts: the run trains an image model.',
    )
    group.add_argument(
        '--vision-pretraining-type',
        type=str,
        default='classify',
        choices=['classify', 'inpaint', 'dino'],
        help='Training objective of the vision scripts.',
    )
    group.add_argument(
        '--vision-backbone-type',
        type=str,
        default='vit',
        choices=['vit', 'mit', 'swin'],
        help='Image backbone (only vit is included).',
    )
    group.add_argument(
        '--swin-backbone-type',
        type=str,
        default='tiny',
        choices=['tiny', 'base', 'h3'],
        help='Size of the Swin backbone.',
    )
    group.add_argument(
        '--mask-type',
        type=str,
        default='random',
        choices=['random', 'row'],
        help='How inpainting picks the masked patches.',
    )
    group.add_argument(
        '--mask-factor', type=float, default=1.0, help='Scale of the inpainting mask size.'
    )
    group.add_argument(
        '--iter-per-epoch', type=int, default=1250, help='Iterations that make one DINO epoch.'
    )
    group.add_argument(
        '--dino-local-img-size', type=int, default=96, help='Side of the DINO local crops.'
    )
    group.add_argument(
        '--dino-local-crops-number', type=int, default=10, help='Local crops per image (DINO).'
    )
    group.add_argument(
        '--dino-head-hidden-size', type=int, default=2048, help='Hidden width of the DINO head.'
    )
    group.add_argument(
        '--dino-bottleneck-size', type=int, default=256, help='Bottleneck width of the DINO head.'
    )
    group.add_argument(
        '--dino-freeze-last-layer',
        type=float,
        default=1,
        help='Epochs during which the last DINO head layer is not updated.',
    )
    group.add_argument(
        '--dino-norm-last-layer',
        action='store_true',
        help='Keep the weight-norm scale of the last DINO head layer fixed.',
    )
    group.add_argument(
        '--dino-warmup-teacher-temp',
        type=float,
        default=0.04,
        help='Teacher temperature at the start of its warm-up (DINO).',
    )
    group.add_argument(
        '--dino-teacher-temp', type=float, default=0.07, help='Teacher temperature after warm-up.'
    )
    group.add_argument(
        '--dino-warmup-teacher-temp-epochs',
        type=int,
        default=30,
        help='Epochs of the teacher-temperature warm-up (DINO).',
    )
    group.add_argument(
        '--dino-out-dim',
        type=int,
        default=65536,
        help='Output size of the DINO head (Megatron fixes it at 65536).',
    )
    group.add_argument(
        '--vit-layout',
        choices=['megatron', 'hf'],
        default='megatron',
        help='Classifier layout: megatron (8 class tokens, ln_pre, MLP head) or hf '
        '(ViTForImageClassification\'s, which convert.py --saver hf exports).',
    )
    group.add_argument(
        '--no-image-augmentation',
        action='store_false',
        dest='image_augmentation',
        help='Training images get the validation resize and centre crop only (no random crop, '
        'flip or colour jitter).',
    )
    return parser


#: What --use-checkpoint-args restores from a pretrain_vlm.py checkpoint (one that records
#: `drop_vision_class_token`), whatever the command line says: the image geometry and the
#: vision tower's and projector's architecture (pretrain_vlm.py's own flags), which the
#: language model's args do not describe.
VLM_CHECKPOINT_ARGS = (
    'img_h',
    'img_w',
    'patch_dim',
    'num_channels',
    'vision_model_type',
    'drop_vision_class_token',
    'disable_vision_class_token',
    'vision_num_layers',
    'vision_hidden_size',
    'vision_ffn_hidden_size',
    'vision_num_attention_heads',
    'vision_norm_epsilon',
    'vision_activation',
    'vision_projection_activation',
)
