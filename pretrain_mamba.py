"""Pretrain a hybrid Mamba / attention / MLP model (Megatron's pretrain_mamba.py).

Thin entry script: the model provider and the forward step; batches, the loss and the datasets
are GPT's (pretrain_gpt.py). Run with torchrun, e.g. `bash examples/mamba/quickstart_mamba.sh`;
design note: docs/mamba.md.
"""

from functools import partial

from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.mamba_model import seq_idx_from_eod
from megatron.training.datasets.sft_batch import get_sft_batch
from megatron.training.global_vars import get_args, get_timers, get_tokenizer
from megatron.training.mamba_builder import mamba_model_from_args
from megatron.training.run_control.errors import run_main
from megatron.training.training import pretrain
from megatron.training.utils import print_rank_0
from pretrain_gpt import get_batch, loss_func, train_valid_test_datasets_provider


def model_provider(pre_process=True, post_process=True) -> MambaModel:
    """Build the MambaModel of this pipeline stage (`--spec` names the stack spec; default
    megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec)."""
    args = get_args()
    print_rank_0('building Mamba model ...')
    model = mamba_model_from_args(args, pre_process, post_process, parallel_output=True)
    for name, param in model.named_parameters():
        print_rank_0(f' - {name}: {param.numel()}')
    for index, layer in enumerate(model.decoder.layers):
        print_rank_0(f' == params layer {index}: {sum(p.numel() for p in layer.parameters())}')
    return model


def forward_step(data_iterator, model: MambaModel):
    """Forward one micro-batch; returns (per-token losses or hidden states, loss function).

    With --reset-attention-mask the Mamba layers get the document ids, so their conv and scan
    restart at every document (attention layers get the per-document mask); under context
    parallelism the ids are counted over the whole row (this rank holds two chunks of it). With
    --sft the micro-batch is packed conversations: the model gets their boundaries
    (packed_seq_params), from which every stage's Mamba layers take their segment ids and
    attention layers their per-segment masks (under context parallelism each conversation is
    split on its own, and the Mamba layers reorder by its chunks); the loss mask covers answer
    tokens only."""
    timers = get_timers()
    args = get_args()
    timers('batch-generator', log_level=2).start()
    packed_seq_params = seq_idx = None
    if args.sft:
        tokens, labels, loss_mask, position_ids, packed_seq_params = get_sft_batch(data_iterator)
        attention_mask = None
    else:
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
        if args.reset_attention_mask and tokens is not None:
            cp_group = mpu.get_context_parallel_group()
            seq_idx = seq_idx_from_eod(tokens, get_tokenizer().eod, cp_group)
    timers('batch-generator').stop()
    output_tensor = model(
        tokens,
        position_ids,
        attention_mask,
        labels=labels,
        seq_idx=seq_idx,
        packed_seq_params=packed_seq_params,
    )
    return output_tensor, partial(loss_func, loss_mask)


if __name__ == '__main__':
    run_main(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={'tokenizer_type': 'GPT2BPETokenizer', 'is_hybrid_model': True},
    )
