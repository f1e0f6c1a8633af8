"""A micro-batch with no loss token (its loss sum is 0) adds 0 to the step, not 0 / 0 = NaN."""

import torch

from tests.unit_tests.dist_utils import run_distributed


class _Linear(torch.nn.Module):
    def __init__(self):
        from megatron.core.enums import ModelType

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.ones(3))

    def set_input_tensor(self, tensor):
        pass

    def forward(self, x):
        return x * self.weight


def _zero_token_loss():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.microbatch_step import forward_step

    model = _Linear()

    def step(data_iterator, model):
        x, mask = next(data_iterator)
        out = model(x)

        def loss_func(output):
            total = (output * mask).sum()
            count = mask.sum().to(torch.int)
            return total, count, {'lm loss': (total.detach(), count)}

        return out, loss_func

    outs = {}
    for name, mask in (('none', torch.zeros(3)), ('some', torch.tensor([1.0, 0.0, 1.0]))):
        store = []
        loss, count = forward_step(
            step, iter([(torch.arange(3.0), mask)]), model, 1, None, store, ModelParallelConfig()
        )
        loss.backward()
        outs[name] = (float(loss), int(count), model.weight.grad.clone())
        model.weight.grad = None
    return outs


def test_microbatch_without_loss_tokens_adds_zero():
    (outs,) = run_distributed(_zero_token_loss, world_size=1)
    value, count, grad = outs['none']
    assert (value, count) == (0.0, 0) and torch.equal(grad, torch.zeros(3))
    value, count, grad = outs['some']
    assert (value, count) == (1.0, 2) and torch.equal(grad, torch.tensor([0.0, 0.0, 1.0]))
