"""Mixture of experts: router, token dispatchers, experts, shared experts and the MoE layer."""
