"""Shared pieces of the fully-sharded data-parallel tests: a tiny GPT trained a few steps through
the real schedule, finalize_model_grads and the Megatron optimizer, wrapped either in our DDP
(the unsharded reference) or in one of the fully sharded wrappers.

Imported inside spawned ranks (tests.unit_tests.dist_utils), so everything is module level.
"""

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.sharded_tensors import local_tensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.unit_tests.models.gpt_test_utils import VOCAB, build_gpt, llama_like_kwargs

SEQ, MBS = 16, 2


def build(arch='llama', tied=False, num_experts=None, **config_overrides):
    """A tiny GPT for the current parallel state, same init on every call (fixed seed).

    With `num_experts`, every layer's MLP is an MoE layer of that many SequentialMLP experts
    (top-2, no load balancing), split over parallel_state's expert-parallel size.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model_overrides = {}
    if num_experts is not None:
        config_overrides.update(
            num_moe_experts=num_experts,
            moe_router_topk=2,
            moe_router_load_balancing_type='none',
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        )
        model_overrides['transformer_layer_spec'] = get_gpt_layer_local_spec(num_experts)
    kwargs = llama_like_kwargs(finalize_model_grads_func=finalize_model_grads, **config_overrides)
    return build_gpt(
        kwargs, arch='llama', share_embeddings_and_output_weights=tied, **model_overrides
    )


def wrap_ddp(model, config, use_distributed_optimizer=False):
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer)
    return DistributedDataParallel(config, ddp_config, model)


def _batches(iteration, num_microbatches):
    """This DP rank's micro-batches of one global batch (same global batch at every DP size)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    gen = torch.Generator().manual_seed(100 + iteration)
    total = num_microbatches * MBS * dp_size
    tokens = torch.randint(0, VOCAB, (total, SEQ + 1), generator=gen)
    # Uneven token counts per micro-batch make per-token normalisation matter.
    mask = (torch.rand(total, SEQ, generator=gen) > 0.3).float()
    out = []
    for m in range(num_microbatches):
        lo = (m * dp_size + dp_rank) * MBS
        out.append(
            {
                'tokens': tokens[lo : lo + MBS, :-1],
                'labels': tokens[lo : lo + MBS, 1:],
                'mask': mask[lo : lo + MBS],
            }
        )
    return out


def _forward_step(per_token):
    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
        output = model(batch['tokens'], position_ids, None, labels=batch['labels'])

        def loss_func(output_tensor):
            losses = output_tensor.float() * batch['mask']
            num_tokens = batch['mask'].sum().to(torch.int)
            loss_sum = losses.sum()
            report = torch.stack([loss_sum.detach(), num_tokens.float()])
            if per_token:
                return loss_sum, num_tokens, {'lm loss': report}
            return loss_sum / num_tokens, {'lm loss': report}

        return output, loss_func

    return forward_step


def train(model, config, iterations=3, num_microbatches=1, per_token=False, lr=1e-2, bf16=False):
    """Run `iterations` optimizer steps; return per-step (global mean loss, grad norm)."""
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            lr=lr,
            clip_grad=1.0,
            bf16=bf16,
            weight_decay=0.01,
            use_distributed_optimizer=getattr(
                getattr(model, 'ddp_config', None), 'use_distributed_optimizer', False
            ),
        ),
        [model],
    )
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()
    losses, norms = [], []
    for iteration in range(iterations):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        batches = _batches(iteration, num_microbatches)
        reduced = forward_backward(
            forward_step_func=_forward_step(per_token),
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        report = torch.stack([r['lm loss'] for r in reduced]).sum(0)
        torch.distributed.all_reduce(report, group=parallel_state.get_data_parallel_group())
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append((report[0] / report[1]).item())
        norms.append(grad_norm)
    return losses, norms, optimizer


def rank_state_bytes(model, optimizer):
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards only)."""
    seen = set()
    total = 0

    def add(tensor):
        nonlocal total
        if tensor is None or not isinstance(tensor, torch.Tensor):
            return
        tensor = local_tensor(tensor)
        key = (tensor.untyped_storage().data_ptr(), tensor.dtype)
        if tensor.numel() == 0 or key in seen:
            return
        seen.add(key)
        total += tensor.untyped_storage().nbytes()

    for module in model.modules():
        # Tensors a module keeps outside its parameters (a full copy would show here).
        for value in vars(module).values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, torch.Tensor) and not isinstance(item, torch.nn.Parameter):
                    add(item)
        state = getattr(module, '_get_fsdp_state', None)
        group = getattr(state(), '_fsdp_param_group', None) if state is not None else None
        for fsdp_param in getattr(group, 'fsdp_params', []):
            # FSDP2's gathered copy of a parameter: its storage must be freed after backward.
            unsharded = getattr(fsdp_param, '_unsharded_param', None)
            if unsharded is not None:
                add(unsharded.data)
    for param in model.parameters():
        add(param)
        add(param.grad)
        add(getattr(param, 'main_grad', None))
    for buffer in (
        getattr(model, 'buffers', []) if isinstance(model, DistributedDataParallel) else []
    ):
        add(buffer.grad_data)
        add(buffer.param_data)
    inner = optimizer
    for opt in getattr(inner, 'chained_optimizers', [inner]):
        for group in opt.optimizer.param_groups:
            for param in group['params']:
                add(param)
                add(param.grad)
                for value in opt.optimizer.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        add(value)
    return total
