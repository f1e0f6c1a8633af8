"""Weights-only unpickling of checkpoint objects (`common.pt` and stored objects).

A leaf module: the serialization entry points and the torch_dist strategy both read objects
with it.
"""

import argparse
import io
import zipfile
from typing import Any, Union

import torch

from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.enums import ModelType

#: Classes (besides tensors and plain containers) that may be unpickled from common.pt and
#: stored objects.
SAFE_GLOBALS = [argparse.Namespace, ModelType]


def weights_only_load(
    source: Union[str, io.BytesIO], what: str = 'checkpoint file', mmap: bool = False
) -> Any:
    """torch.load(weights_only=True) with SAFE_GLOBALS; a refusal names the offending global.

    `mmap` maps a zip-format file instead of reading it (its tensors come from the page cache).
    """
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            if mmap and isinstance(source, str) and zipfile.is_zipfile(source):
                return torch.load(source, map_location='cpu', weights_only=True, mmap=True)
            return torch.load(source, map_location='cpu', weights_only=True)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next(
            (line for line in lines if 'GLOBAL' in line or 'global' in line),
            lines[0] if lines else type(exc).__name__,
        )
        raise CheckpointingException(
            f'{what} cannot be loaded as weights only (tensors and plain data): {reason}'
        ) from exc
