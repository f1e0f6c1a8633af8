"""Megatron's legacy (pre-megatron.core) code: not included in this package.

`megatron.legacy.model` exists so that scripts importing it (Megatron core_r0.8.0's
pretrain_gpt.py, pretrain_bert.py and pretrain_t5.py do, for `--use-legacy-models`) still import;
building a legacy model stops with one line pointing at the megatron.core models.
"""
