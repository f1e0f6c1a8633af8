"""Argument rules of hybrid Mamba models, checked before any work starts (one line each).

A run is a Mamba run when pretrain_mamba.py sets `is_hybrid_model` or when `--spec` names
Megatron's Mamba spec module (as core_r0.8.0's own pretrain_mamba.py requires). Megatron
core_r0.8.0 checks almost nothing here: sizes fail in bare asserts at model construction,
context parallelism and an uneven pipeline split silently compute something else, and Mamba
state crosses document boundaries. Here every combination that would not be exact is refused.
Context parallelism runs the Mamba layers by an all-to-all from sequence chunks to heads (as
Megatron from v0.13), so it needs heads / groups per TP rank that split over the CP ranks; with
--sft the all-to-all reorders by the per-sequence split of the packed sequences.
"""

from types import SimpleNamespace

MAMBA_SPEC_MODULE = 'megatron.core.models.mamba.mamba_layer_specs'

_MAMBA_DEFAULTS = {
    'mamba_state_dim': 128,
    'mamba_head_dim': 64,
    'mamba_num_groups': 8,
    'mamba_num_heads': None,
    'hybrid_attention_ratio': 0.0,
    'hybrid_mlp_ratio': 0.0,
    'hybrid_override_pattern': None,
}


def is_mamba_run(args) -> bool:
    """Whether this run builds a MambaModel."""
    spec = getattr(args, 'spec', None)
    return bool(getattr(args, 'is_hybrid_model', None)) or bool(
        spec and spec[0] == MAMBA_SPEC_MODULE
    )


def _flag(dest):
    return '--' + dest.replace('_', '-')


def validate_mamba_args(args):
    """Refuse Mamba flags outside a Mamba run and inexact Mamba combinations."""
    if not is_mamba_run(args):
        for dest, default in _MAMBA_DEFAULTS.items():
            value = getattr(args, dest, default)
            if value != default:
                raise ValueError(
                    f"{_flag(dest)} (got {value!r}) needs a hybrid Mamba model: run "
                    f"pretrain_mamba.py (or --spec {MAMBA_SPEC_MODULE} mamba_stack_spec)"
                )
        return
    from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, check_hybrid_allocation
    from megatron.core.ssm.mamba_mixer import check_mamba_dims

    if args.use_legacy_models:
        raise ValueError("Mamba only supported in Mcore! (drop --use-legacy-models)")
    pattern = check_hybrid_allocation(
        args.num_layers,
        args.hybrid_attention_ratio,
        args.hybrid_mlp_ratio,
        args.hybrid_override_pattern,
    )
    sizes = SimpleNamespace(
        mamba_state_dim=args.mamba_state_dim,
        mamba_head_dim=args.mamba_head_dim,
        mamba_num_groups=args.mamba_num_groups,
        mamba_num_heads=args.mamba_num_heads,
    )
    cp = args.context_parallel_size if Symbols.MAMBA in pattern else 1
    check_mamba_dims(sizes, args.hidden_size, args.tensor_model_parallel_size, cp)
    pp = args.pipeline_model_parallel_size
    if (
        args.decoder_first_pipeline_num_layers is not None
        or args.decoder_last_pipeline_num_layers is not None
    ):
        raise ValueError(
            "--standalone-embedding-stage / --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers are not supported for hybrid Mamba models (their "
            "layer pattern is split evenly over the stages)"
        )
    if args.num_layers % pp != 0:
        raise ValueError(
            f"--num-layers ({args.num_layers}) of a hybrid Mamba model must be divisible by "
            f"--pipeline-model-parallel-size ({pp}) (uneven stages are not supported)"
        )
    if getattr(args, 'virtual_pipeline_model_parallel_size', None) is not None:
        raise ValueError(
            "The Mamba hybrid model does not currently support virtual/interleaved pipeline "
            "parallelism (drop --num-layers-per-virtual-pipeline-stage)"
        )
    if args.reset_attention_mask:
        if pp > 2:
            raise ValueError(
                f"--reset-attention-mask with --pipeline-model-parallel-size ({pp}) > 2 is not "
                "supported for Mamba models (middle stages do not see the document boundaries)"
            )
        if Symbols.ATTENTION in pattern and not args.create_attention_mask_in_dataloader:
            raise ValueError(
                "--reset-attention-mask with attention layers needs the dataloader's attention "
                "mask (drop --no-create-attention-mask-in-dataloader)"
            )
