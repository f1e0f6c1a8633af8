"""Megatron-LM style distributed training for transformer language models, on CPU (gloo) and GPU
(NCCL)."""
