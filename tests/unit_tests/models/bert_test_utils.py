"""Helpers shared by the BertModel tests: a tiny config, the model builder, a padded batch and the
TP gathering of BERT parameters. Imported inside spawned ranks (tests.unit_tests.dist_utils)."""

import torch

from megatron.core import parallel_state
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.gpt.hf_weight_mapping import tensor_parallel_partition_dim
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt_test_utils import _all_gather_tp

VOCAB = 128
SEQ = 16
BATCH = 2
MAX_POS = 64


def tiny_bert_kwargs(**overrides):
    """TransformerConfig kwargs of a tiny BERT (exact GeLU everywhere, eps 1e-5, dropout off)."""
    kw = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    kw.update(overrides)
    return kw


def build_bert(config_kwargs, **model_overrides):
    """BertModel for the current parallel state (binary head, 2 token types, tied by default)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    extra = {'pipeline_dtype': torch.float32} if pp > 1 else {}
    config = TransformerConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **extra, **config_kwargs
    )
    model_kwargs = dict(
        num_tokentypes=2,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=MAX_POS,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        add_binary_head=True,
    )
    model_kwargs.update(model_overrides)
    return BertModel(config=config, **model_kwargs), config


def batch(seed=5):
    """A padded BERT batch: ids, types, padding mask (row 1 padded after 11 tokens), labels,
    loss mask (a few non-pad positions), sentence-order labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types[:, SEQ // 2 :] = 1
    padding_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding_mask[1, 11:] = 0
    ids[1, 11:] = 0
    types[1, 11:] = 0
    labels = torch.full((BATCH, SEQ), -1, dtype=torch.long)
    loss_mask = torch.zeros(BATCH, SEQ)
    for b, positions in ((0, (1, 4, 9, 14)), (1, (2, 3, 7))):
        for p in positions:
            labels[b, p] = int(torch.randint(0, VOCAB, (1,), generator=g))
            loss_mask[b, p] = 1.0
    is_random = torch.tensor([0, 1])
    return dict(
        ids=ids,
        types=types,
        padding_mask=padding_mask,
        labels=labels,
        loss_mask=loss_mask,
        is_random=is_random,
    )


def bert_partition_dim(name):
    """TP split dimension of a BertModel parameter (the output-layer bias is split along v)."""
    if name == 'output_layer.bias':
        return 0
    return tensor_parallel_partition_dim(name)


def gather_full(named_tensors):
    """Gather the TP shards of `{name: tensor}` into full (TP=1) tensors."""
    out = {}
    for name in sorted(named_tensors):
        t = named_tensors[name].detach()
        dim = bert_partition_dim(name)
        out[name] = t.clone() if dim is None else torch.cat(_all_gather_tp(t), dim=dim)
    return out


def split_full(full, name):
    """This TP rank's shard of a full tensor."""
    dim = bert_partition_dim(name)
    if dim is None:
        return full.clone()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return torch.chunk(full, tp, dim=dim)[parallel_state.get_tensor_model_parallel_rank()].clone()
