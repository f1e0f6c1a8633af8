"""Pretrain a vision-language model: LLaVA (Megatron's pretrain_vlm.py).

Thin entry script: the VLM flags, the model provider, the batch getter, the forward step and
the dataset provider; `pretrain()` does the rest, and the loss is pretrain_gpt's (logged as
`lm loss`). Data: `--mock-data` is Megatron's MockMultimodalDataset (mock text, blank images);
`--data-path FILE.json` (or .jsonl) a LLaVA-style conversation set with an image folder; with
neither, the bundled handwritten digits captioned ("which digit is this ?" -> "it is a
handwritten seven ."). `bash examples/multimodal/quickstart_vlm.sh` trains a tiny LLaVA on
them. Design notes: docs/multimodal.md.
"""

import copy
import dataclasses

import torch
import torch.nn.functional as F

from megatron.core import parallel_state as mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.multimodal_dataset import (
    MockMultimodalDataset,
    MultimodalDatasetConfig,
)
from megatron.core.enums import ModelType
from megatron.core.models.multimodal import LLaVAModel
from megatron.core.models.multimodal.llava_inputs import DEFAULT_IMAGE_TOKEN_INDEX
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.utils import fast_gelu, quick_gelu
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets.vlm_dataset import (
    DigitCaptionDataset,
    LlavaJsonDataset,
    TextEncoder,
    vlm_batch,
)
from megatron.training.global_vars import get_args, get_timers, get_tokenizer
from megatron.training.gpt_builder import gpt_layer_spec_from_args
from megatron.training.run_control.errors import run_main
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0
from pretrain_gpt import core_gpt_dataset_config_from_args, loss_func

VISION_MODEL_TYPES = ('clip',)
#: What `forward_step` reads from a micro-batch.
VLM_BATCH_KEYS = ('image', 'tokens', 'position_ids', 'labels', 'loss_mask')


def add_vlm_extra_args(parser):
    """Megatron's 'vision language model specific arguments' (r0.8: --drop-vision-class-token;
    later versions and examples/multimodal: the freezing and vision-model flags)."""
    group = parser.add_argument_group(title='vision language model specific arguments')
    group.add_argument(
        '--drop-vision-class-token',
        action='store_true',
        help="Drop the ViT's class tokens before the projector (r0.8's name).",
    )
    group.add_argument(
        '--disable-vision-class-token',
        action='store_true',
        help="Drop the ViT's class tokens before the projector (later name, same effect).",
    )
    group.add_argument(
        '--freeze-LM', action='store_true', help='Freeze the language model (no gradients).'
    )
    group.add_argument(
        '--freeze-ViT', action='store_true', help='Freeze the vision model (no gradients).'
    )
    group.add_argument(
        '--vision-model-type',
        default='clip',
        help='Vision encoder: clip (a CLIP ViT of --encoder-num-layers layers).',
    )
    group.add_argument(
        '--allow-missing-vision-projection-checkpoint',
        action='store_true',
        help='Loading a checkpoint without the projector weights is not an error.',
    )
    add_vision_architecture_args(group)
    group.add_argument(
        '--img-embedding-idx',
        type=int,
        default=0,
        help="r0.8's fixed image position, for batches without the image placeholder token.",
    )
    return parser


#: --vision-activation / --vision-projection-activation names -> functions (HF's names).
VISION_ACTIVATIONS = {'quick_gelu': quick_gelu, 'gelu': F.gelu, 'gelu_pytorch_tanh': fast_gelu}


def add_vision_architecture_args(group):
    """The vision tower's and projector's own sizes (ours; Megatron copies the LM's config into
    both). Unset, each takes the language model's value, as in Megatron."""
    for flag, kind, what in (
        ('--vision-num-layers', int, 'layers (default --encoder-num-layers, i.e. --num-layers)'),
        ('--vision-hidden-size', int, 'hidden size'),
        ('--vision-ffn-hidden-size', int, 'MLP inner size'),
        ('--vision-num-attention-heads', int, 'attention heads'),
        ('--vision-norm-epsilon', float, 'LayerNorm epsilon'),
    ):
        group.add_argument(flag, type=kind, default=None, help=f"The ViT's {what}.")
    group.add_argument(
        '--vision-activation',
        default=None,
        choices=sorted(VISION_ACTIVATIONS),
        help="Make the ViT a CLIP encoder with this MLP activation: biased linears, no gated "
        "unit, its own heads (default: the language model's layer settings).",
    )
    group.add_argument(
        '--vision-projection-activation',
        default=None,
        choices=sorted(VISION_ACTIVATIONS),
        help="Make the projector HF LLaVA's: biased fc1 -> this activation -> biased fc2, no "
        "gated unit (default: the language model's MLP settings).",
    )


