"""See megatron/core/inference/__init__.py."""
