"""What one training step does besides forward, backward and the optimizer: the loss functions'
dicts reduced over the micro-batches (Megatron's rule) and the model hooks the loop calls around
the optimizer step (DINO's)."""

from megatron.core.utils import unwrap_model


def _call_model_hook(model, name, iteration):
    """Megatron's vision hooks (DINO's `cancel_gradients_last_layer` before the optimizer step,
    `update_momentum` after it): called when the unwrapped first model chunk has the method."""
    hook = getattr(unwrap_model(model[0]), name, None)
    if callable(hook):
        hook(iteration)


def reduce_losses_over_microbatches(losses_reduced):
    """The iteration's value of each key of the loss functions' dicts (Megatron's rule).

    A (numerator, denominator) pair (the 3-tuple loss functions' token sums) is summed over the
    micro-batches, then divided; a tensor is averaged over the micro-batches.
    """
    loss_reduced = {}
    for key in losses_reduced[0].keys():
        numerator = 0
        denominator = 0
        for x in losses_reduced:
            val = x[key]
            if isinstance(val, (tuple, list)):
                numerator += val[0]
                denominator += val[1]
            else:
                numerator += val
                denominator += 1
        loss_reduced[key] = numerator / denominator
    return loss_reduced


# Iteration of the last checkpoint this process saved (None: none yet).
_LAST_SAVED_ITERATION = None
