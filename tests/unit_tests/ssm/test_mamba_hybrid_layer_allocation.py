"""The hybrid allocation reproduces Megatron core_r0.8.0's patterns (literal strings from its
algorithm), its override checks and its log lines."""

import logging

import pytest

from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

R08_PATTERNS = [
    ((48, 0.08, 0.5), 'M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-'),
    ((56, 0.08, 0.5), 'M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-'),
    ((10, 0.2, 0.0), 'MMM*MM*MMM'),
    ((24, 0.125, 0.0), 'MMMMM*MMMMMM*MMMMM*MMMMM'),
    ((10, 0.0, 0.5), 'M-M-M-M-M-'),
    ((8, 0.0, 0.25), 'MMM-MMM-'),
    ((8, 0.25, 0.25), 'MM*-M*M-'),
    ((4, 0.5, 0.0), 'M**M'),
    ((10, 0.25, 0.0), 'MMM*MM*MMM'),
    ((3, 0.5, 0.5), '*-*'),
    ((5, 0.5, 0.5), 'M*-*-'),
    ((7, 0.5, 0.5), '-**-**-'),
    ((6, 0.0, 0.0), 'MMMMMM'),
    ((1, 1.0, 0.0), '*'),
]


@pytest.mark.parametrize('args,pattern', R08_PATTERNS)
def test_r08_patterns(args, pattern):
    assert ''.join(allocate_layers(*args)) == pattern


def test_counts_and_spacing_grid():
    """Over a grid, the counts are Python's round of L * ratio (or what r0.8 leaves) and every
    pattern has L symbols; attention never sits at either end unless forced."""
    for layers in range(1, 33):
        for ra in (0.0, 0.1, 0.25, 0.5):
            for rm in (0.0, 0.2, 0.5):
                if ra + rm > 1:
                    continue
                pattern = allocate_layers(layers, ra, rm)
                assert len(pattern) == layers
                assert pattern.count('*') == round(layers * ra)
                if round(layers * ra) < layers / 2 and '*' in pattern:
                    assert pattern[0] != '*' and pattern[-1] != '*'


def test_override_and_errors(caplog):
    with caplog.at_level(logging.INFO):
        assert ''.join(allocate_layers(4, 0.25, 0.25, 'M*-M')) == 'M*-M'
    text = [r.getMessage() for r in caplog.records]
    assert text[:5] == [
        'Using hybrid override pattern',
        'Warning: overriding pattern A with pattern B',
        'A: MM*-',
        'B: M*-M',
        'Hybrid allocation (M is mamba, * is attention, - is mlp):',
    ]
    assert text[5:] == [
        'M*-M',
        '1 attention layers in 4 total layers.',
        'Target attention ratio: 0.25. Actual attention ratio: 0.25.',
        '1 mlp layers in 4 total layers.',
        'Target mlp ratio: 0.25. Actual mlp ratio: 0.25.',
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        allocate_layers(4, 0.0, 0.0)
    assert caplog.records == []
    with caplog.at_level(logging.INFO):
        allocate_layers(4, 0.25, 0.25, 'MM*-')
    assert 'The override pattern matches the overridden pattern' in caplog.text
    assert ''.join(allocate_layers(3, 0.0, 0.0, '*-*')) == '*-*'
    with pytest.raises(ValueError, match='wrong length: got 3, expected 4'):
        allocate_layers(4, 0.0, 0.0, 'M*-')
    with pytest.raises(ValueError, match="'X' is not one of"):
        allocate_layers(4, 0.0, 0.0, 'M*-X')
    with pytest.raises(ValueError, match='must match the number in the overridden'):
        allocate_layers(4, 0.25, 0.0, 'M**M')
    with pytest.raises(ValueError, match=r'hybrid_attention_ratio \(1.5\) must be in'):
        allocate_layers(4, 1.5, 0.0)
    with pytest.raises(ValueError, match='must not exceed 1.0'):
        allocate_layers(4, 0.6, 0.6)
