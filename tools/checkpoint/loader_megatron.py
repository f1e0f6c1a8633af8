"""Loader plugin `megatron`: the same checkpoints as loader_mcore (this project writes one
layout), with Megatron's default --loader-transformer-impl local."""

import loader_mcore
from loader_mcore import check_arguments, load_checkpoint  # noqa: F401


def add_arguments(parser):
    loader_mcore.add_arguments(parser, default_impl='local')
