"""Cross-flag rules of the vision scripts (pretrain_vision_*.py), checked before any work.

They run when the script says it trains an image model (its `vision_pretraining` default) or
`--vision-pretraining` is given. Each rule is one `ValueError` naming the flags and the numbers.
"""

#: Class tokens of the classification backbone (megatron.legacy.model.vision.classification).
_CLASS_TOKENS = 8


def _is_vision_run(args, defaults) -> bool:
    return bool(defaults.get('vision_pretraining') or getattr(args, 'vision_pretraining', False))


def apply_vision_defaults(args, defaults) -> None:
    """An image model's sequence is its tokens: patches plus class tokens. Unless given,
    --seq-length and --max-position-embeddings are set to that count (the GPT-oriented checks
    that follow then see consistent values)."""
    if not _is_vision_run(args, defaults) or args.patch_dim <= 0:
        return
    tokens = (args.img_h // args.patch_dim) * (args.img_w // args.patch_dim) + _CLASS_TOKENS
    if args.seq_length is None and args.encoder_seq_length is None:
        args.seq_length = tokens
    if args.max_position_embeddings is None:
        args.max_position_embeddings = tokens
    # No vocabulary: the FLOPs and memory reports count no embedding or output-logit GEMM.
    args.padded_vocab_size = 0


def validate_vision_args(args, defaults) -> None:
    """The image geometry, the backbone and the parallel layouts the vision models can run."""
    if not _is_vision_run(args, defaults):
        if args.vit_layout != 'megatron':
            raise ValueError(f"--vit-layout {args.vit_layout} needs pretrain_vision_classify.py")
        if args.head_lr_mult != 1.0:
            raise ValueError(
                f"--head-lr-mult {args.head_lr_mult} scales the learning rate of a vision "
                "model's head: run pretrain_vision_classify.py or pretrain_vision_dino.py"
            )
        return
    args.vision_pretraining = True
    if not 0.0 <= args.head_lr_mult < float('inf'):
        raise ValueError(f"--head-lr-mult must be >= 0 and finite, got {args.head_lr_mult}")
    if args.vit_layout != 'megatron' and args.vision_pretraining_type != 'classify':
        raise ValueError(
            f"--vit-layout {args.vit_layout} is the classifier's layout: "
            f"--vision-pretraining-type {args.vision_pretraining_type} uses Megatron's backbone"
        )
    if args.head_lr_mult != 1.0 and args.vision_pretraining_type == 'inpaint':
        raise ValueError(
            f"--head-lr-mult {args.head_lr_mult}: the inpainting model has no head (its decoder "
            "is trained at --lr)"
        )
    if args.vision_backbone_type != 'vit':
        raise ValueError(
            f"--vision-backbone-type {args.vision_backbone_type}: the Swin and MiT backbones are "
            "not included; use --vision-backbone-type vit"
        )
    if args.patch_dim <= 0 or args.img_h % args.patch_dim or args.img_w % args.patch_dim:
        raise ValueError(
            f"--img-h {args.img_h} x --img-w {args.img_w} is not divisible by --patch-dim "
            f"{args.patch_dim}"
        )
    if args.img_h != args.img_w:
        raise ValueError(
            f"--img-h {args.img_h} and --img-w {args.img_w} differ: the vision transforms crop "
            "square images"
        )
    if args.num_channels not in (1, 3):
        raise ValueError(
            f"--num-channels {args.num_channels}: images are read with 1 (grayscale) or 3 (RGB)"
        )
    if args.num_classes < 2 and args.vision_pretraining_type == 'classify':
        raise ValueError(f"--num-classes must be at least 2, got {args.num_classes}")
    if not 0.0 < args.mask_factor < float('inf'):
        raise ValueError(f"--mask-factor must be positive and finite, got {args.mask_factor}")
    for flag in ('classes_fraction', 'data_per_class_fraction'):
        value = getattr(args, flag)
        if not 0.0 < value <= 1.0:
            raise ValueError(f"--{flag.replace('_', '-')} must be in (0, 1], got {value}")
    _validate_vision_layout(args)
    _validate_dino(args)


def _validate_vision_layout(args) -> None:
    if args.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: the vision "
            "models run on one pipeline stage (use tensor or data parallelism)"
        )
    if args.context_parallel_size > 1:
        raise ValueError(
            f"--context-parallel-size {args.context_parallel_size}: the vision models do not "
            "split the image tokens over ranks"
        )
    # The token count of each model (patches + its class tokens) must divide TP under sequence
    # parallelism: the encoder checks it when built (CLIPViTModel, DINO's local crops).


def _validate_dino(args) -> None:
    if args.iter_per_epoch <= 0:
        raise ValueError(f"--iter-per-epoch must be positive, got {args.iter_per_epoch}")
    if not 0 <= args.dino_warmup_teacher_temp_epochs <= 300:
        raise ValueError(
            "--dino-warmup-teacher-temp-epochs must be in [0, 300] (DINO's temperature schedule "
            f"spans 300 epochs), got {args.dino_warmup_teacher_temp_epochs}"
        )
    if args.dino_out_dim <= 0 or args.dino_local_crops_number < 0:
        raise ValueError(
            f"--dino-out-dim ({args.dino_out_dim}) must be positive and "
            f"--dino-local-crops-number ({args.dino_local_crops_number}) not negative"
        )
