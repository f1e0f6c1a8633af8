"""Estimates of memory use per rank for model families beyond the dense case computed in
`megatron.training.theoretical_memory_usage` (MoE, and those added later).
"""
