"""Saver plugin `megatron`: the same layout as saver_mcore (this project writes one layout),
with Megatron's default --saver-transformer-impl local."""

import saver_mcore
from saver_mcore import check_arguments, save_checkpoint  # noqa: F401


def add_arguments(parser):
    saver_mcore.add_arguments(parser, default_impl='local', expert_flag=False)
