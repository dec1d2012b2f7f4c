"""Progress of a long stage: a tqdm bar on a terminal; whole plain lines when stderr is a file or a pipe.

tqdm redraws its bar with carriage returns, which in a log file or a CI console become fragments interleaved with
the stage summaries; plain lines (`[tokenize] 12.3M/45.6M B (27%) 4s`) every `interval` seconds and one at the
end stay readable there.
"""
from __future__ import annotations

import sys
import time
from typing import IO, Iterable, Iterator

PLAIN_INTERVAL = 10.0  # seconds between plain lines


def _amount(n: float, unit_scale: bool) -> str:
    if not unit_scale:
        return f"{int(n):,}"
    for prefix in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{prefix}" if prefix else f"{int(n)}"
        n /= 1000
    return f"{n:.1f}P"


class PlainProgress:
    """tqdm's `update` / `close` / iteration / context-manager surface, printing whole lines."""

    def __init__(self, iterable: Iterable | None = None, desc: str = "", total: float | None = None,
                 unit: str = "it", unit_scale: bool = False, stream: IO[str] | None = None,
                 interval: float = PLAIN_INTERVAL):
        self.iterable, self.desc, self.unit, self.unit_scale = iterable, desc, unit, unit_scale
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.n = 0
        self.start = self.last = time.monotonic()
        self.closed = False

    def _line(self, now: float) -> None:
        done = _amount(self.n, self.unit_scale)
        if self.total:
            done += f"/{_amount(self.total, self.unit_scale)} {self.unit} ({self.n / self.total:.0%})"
        else:
            done += f" {self.unit}"
        print(f"[{self.desc}] {done} {now - self.start:.0f}s", file=self.stream, flush=True)
        self.last = now

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self._line(now)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line(time.monotonic())

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()


def progress(iterable: Iterable | None = None, *, desc: str, total: float | None = None, unit: str = "it",
             unit_scale: bool = False, stream: IO[str] | None = None):
    """A tqdm bar when `stream` (default stderr) is a terminal, else a PlainProgress."""
    stream = stream if stream is not None else sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, mininterval=1.0, file=stream)
    return PlainProgress(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, stream=stream)
