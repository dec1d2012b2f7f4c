"""A byte-offset index of a JSONL file's lines (no pipeline stage needs one: it lives with the tests)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import orjson


class JsonlIndex:
    """Byte offsets of the lines of a JSONL file: `index.read(i)` seeks record i without loading the others.

    `offsets[i]` is where line i starts; `offsets[-1]` is the file size. Memory: 8 bytes per record.
    """

    def __init__(self, path: str | os.PathLike, offsets: np.ndarray):
        self.path = Path(path)
        self.offsets = offsets
        self._file: BinaryIO | None = None

    @classmethod
    def build(cls, path: str | os.PathLike, visit: Callable[[int, bytes], None] | None = None) -> "JsonlIndex":
        """Scan the file once; `visit(i, line)` sees every record line (e.g. to collect its category)."""
        offsets = [0]
        pos = 0
        with open(path, "rb") as f:
            for line in f:
                if visit is not None:
                    visit(len(offsets) - 1, line)
                pos += len(line)
                offsets.append(pos)
        return cls(path, np.asarray(offsets, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def read(self, i: int) -> bytes:
        """Line i, without its trailing newline."""
        if self._file is None:
            self._file = open(self.path, "rb")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        self._file.seek(start)
        return self._file.read(end - start).rstrip(b"\n")

    def get(self, i: int) -> dict:
        return orjson.loads(self.read(i))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "JsonlIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
