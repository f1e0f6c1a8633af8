"""Gradient reductions that finish a training step, run once after the forward-backward schedule.

The schedules call `config.finalize_model_grads_func(model, num_tokens)`; Megatron's training loop
sets it to `finalize_model_grads`. In order:

1. data-parallel reduction: `finish_grad_sync()` on every model chunk that has it (DDP wrappers);
2. layer-norm grads under sequence parallelism: each TP rank saw only s/tp of the sequence, so
   gradients of params marked `sequence_parallel` (and qk-layernorm params) are all-reduced over TP;
3. tied word embeddings: the first stage's input embedding and the last stage's output layer are
   copies of one weight, so their gradients are all-reduced over the embedding group;
   with a pipeline split rank (encoder-decoder), position embeddings likewise over the
   position-embedding group;
4. MoE expert biases (aux-loss-free balancing) move once from the global batch's token counts;
5. per-token loss: gradients are divided by the total token count, all-reduced over DP.

Gradients are read from `param.main_grad` when the param has one (DDP's contiguous buffer),
else from `param.grad`. The groups come from `pg_collection` (tp, pp, embd, pos_embd, dp), each
None falling back to the global group.
"""

from typing import List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.distributed.sharded_tensors import local_tensor
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.utils import get_attr_wrapped_model, get_model_config


def _get_main_grad_attr(param: torch.nn.Parameter) -> str:
    return 'main_grad' if hasattr(param, 'main_grad') else 'grad'


def _grad_for_reduction(param: torch.nn.Parameter) -> torch.Tensor:
    """The gradient tensor of `param` to reduce in place (main_grad if present, else .grad).

    A param that received no gradient on this rank gets a zero `.grad`, so that every rank of the
    group joins the collective with a tensor of the right shape.
    """
    attr = _get_main_grad_attr(param)
    grad = getattr(param, attr)
    if grad is None:
        grad = torch.zeros_like(param)
        setattr(param, attr, grad)
    return grad


def _allreduce_word_embedding_grads(model: List[torch.nn.Module], config, pgs=None) -> None:
    """All-reduce the tied word-embedding grads between the first and last pipeline stages.

    The first stage owns the input embedding (model[0]), the last the output layer (model[-1]
    with virtual stages); both are copies of `shared_embedding_or_output_weight()`.
    """
    pgs = pgs if pgs is not None else resolve_process_groups(None, ("pp", "embd"))
    if pgs.embd is not None and pgs.pp.size() > 1:
        if pgs.pp.rank() == 0:
            model_module = model[0]
        elif pgs.pp.rank() == pgs.pp.size() - 1:
            model_module = model[-1]
        else:  # We do not support an interleaved schedule for models with encoders yet.
            model_module = model[0]

        model_module = get_attr_wrapped_model(model_module, 'pre_process', return_model_obj=True)
        ties = getattr(model_module, 'ties_word_embedding_across_stages', None)
        tied = ties() if ties is not None else False
        if tied or getattr(model_module, 'share_embeddings_and_output_weights', False):
            weight = model_module.shared_embedding_or_output_weight()
            grad = _grad_for_reduction(weight)
            torch.distributed.all_reduce(grad, group=pgs.embd)


def _allreduce_position_embedding_grads(model: List[torch.nn.Module], config, pgs=None) -> None:
    """All-reduce position-embedding grads between the first stage and the split-rank stage.

    Only encoder-decoder models (pipeline_model_parallel_split_rank set) keep two copies of the
    input embedding. Untied, the word table's two copies are reduced over the same group (tied,
    the embedding group already covers them).
    """
    pgs = pgs if pgs is not None else resolve_process_groups(None, ("pp", "pos_embd"))
    if (
        pgs.pos_embd is not None
        and pgs.pp.size() > 1
        and config.pipeline_model_parallel_split_rank is not None
    ):
        model_module = get_attr_wrapped_model(model[0], 'pre_process', return_model_obj=True)
        embedding = model_module.embedding
        group = pgs.pos_embd
        if getattr(embedding, 'add_position_embedding', True):
            grad = _grad_for_reduction(embedding.position_embeddings.weight)
            torch.distributed.all_reduce(grad, group=group)
        if not getattr(model_module, 'share_embeddings_and_output_weights', False):
            grad = _grad_for_reduction(embedding.word_embeddings.weight)
            torch.distributed.all_reduce(grad, group=group)


def _allreduce_embedding_grads(model: List[torch.nn.Module], config, pgs=None) -> None:
    """All-reduce word and position embedding grads shared across pipeline stages."""
    pgs = pgs if pgs is not None else resolve_process_groups(None, ("pp", "embd", "pos_embd"))
    _allreduce_word_embedding_grads(model, config, pgs)
    _allreduce_position_embedding_grads(model, config, pgs)


