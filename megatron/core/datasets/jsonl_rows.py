"""Random access to the rows of a JSONL file, read at run time.

The file is scanned once for the byte offsets of its non-blank lines (numpy, in 16 MiB chunks, so
a multi-GB file costs one pass and 8 bytes per row); a row is then one seek, one read and one
`json.loads`. Blank lines are not rows. Nothing is tokenized or cached here.
"""

import json
import os
from typing import Any, Dict

import numpy

_CHUNK = 1 << 24


def _line_spans(path: str):
    """(starts, ends) byte offsets of every non-blank line (int64 arrays)."""
    size = os.path.getsize(path)
    newlines = []
    with open(path, "rb") as f:
        base = 0
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            buf = numpy.frombuffer(chunk, dtype=numpy.uint8)
            newlines.append(numpy.flatnonzero(buf == 10).astype(numpy.int64) + base)
            base += len(chunk)
    ends = numpy.concatenate(newlines) if newlines else numpy.zeros(0, dtype=numpy.int64)
    if size and (len(ends) == 0 or ends[-1] != size - 1):
        ends = numpy.append(ends, size)  # last line without a trailing newline
    starts = numpy.concatenate(([0], ends[:-1] + 1)).astype(numpy.int64)
    lengths = ends - starts
    keep = lengths > 0
    if keep.any():
        # A line of only whitespace is blank too (checked on the short lines only).
        with open(path, "rb") as f:
            for i in numpy.flatnonzero(keep & (lengths <= 8)):
                f.seek(int(starts[i]))
                if not f.read(int(lengths[i])).strip():
                    keep[i] = False
    return starts[keep], ends[keep]


class JSONLRows:
    """The non-blank lines of a JSONL file, each parsed on access.

    Args:
        path: the .jsonl file.

    Raises:
        FileNotFoundError: no such file.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such JSONL file: {path}")
        self.path = path
        self._starts, self._ends = _line_spans(path)
        self._fd = None

    def __len__(self) -> int:
        return len(self._starts)

    def line_number(self, idx: int) -> int:
        """1-based line number of row `idx` in the file (for error messages)."""
        with open(self.path, "rb") as f:
            return f.read(int(self._starts[idx])).count(b"\n") + 1

    def raw(self, idx: int) -> bytes:
        """The bytes of row `idx`."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        # pread has no file position: safe in threads and in forked DataLoader workers.
        return os.pread(self._fd, int(self._ends[idx] - self._starts[idx]), int(self._starts[idx]))

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        """Row `idx` parsed as JSON.

        Raises:
            ValueError: the line is not valid JSON (names the file and the line).
        """
        try:
            return json.loads(self.raw(idx))
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{self.path} line {self.line_number(idx)}: not valid JSON ({exc.msg})"
            ) from None

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fd"] = None
        return state
