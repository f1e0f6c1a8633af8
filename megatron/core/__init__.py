"""megatron.core: the library. It never reads CLI arguments; it takes config dataclasses."""