def check_vlm_args(args) -> None:
    """Refuse flag combinations that cannot work, one line each, before any model is built."""
    if args.vision_model_type not in VISION_MODEL_TYPES:
        raise ValueError(
            f"pretrain_vlm.py: --vision-model-type {args.vision_model_type} is not supported "
            f"(choose from {', '.join(VISION_MODEL_TYPES)})"
        )
    if args.img_h % args.patch_dim or args.img_w % args.patch_dim:
        raise ValueError(
            f"pretrain_vlm.py: --img-h {args.img_h} and --img-w {args.img_w} must be multiples "
            f"of --patch-dim {args.patch_dim}"
        )
    if args.freeze_LM and args.pipeline_model_parallel_size > 1:
        raise ValueError(
            "pretrain_vlm.py: --freeze-LM with --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size} leaves stages 1..."
            f"{args.pipeline_model_parallel_size - 1} nothing to train (they hold only "
            "language-model layers); freeze the LM at --pipeline-model-parallel-size 1"
        )
    if args.virtual_pipeline_model_parallel_size is not None:
        raise ValueError(
            "pretrain_vlm.py: the interleaved pipeline schedule is not supported for LLaVA "
            "(--num-layers-per-virtual-pipeline-stage "
            f"{args.num_layers_per_virtual_pipeline_stage}); use --pipeline-model-parallel-size "
            "alone"
        )


