"""megatron.training: the application layer (arguments, global state, the training loop)."""
