"""The older name of tools/checkpoint/convert.py (same command line)."""

import os
import runpy
import sys

if __name__ == '__main__':
    sys.argv[0] = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), 'checkpoint', 'convert.py'
    )
    runpy.run_path(sys.argv[0], run_name='__main__')
