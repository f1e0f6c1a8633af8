"""A Mamba entry script that leans on the surface core_r0.8.0's pretrain_mamba.py leans on.

Written here (not taken from Megatron). Its model provider builds `MambaModel` from the stack
spec named by `--spec` with r0.8's keywords and reads `model.decoder.num_layers_per_pipeline_rank`
to print a per-layer parameter count, as r0.8's script does; the batch, loss, forward step and
dataset callbacks are the GPT ones, which r0.8's Mamba script repeats (taken here from the GPT
contract script beside this file). It must print the same losses as the repository's
pretrain_mamba.py for the same flags.
"""

import importlib.util
import os

from megatron.core.enums import ModelType
from megatron.core.models.mamba import MambaModel
from megatron.core.transformer.spec_utils import import_module
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args

_spec = importlib.util.spec_from_file_location(
    'r08_contract_gpt', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'gpt.py')
)
gpt_contract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt_contract)


def _parameters_under(model, prefix):
    return sum(p.numel() for name, p in model.named_parameters() if prefix in name)


def model_provider(pre_process=True, post_process=True) -> MambaModel:
    """One pipeline stage of the hybrid model; r0.8 needs --spec and refuses legacy models."""
    args = get_args()
    print_rank_0('contract script: Mamba model')
    if args.use_legacy_models:
        raise ValueError('contract script: Mamba models exist in megatron.core only')
    if args.spec is None:
        raise ValueError('contract script: --spec must name the Mamba stack spec')
    model = MambaModel(
        config=core_transformer_config_from_args(args),
        mamba_stack_spec=import_module(args.spec),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        hybrid_attention_ratio=args.hybrid_attention_ratio,
        hybrid_mlp_ratio=args.hybrid_mlp_ratio,
        hybrid_override_pattern=args.hybrid_override_pattern,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    for layer in range(model.decoder.num_layers_per_pipeline_rank):
        count = _parameters_under(model, f'decoder.layers.{layer}.')
        print_rank_0(f'contract script: layer {layer} holds {count} parameters')
    return model


if __name__ == '__main__':
    gpt_contract.train_valid_test_datasets_provider.is_distributed = True
    pretrain(
        gpt_contract.train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        gpt_contract.forward_step,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
    )
