"""Data loading pieces of the training layer (samplers, data loaders)."""