def _allreduce_layernorm_grads(model: List[torch.nn.Module], config, pgs=None) -> None:
    """All-reduce grads of sequence-parallel norm params (and qk-layernorm params) over TP.

    Under sequence parallelism each TP rank applies the (replicated) norm to s/tp tokens, so its
    gradient is a partial sum; one coalesced all-reduce completes it.
    """
    pgs = pgs if pgs is not None else resolve_process_groups(None, ("tp",))
    if pgs.tp.size() > 1 and (config.sequence_parallel or getattr(config, 'qk_layernorm', False)):
        grads = []
        for model_chunk in model:
            for name, param in get_attr_wrapped_model(model_chunk, 'named_parameters')():
                if param.requires_grad and (
                    getattr(param, 'sequence_parallel', False)
                    or (
                        ('q_layernorm' in name or 'k_layernorm' in name)
                        # MLA's latent norms are not per-head: full gradients on every rank.
                        and not getattr(param, 'is_latent_norm', False)
                    )
                ):
                    # A sharded (FSDP2) grad: every TP rank holds the same data-parallel shard.
                    grads.append(local_tensor(_grad_for_reduction(param).data))
        if grads:
            coalesced = _flatten_dense_tensors(grads)
            torch.distributed.all_reduce(coalesced, group=pgs.tp)
            for buf, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
                buf.copy_(synced)


def _update_router_expert_bias(model: List[torch.nn.Module]) -> None:
    """Expert-bias update of every MoE router of this rank's chunks, from the token counts of the
    whole global batch (summed over the tensor x data x context parallel group)."""
    from megatron.core import group_fallbacks
    from megatron.core.transformer.moe.router import TopKRouter, update_expert_bias

    routers = [
        module
        for model_chunk in model
        for module in model_chunk.modules()
        if isinstance(module, TopKRouter)
    ]
    # The global tensor x data x context parallel group (no collection field carries it).
    group = group_fallbacks.get_tensor_and_data_parallel_group_if_none(
        None, with_context_parallel=True
    )
    update_expert_bias(routers, group)


def _scale_gradients(model_chunk: torch.nn.Module, scaling_factor: float) -> None:
    if hasattr(model_chunk, 'scale_gradients'):
        model_chunk.scale_gradients(scaling_factor)
        return
    for param in model_chunk.parameters():
        grad = getattr(param, _get_main_grad_attr(param))
        if grad is not None:
            grad.mul_(scaling_factor)


def finalize_model_grads(
    model: List[torch.nn.Module],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
):
    """Finish all gradient reductions of a step (see the module docstring for the order).

    Args:
        model: the model chunks of this rank (one per virtual pipeline stage).
        num_tokens: total tokens of the step on this pipeline's last stage when the loss is
            normalised per token (`calculate_per_token_loss`); None otherwise.
        pg_collection: the tp, pp, embd, pos_embd and dp_cp (data x context parallel) groups
            (None: the global ones).
    """
    config = get_model_config(model[0])
    pgs = resolve_process_groups(pg_collection, ("tp", "pp", "embd", "pos_embd", "dp_cp"))

    def start(name):
        if config.timers is not None:
            config.timers(name, log_level=1).start(barrier=config.barrier_with_L1_time)

    def stop(name):
        if config.timers is not None:
            config.timers(name).stop()

    # All-reduce / reduce-scatter across DP replicas.
    start('all-grads-sync')
    for model_chunk in model:
        if hasattr(model_chunk, 'finish_grad_sync'):
            model_chunk.finish_grad_sync()
    stop('all-grads-sync')

    # All-reduce layer-norm grads (for sequence parallelism).
    start('layernorm-grads-all-reduce')
    _allreduce_layernorm_grads(model, config, pgs)
    stop('layernorm-grads-all-reduce')

    # All-reduce embedding grads (for pipeline parallelism).
    start('embedding-grads-all-reduce')
    _allreduce_embedding_grads(model, config, pgs)
    stop('embedding-grads-all-reduce')

    # Aux-loss-free MoE balancing: move the routers' expert biases once per global batch.
    if getattr(config, 'moe_router_enable_expert_bias', False):
        _update_router_expert_bias(model)

    # Normalize gradients for per-token loss normalization.
    if num_tokens is not None:
        num_tokens = torch.as_tensor(num_tokens).to(
            device=next(model[0].parameters()).device, dtype=torch.int64
        )
        # The number of tokens is only present on the last stage, so broadcast it to the other
        # ranks in the pipeline parallel group.
        torch.distributed.broadcast(
            num_tokens,
            src=torch.distributed.get_process_group_ranks(pgs.pp)[-1],
            group=pgs.pp,
        )
        # All-reduce across DP ranks and context-parallel ranks (each counted its own tokens;
        # the gradients were summed over the same DP x CP group).
        torch.distributed.all_reduce(num_tokens, group=pgs.dp_cp)
        for model_chunk in model:
            if num_tokens > 0:
                _scale_gradients(model_chunk, 1.0 / num_tokens.item())
