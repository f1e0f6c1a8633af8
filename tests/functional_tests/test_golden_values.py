"""Golden values: each case's per-step losses (its METRICS, e.g. lm loss, sop loss) match its
golden_values.json (numpy.isclose with the case's RTOL, atol 0), as Megatron's functional tests
compare them. Goldens come from generate_golden_values.py, never typed by hand."""

import json
import os

import numpy as np
import pytest

from tests.functional_tests.golden_utils import (
    CASES_DIR,
    MODELS,
    list_cases,
    load_case,
    model_of,
    run_case,
)


@pytest.mark.parametrize('case', list_cases())
def test_golden_values(case, request, tmp_path):
    data_prefix = request.getfixturevalue(MODELS[model_of(case)][2])
    golden_path = os.path.join(CASES_DIR, case, 'golden_values.json')
    with open(golden_path) as f:
        golden = json.load(f)
    rtol = float(load_case(case)['RTOL'])
    actual = run_case(case, data_prefix, str(tmp_path))
    for metric, spec in golden.items():
        steps = list(range(spec['start_step'], spec['end_step'] + 1, spec['step_interval']))
        assert sorted(int(s) for s in spec['values']) == steps
        expected = np.array([spec['values'][str(s)] for s in steps])
        got = np.array([actual[metric][s] for s in steps])
        bad = ~np.isclose(got, expected, rtol=rtol, atol=0)
        assert not bad.any(), (
            f'{case} {metric}: steps {np.array(steps)[bad].tolist()} got {got[bad].tolist()} '
            f'expected {expected[bad].tolist()} (rtol {rtol})'
        )
