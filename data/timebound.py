"""A time bound on a block of Python code, in any thread: a chat template that loops (jinja runs as Python code)
must end with an error naming it, not hang a stage with no output.

`with time_bound(seconds): ...` raises `TimeBoundExceeded` in the block once it has run `seconds`. One watchdog
thread per process checks the armed bounds every `POLL_SECONDS` (or a tenth of the shortest bound) and raises the
exception in the thread that runs past its bound (`PyThreadState_SetAsyncExc`, delivered between two bytecodes: a
long call into C, such as one huge regex, ends before it). Arming and disarming cost a dict update under a lock,
so a bound around every record is cheap. `TimeBoundExceeded` is a BaseException: the code in the block (a template's
own `except Exception`) does not swallow it. Bounds do not nest within one thread.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterator

POLL_SECONDS = 1.0  # how often the watchdog looks at most (a bound is detected within this, or a tenth of it)


class TimeBoundExceeded(BaseException):
    """The block of a `time_bound` ran past its bound."""


class _Watchdog:
    def __init__(self):
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.armed: dict[int, list] = {}  # thread id -> [deadline, token, fired]
        self.period = POLL_SECONDS
        self.token = 0
        threading.Thread(target=self._watch, name="packsft-time-bound", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(self.period)
            now = time.monotonic()
            with self.lock:
                for tid, entry in self.armed.items():
                    if not entry[2] and now >= entry[0]:
                        entry[2] = True
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid),
                                                                   ctypes.py_object(TimeBoundExceeded))

    def arm(self, tid: int, seconds: float) -> int:
        with self.lock:
            self.token += 1
            self.armed[tid] = [time.monotonic() + seconds, self.token, False]
            self.period = min(self.period, max(seconds / 10, 0.01))
            return self.token

    def disarm(self, tid: int, token: int) -> bool:
        """Whether the bound fired; an exception it set but that was not raised yet is cleared."""
        with self.lock:
            entry = self.armed.get(tid)
            if entry is None or entry[1] != token:
                return False
            del self.armed[tid]
            if entry[2]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
            return entry[2]


_WATCHDOG: _Watchdog | None = None
_CREATE = threading.Lock()


def _watchdog() -> _Watchdog:
    """This process's watchdog (a forked child starts its own: threads do not survive fork)."""
    global _WATCHDOG
    with _CREATE:
        if _WATCHDOG is None or _WATCHDOG.pid != os.getpid():
            _WATCHDOG = _Watchdog()
        return _WATCHDOG


@contextlib.contextmanager
def time_bound(seconds: float | None) -> Iterator[None]:
    """Raise `TimeBoundExceeded` in the block once it has run `seconds` (None: no bound)."""
    if seconds is None:
        yield
        return
    watchdog, tid = _watchdog(), threading.get_ident()
    token = watchdog.arm(tid, seconds)
    try:
        yield
    finally:
        fired = watchdog.disarm(tid, token)
    if fired:  # the block ended between the watchdog's firing and its exception's delivery
        raise TimeBoundExceeded
