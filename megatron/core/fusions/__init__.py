"""Fused-op fallbacks written in plain PyTorch (same maths as Megatron's fused kernels)."""
