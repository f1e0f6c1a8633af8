"""Pieces of the hybrid Mamba end-to-end tests: the tiny model's flags and a worker that runs
pretrain() with pretrain_mamba.py's callbacks inside a `run_distributed` rank, optionally from
layout-independent reference weights (drawn per global parameter name, then sliced per TP
rank: per segment for the mixer's in_proj and conv, contiguously for the rest)."""

import sys

import torch

from tests.functional_tests.gpt_utils import MERGES, REPO, VOCAB, _reference_tensor

#: A tiny hybrid (pattern M*M-): hidden 64, 8 Mamba heads of 16, 2 groups, state 16, seq 32.
TINY_MAMBA_ARGS = [
    '--num-layers', '4',
    '--hidden-size', '64',
    '--num-attention-heads', '4',
    '--hybrid-override-pattern', 'M*M-',
    '--mamba-head-dim', '16',
    '--mamba-num-groups', '2',
    '--mamba-state-dim', '16',
    '--normalization', 'RMSNorm',
    '--position-embedding-type', 'none',
    '--disable-bias-linear',
    '--squared-relu',
    '--no-bias-gelu-fusion',
    '--seq-length', '32',
    '--max-position-embeddings', '32',
    '--attention-dropout', '0.0',
    '--hidden-dropout', '0.0',
    '--make-vocab-size-divisible-by', '64',
    '--lr', '3e-3',
    '--min-lr', '3e-4',
    '--lr-decay-style', 'cosine',
    '--lr-warmup-iters', '2',
    '--weight-decay', '0.01',
    '--clip-grad', '1.0',
    '--seed', '1234',
    '--vocab-file', VOCAB,
    '--merge-file', MERGES,
    '--split', '98,2,0',
    '--num-workers', '0',
    '--log-interval', '1',
    '--eval-interval', '1000',
]  # fmt: skip


def set_mamba_reference_weights(model, layer_offset):
    """Overwrite every parameter with values depending only on its global name and layout-free
    shape (conv weights with std 0.3 so the Mamba path carries signal)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.ssm.mamba_mixer import segment_sizes, split_conv, split_in_proj

    tp = mpu.get_tensor_model_parallel_world_size()
    rank = mpu.get_tensor_model_parallel_rank()
    config = model.config
    sizes = segment_sizes(config, config.hidden_size)
    with torch.no_grad():
        for name, param in model.named_parameters():
            parts = name.split('.')
            if 'layers' in parts:
                i = parts.index('layers') + 1
                parts[i] = str(int(parts[i]) + layer_offset)
            global_name = '.'.join(parts)
            if global_name == 'output_layer.weight':
                global_name = 'embedding.word_embeddings.weight'
            shape = list(param.shape)
            partitioned = getattr(param, 'tensor_model_parallel', False)
            if partitioned:
                shape[param.partition_dim] *= tp
            full = _reference_tensor(global_name, shape)
            if 'conv1d.weight' in name:
                full = full * 15.0
            if name.endswith('mixer.in_proj.weight'):
                full = split_in_proj(full, sizes, tp, rank)
            elif 'mixer.conv1d.' in name:
                full = split_conv(full, sizes[1:4], tp, rank)
            elif partitioned:
                full = torch.chunk(full, tp, dim=param.partition_dim)[rank]
            param.copy_(full.to(param.dtype))


def run_mamba_pretrain(
    extra_args, reference_weights=True, base_args=None, adjust_model=None, capture_stdout=False
):
    """pretrain() with pretrain_mamba.py's providers on this rank; returns its result dict.
    `adjust_model` (a module-level function of the model) runs after the reference weights;
    `capture_stdout` adds what this rank printed as result['stdout']."""
    import contextlib
    import io

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_mamba
    from megatron.core import parallel_state as mpu
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars, get_args
    from megatron.training.training import pretrain

    def provider(pre_process=True, post_process=True):
        model = pretrain_mamba.model_provider(pre_process, post_process)
        if reference_weights:
            args = get_args()
            pp = args.pipeline_model_parallel_size
            offset = mpu.get_pipeline_model_parallel_rank() * (args.num_layers // pp)
            set_mamba_reference_weights(model, offset)
        if adjust_model is not None:
            adjust_model(model)
        return model

    destroy_global_vars()
    buffer = io.StringIO()
    redirect = contextlib.redirect_stdout(buffer) if capture_stdout else contextlib.nullcontext()
    try:
        with redirect:
            result = pretrain(
                pretrain_mamba.train_valid_test_datasets_provider,
                provider,
                ModelType.encoder_or_decoder,
                pretrain_mamba.forward_step,
                args_defaults={'tokenizer_type': 'GPT2BPETokenizer', 'is_hybrid_model': True},
                args_list=list(TINY_MAMBA_ARGS if base_args is None else base_args)
                + list(extra_args),
            )
    finally:
        destroy_global_vars()
    if capture_stdout:
        result['stdout'] = buffer.getvalue()
    return result
