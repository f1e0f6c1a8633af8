"""Pieces of the training loop split out of `megatron.training.training`: evaluation on the
validation and test sets, and wrapping the model for data parallelism (DDP, FSDP).
"""
