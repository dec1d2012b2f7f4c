"""What `sh train.sh` runs: one supervising process that holds the output directory's lock and starts
`accelerate launch` in a process group of its own.

Why: `kill <train.sh pid>`, `timeout` or a closed terminal signal that one process; accelerate's launcher died of
it (-15) while its trainer child trained on, exported `final/`, and a restart with resume=latest read the orphan's
checkpoint while it was still being written. Here SIGTERM, SIGINT and SIGHUP are forwarded to the whole group
(accelerate and its trainer processes; torchrun, which starts its workers in sessions of their own, stops them on
the same signals), and the lock is released only once no process of the group is left, so a second run into the
same output directory is refused (naming the holder) for as long as anything of the first one runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

from data.lock import directory_lock

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 30.0  # after the launcher exits, how long what is left of its group may take before SIGKILL
_PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Orphans of the run (a trainer whose launcher died) become our children, so we can reap them: an init that
    does not reap (containers) would otherwise leave zombies that keep the group alive (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_orphans() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _group_alive(pgid: int) -> bool:
    _reap_orphans()
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for_group(pgid: int) -> None:
    """Until no process of group `pgid` is left; SIGKILL what still runs after STOP_GRACE_S."""
    deadline = time.monotonic() + STOP_GRACE_S
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            print(f"[train.sh] processes of the run still alive {STOP_GRACE_S:.0f} s after the launcher exited: "
                  "killing them", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.1)


def supervise(command: list[str], lock_dir: str | os.PathLike | None) -> int:
    """Run `command` in a new process group, holding the lock of `lock_dir` (None: no lock) until every process
    of the group has ended; forward FORWARDED_SIGNALS to the group. Returns the exit code for the shell (128 + the
    signal when one was forwarded or killed the launcher)."""
    lock = directory_lock(Path(lock_dir)) if lock_dir is not None else contextlib.nullcontext()
    with lock:
        _become_subreaper()
        received: list[int] = []
        child: subprocess.Popen | None = None

        def forward(signum, _frame) -> None:
            received.append(signum)
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
        try:
            child = subprocess.Popen(command, start_new_session=True)
            if received:  # arrived before the group existed
                os.killpg(child.pid, received[0])
            code = child.wait()
            _wait_for_group(child.pid)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if received:
        return 128 + received[0]
    return code if code >= 0 else 128 - code
