"""Regenerate tests/functional_tests/test_cases/*/*/golden_values.json by running each case.

Usage: python tests/functional_tests/generate_golden_values.py [case ...]
       (cases like gpt/gpt_tiny_tp2_pp2, bert/bert_tiny_tp2_pp2 or t5/t5_tiny_tp2_pp2_split1;
       default: all)
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.functional_tests.golden_utils import (  # noqa: E402
    CASES_DIR,
    MODELS,
    list_cases,
    model_of,
    run_case,
    to_golden_json,
)
from tests.unit_tests.dist_utils import shutdown_all_pools  # noqa: E402


def main(argv):
    cases = argv or list_cases()
    with tempfile.TemporaryDirectory() as work:
        prefixes = {}
        for case in cases:
            model = model_of(case)
            if model not in prefixes:
                prefixes[model] = MODELS[model][1](os.path.join(work, 'data', model))
            metrics = run_case(
                case, prefixes[model], os.path.join(work, 'cache', case.replace('/', '_'))
            )
            path = os.path.join(CASES_DIR, case, 'golden_values.json')
            with open(path, 'w') as f:
                json.dump(to_golden_json(metrics), f, indent=2)
                f.write('\n')
            print(f'wrote {path}')
    shutdown_all_pools()
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
