"""Megatron's log lines (as printed by
megatron/training/logging/training_log.py::training_log) and the FLOPs formula."""

import math
import re
from datetime import datetime
from types import SimpleNamespace

from megatron.training.training import format_log_line, format_validation_line
from megatron.training.utils import num_floating_point_operations


def test_training_log_line_format():
    line = format_log_line(
        iteration=20,
        train_iters=200,
        consumed_samples=320,
        elapsed_ms=123.456,
        learning_rate=1e-3,
        batch_size=16,
        losses={'lm loss': 7.25, 'zero loss': 0.0},
        loss_scale=1.0,
        grad_norm=1.23456,
        num_zeros_in_grad=None,
        params_norm=None,
        skipped=1,
        nan=0,
        throughput=0.0123,
        timestamp=datetime(2024, 8, 12, 1, 2, 3),
    )
    expected = (
        ' [2024-08-12 01:02:03] iteration       20/     200 | consumed samples:          320 |'
        ' elapsed time per iteration (ms): 123.5 | throughput per GPU (TFLOP/s/GPU): 0.0123 |'
        ' learning rate: 1.000000E-03 | global batch size:    16 | lm loss: 7.250000E+00 |'
        ' loss scale: 1.0 | grad norm: 1.235 | number of skipped iterations:   1 |'
        ' number of nan iterations:   0 |'
    )
    assert line == expected


def test_throughput_keeps_three_significant_digits_below_10_tflops():
    def shown(tflops):
        line = format_log_line(1, 10, 4, 5.0, 0.0, 4, {}, 1.0, throughput=tflops)
        return re.search(r'\(TFLOP/s/GPU\): (\S+) \|', line).group(1)

    # Megatron's one decimal at GPU rates; a CPU run's fraction of a TFLOP/s stays readable.
    assert [shown(x) for x in (312.44, 10.0, 5.678, 0.04567, 0.000123456)] == [
        '312.4',
        '10.0',
        '5.68',
        '0.0457',
        '0.000123',
    ]


def test_training_log_line_optional_fields():
    line = format_log_line(
        1,
        10,
        4,
        5.0,
        0.0,
        4,
        {'lm loss': 10.5},
        65536.0,
        grad_norm=None,
        num_zeros_in_grad=3.0,
        params_norm=12.5,
    )
    assert re.fullmatch(
        r' \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration        1/      10 \| consumed samples: +4 '
        r'\| elapsed time per iteration \(ms\): 5\.0 \| learning rate: 0\.000000E\+00 \| global '
        r'batch size:     4 \| lm loss: 1\.050000E\+01 \| loss scale: 65536\.0 \| num zeros: 3\.0 '
        r'\| params norm: 12\.500 \| number of skipped iterations:   0 \| number of nan '
        r'iterations:   0 \|',
        line,
    )


def test_validation_line_format():
    line = format_validation_line('iteration 100', {'lm loss': 25.0})
    assert line == (
        ' validation loss at iteration 100 | lm loss value: 2.500000E+01 | lm loss PPL: '
        f'{math.exp(20):.6E} | '
    )


def test_flops_formula_by_hand():
    args = SimpleNamespace(
        kv_channels=64,
        num_attention_heads=12,
        hidden_size=768,
        group_query_attention=False,
        num_query_groups=1,
        num_experts=None,
        moe_router_topk=2,
        swiglu=False,
        seq_length=1024,
        num_layers=12,
        ffn_hidden_size=3072,
        padded_vocab_size=50304,
    )
    B, s, L, h, V = 8, 1024, 12, 768, 50304
    # Dense GPT: 24 B s L h^2 (QKV/proj) + 4 B s^2 L h (attention) + 48 B s L h^2 (MLP, 4h) + 6 B s
    # h V (logits).
    by_hand = (
        24 * B * s * L * h * h + 12 * B * s * s * L * h + 48 * B * s * L * h * h + 6 * B * s * h * V
    )
    assert num_floating_point_operations(args, B) == by_hand