def image_token_count(args) -> int:
    """Tokens one image gives the language model (patches, plus the class token if kept)."""
    patches = (args.img_h // args.patch_dim) * (args.img_w // args.patch_dim)
    drop = args.drop_vision_class_token or args.disable_vision_class_token
    return patches + (0 if drop else 1)


def vlm_configs(args):
    """(language, vision, projection) TransformerConfigs from args. The ViT and projector copy
    the language config as Megatron's script does; the ViT has --encoder-num-layers layers
    (default --num-layers) and the projector's inner size is the LM hidden size."""
    language = core_transformer_config_from_args(args)
    vision, projection = vision_config(args, language), projection_config(args, language)
    if args.pipeline_model_parallel_size > 1:
        # The combined length depends on the batch's images: the stages announce each
        # [S, b, h] they send (the schedule reads this from the model's config).
        language = dataclasses.replace(language, variable_seq_lengths=True)
    return language, vision, projection


def vision_config(args, language):
    """The ViT's config: the LM's, with the --vision-* sizes; a CLIP layer (LayerNorm, biases,
    no gated unit, one key/value head per head) when --vision-activation is given."""
    hidden = args.vision_hidden_size or language.hidden_size
    heads = args.vision_num_attention_heads or language.num_attention_heads
    changes = dict(
        num_layers=args.vision_num_layers or args.encoder_num_layers or args.num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=args.vision_ffn_hidden_size
        or (language.ffn_hidden_size if hidden == language.hidden_size else 4 * hidden),
        layernorm_epsilon=args.vision_norm_epsilon or language.layernorm_epsilon,
    )
    if hidden != language.hidden_size or heads != language.num_attention_heads:
        changes.update(kv_channels=hidden // heads, num_query_groups=heads)
    if args.vision_activation is not None:
        changes.update(
            kv_channels=hidden // heads,
            num_query_groups=heads,
            add_bias_linear=True,
            add_qkv_bias=True,
            gated_linear_unit=False,
            normalization='LayerNorm',
            activation_func=VISION_ACTIVATIONS[args.vision_activation],
            bias_activation_fusion=False,
            qk_layernorm=False,
        )
    return dataclasses.replace(copy.deepcopy(language), **changes, **ONE_STAGE)


def projection_config(args, language):
    """The projector's config: inner size = the LM hidden size; HF LLaVA's biased ungated MLP
    when --vision-projection-activation is given."""
    changes = dict(num_layers=1, ffn_hidden_size=args.hidden_size)
    if args.vision_projection_activation is not None:
        changes.update(
            add_bias_linear=True,
            gated_linear_unit=False,
            activation_func=VISION_ACTIVATIONS[args.vision_projection_activation],
            bias_activation_fusion=False,
        )
    return dataclasses.replace(copy.deepcopy(language), **changes, **ONE_STAGE)


#: The ViT and projector live on the first pipeline stage whole (later Megatron pins their
#: configs to one stage the same way).
ONE_STAGE = dict(
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    first_pipeline_num_layers=None,
    last_pipeline_num_layers=None,
)


def model_provider(pre_process=True, post_process=True) -> LLaVAModel:
    """This pipeline stage's part of the LLaVA model (the ViT and projector on the first
    stage, the language model's layers split over the stages), frozen as the flags say."""
    args = get_args()
    check_vlm_args(args)
    print_rank_0('building a multimodal model ...')
    language, vision, projection = vlm_configs(args)
    model = LLaVAModel(
        language_transformer_config=language,
        # The language model's layers as pretrain_gpt.py builds them from the same flags.
        language_transformer_layer_spec=gpt_layer_spec_from_args(args, language),
        language_vocab_size=args.padded_vocab_size,
        language_max_sequence_length=args.decoder_seq_length
        or args.seq_length + image_token_count(args),
        vision_transformer_config=vision,
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=args.drop_vision_class_token or args.disable_vision_class_token,
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        allow_missing_vision_projection_checkpoint=args.allow_missing_vision_projection_checkpoint,
        parallel_output=True,
        language_position_embedding_type=args.position_embedding_type,
        language_rotary_percent=args.rotary_percent,
        language_rotary_base=args.rotary_base,
        img_embedding_idx=args.img_embedding_idx,
        img_h=args.img_h,
        img_w=args.img_w,
        patch_dim=args.patch_dim,
        pre_process=pre_process,
        post_process=post_process,
    )
    model.freeze(
        freeze_language_model=args.freeze_LM,
        freeze_vision_model=args.freeze_ViT,
        freeze_vision_projection=False,
    )
    return model


def forward_step(data_iterator, model: LLaVAModel):
    """Forward one micro-batch; returns (per-token losses, loss function of the expanded mask)."""
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    # Middle pipeline stages take their input from the previous stage: no batch. The last
    # stage reads the ids and images too, to rebuild the expanded labels and loss mask.
    middle = not (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage())
    batch = dict.fromkeys(VLM_BATCH_KEYS) if middle else vlm_batch(data_iterator)
    timers('batch-generator').stop()
    output, loss_mask = model(
        batch['image'],
        batch['tokens'],
        batch['position_ids'],
        None,
        labels=batch['labels'],
        loss_mask=batch['loss_mask'],
    )
    return output, lambda output_tensor: loss_func(loss_mask, output_tensor)


def _mock_placeholder_sample(sample):
    """A mock GPT sample in the placeholder layout: the image id first (the last text id
    dropped, so the length stays), label = the first text id, loss mask 0 there."""
    tokens = torch.as_tensor(sample['tokens'])
    out = {
        'tokens': torch.cat([tokens.new_tensor([DEFAULT_IMAGE_TOKEN_INDEX]), tokens[:-1]]),
        'labels': torch.cat([tokens[:1], torch.as_tensor(sample['labels'])[:-1]]),
        'loss_mask': torch.cat([torch.zeros(1), torch.as_tensor(sample['loss_mask'])[:-1]]),
        'position_ids': torch.as_tensor(sample['position_ids']),
        'image': sample['image'],
    }
    return out


def _mock_datasets(args, train_val_test_num_samples):
    config = core_gpt_dataset_config_from_args(
        args,
        config_class=MultimodalDatasetConfig,
        image_h=args.img_h,
        image_w=args.img_w,
        preprocess_func=_mock_placeholder_sample,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(
        MockMultimodalDataset, train_val_test_num_samples, lambda: True, config
    ).build()


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Mock, LLaVA JSON or the bundled digit captions (module docstring); no test split
    except with mock data."""
    args = get_args()
    print_rank_0('> building train, validation, and test datasets for multimodal ...')
    if args.mock_data:
        datasets = _mock_datasets(args, train_val_test_num_samples)
    else:
        tokenizer = get_tokenizer()
        encode = TextEncoder(tokenizer, args.tokenizer_type == 'NullTokenizer')
        n_train, n_valid, _ = train_val_test_num_samples
        size = (args.seq_length, args.img_h, args.img_w)
        if args.data_path:
            train_path = args.data_path[0]
            valid_path = args.data_path[1] if len(args.data_path) > 1 else train_path
            datasets = (
                LlavaJsonDataset(train_path, n_train, encode, *size),
                LlavaJsonDataset(valid_path, n_valid, encode, *size),
                None,
            )
        else:
            datasets = (
                DigitCaptionDataset('train', n_train, encode, *size, seed=args.seed),
                DigitCaptionDataset('valid', n_valid, encode, *size, seed=args.seed),
                None,
            )
    print_rank_0('> finished creating multimodal datasets ...')
    return datasets


# Every rank reads its own batches (samples are a pure function of their index), as the vision
# scripts do; the images are not broadcast over the TP group.
train_valid_test_datasets_provider.is_distributed = True


if __name__ == '__main__':
    run_main(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        extra_args_provider=add_vlm_extra_args,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
