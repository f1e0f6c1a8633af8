"""Megatron's legacy models (megatron/legacy/model of core_r0.8.0): names only, not included.

Every class and builder of Megatron's `megatron.legacy.model` namespace is importable, and using
one raises a one-line `NotImplementedError`: the megatron.core models (`GPTModel`, `BertModel`,
`T5Model`, the default of `--use-mcore-models`) are the only implementation here.
"""

__all__ = [
    'BertModel',
    'Float16Module',
    'GPTModel',
    'LayerNorm',
    'RMSNorm',
    'T5Model',
    'get_language_model',
]


def _refuse(name, replacement):
    raise NotImplementedError(
        f'megatron.legacy.model.{name}: legacy models are not included in this package; use '
        f'{replacement} (the megatron.core models; drop --use-legacy-models)'
    )


class _LegacyOnly:
    """A legacy class: importable, refuses to be built."""

    _replacement = 'the megatron.core models'

    def __init__(self, *args, **kwargs):
        _refuse(type(self).__name__, self._replacement)


class GPTModel(_LegacyOnly):
    _replacement = 'megatron.core.models.gpt.GPTModel'


class BertModel(_LegacyOnly):
    _replacement = 'megatron.core.models.bert.bert_model.BertModel'


class T5Model(_LegacyOnly):
    _replacement = 'megatron.core.models.T5.T5Model'


class Float16Module(_LegacyOnly):
    _replacement = 'megatron.core.transformer.module.Float16Module'


class LayerNorm(_LegacyOnly):
    _replacement = 'the normalization of megatron.core.transformer (config.normalization)'


class RMSNorm(_LegacyOnly):
    _replacement = 'the normalization of megatron.core.transformer (config.normalization)'


def get_language_model(*args, **kwargs):
    """Legacy builder of the language model: refuses."""
    _refuse('get_language_model', 'megatron.core.models.gpt.GPTModel')
