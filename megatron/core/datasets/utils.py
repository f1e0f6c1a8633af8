"""Small shared pieces of the dataset package: the Split enum, weight normalisation, rank-0
logging, `--data-path` parsing and the on-first-use build of the C++ helpers."""

import fcntl
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from enum import Enum
from typing import List, Optional, Tuple

import numpy
import torch

logger = logging.getLogger(__name__)

_HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))
_HELPERS_SRC = os.path.join(_HELPERS_DIR, "helpers.cpp")


class Split(Enum):
    """The three dataset splits, in `--split` order."""

    train = 0
    valid = 1
    test = 2


def compile_helpers() -> None:
    """Build `helpers.cpp` into the extension `megatron.core.datasets.helpers_cpp`, in place.

    `pip install` (setup.py) normally builds it; this is the fallback for source checkouts. The
    build is serialised with a file lock so concurrent ranks do not race, and the library is written
    under a temporary name then renamed.

    Raises:
        RuntimeError: when no C++ compiler or no pybind11 is available, or the compile fails.
    """
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = os.path.join(_HELPERS_DIR, "helpers_cpp" + suffix)
    if _is_fresh(target):
        return
    try:
        import pybind11
    except ImportError as exc:
        raise RuntimeError(
            "megatron.core.datasets.helpers_cpp is not built and pybind11 is not installed; "
            "run `pip install pybind11` then `pip install -e .`"
        ) from exc
    cxx = (
        os.environ.get("CXX")
        or shutil.which("c++")
        or shutil.which("g++")
        or shutil.which("clang++")
    )
    if cxx is None:
        raise RuntimeError(
            "megatron.core.datasets.helpers_cpp is not built and no C++ compiler was found (looked "
            "for $CXX, c++, g++, clang++); install one (e.g. `apt-get install g++`) or install a "
            "wheel built elsewhere"
        )
    lock_path = os.path.join(tempfile.gettempdir(), "megatron_helpers_cpp_build.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_fresh(target):
                return
            tmp = target + f".tmp{os.getpid()}"
            cmd = [
                cxx,
                "-O3",
                "-Wall",
                "-shared",
                "-std=c++17",
                "-fPIC",
                "-fvisibility=hidden",
                f"-I{pybind11.get_include()}",
                f"-I{sysconfig.get_paths()['include']}",
                _HELPERS_SRC,
                "-o",
                tmp,
            ]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(
                    f"compiling {_HELPERS_SRC} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}"
                )
            os.replace(tmp, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _is_fresh(target: str) -> bool:
    """Whether the built extension exists and is not older than helpers.cpp."""
    if not os.path.exists(target):
        return False
    return not os.path.exists(_HELPERS_SRC) or os.path.getmtime(target) >= os.path.getmtime(
        _HELPERS_SRC
    )


def normalize(weights: List[float]) -> List[float]:
    """Scale non-negative weights to sum to 1 (float64 arithmetic, returned as Python floats)."""
    w = numpy.array(weights, dtype=numpy.float64)
    w_sum = numpy.sum(w)
    w = (w / w_sum).tolist()
    return w


def log_single_rank(logger: logging.Logger, *args, rank: int = 0, **kwargs) -> None:
    """Log through `logger` only on global rank `rank` (always when torch.distributed is off)."""
    if torch.distributed.is_initialized():
        if torch.distributed.get_rank() == rank:
            logger.log(*args, **kwargs)
    else:
        logger.log(*args, **kwargs)


def get_blend_from_list(
    blend: Optional[List[str]],
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Parse `--data-path`-style lists into (prefixes, weights or None).

    An odd-length list, or an even one whose would-be weights are not all floats, is prefixes only.
    Otherwise it alternates `weight prefix weight prefix ...`.

    Raises:
        ValueError: when a weight is negative or all weights are zero.
    """
    if blend is None:
        return None
    if len(blend) == 0:
        raise ValueError("--data-path: the blend list is empty")
    prefixes_only = [entry.strip() for entry in blend]
    if len(blend) % 2 == 1:
        return prefixes_only, None
    # Even length: the even positions are weights if they all parse as numbers.
    weights = [_as_float(entry) for entry in blend[0::2]]
    parsed = [w is not None for w in weights]
    if not any(parsed):
        return prefixes_only, None
    if not all(parsed):
        raise ValueError(
            f"--data-path: cannot tell weights from prefixes in {blend}; give either only "
            "prefixes or 'weight prefix' pairs"
        )
    if min(weights) < 0:
        raise ValueError(f"--data-path: blend weights must be >= 0, got {weights}")
    if sum(weights) <= 0:
        raise ValueError(f"--data-path: blend weights sum to 0: {weights}")
    return [entry.strip() for entry in blend[1::2]], weights


def _as_float(text: str) -> Optional[float]:
    """`float(text)`, or None when the text is not a number (then it is a prefix)."""
    try:
        return float(text)
    except ValueError:
        return None
