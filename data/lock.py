"""An exclusive lock on a directory, so two runs never write one output directory at once.

The lock is a file (`.packsft.lock`) created whole and exclusively (a hard link), holding who took it: pid, host, the process's start
time and the command. A second run is refused with the holder's identity. A lock whose holder is gone is taken
over (and said so): on the same host, gone means the pid is not running, or runs a process that started at
another time than the holder did (pids are reused); a lock taken on another host cannot be judged from here and
is refused (delete the file if that run is gone). Reusable by any stage or by the trainer: `with
directory_lock(path): ...`.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".packsft.lock"


class LockHeldError(RuntimeError):
    """The directory is locked by a run that is still alive (or on another host)."""


def process_start(pid: int) -> str | None:
    """An identity of process `pid` beyond its number: the boot id and its start time in clock ticks after boot
    (/proc, Linux); None where there is no /proc or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, counted after the command name


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _holder_gone(holder: dict) -> bool:
    """Whether the run that wrote `holder` has ended (only judged for a lock of this host)."""
    if not holder:
        return True  # unreadable: locks are written whole, so not one of ours
    if holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or not pid_running(pid):
        return True
    start = process_start(pid)
    return start is not None and holder.get("start") is not None and start != holder["start"]


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command')}")


def _read(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # corrupt or foreign (ours are never torn): nobody to name, judged gone
    return holder if isinstance(holder, dict) else {}


def _create(path: Path, content: bytes) -> bool:
    """Create the lock with its content in one step (a hard link of a written temporary: never seen torn)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def _take_over(path: Path, stale: dict) -> bool:
    """Move the stale lock aside, if it is still the one judged stale (another run may have taken it over and
    written its own meanwhile: then it goes back)."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True  # someone removed it: try to create ours
    if _read(aside) != stale:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        os.unlink(aside)
        return False
    os.unlink(aside)
    return True


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike, name: str = LOCK_NAME) -> Iterator[Path]:
    """Hold the lock of `directory` (created if missing) for the `with` block; raises LockHeldError naming the
    holder when another live run has it. Yields the lock file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid()),
          "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
          "command": " ".join(sys.argv)}
    content = json.dumps(me).encode()
    while not _create(path, content):
        holder = _read(path)
        if holder is None:
            continue  # released between our two looks
        if not _holder_gone(holder):
            raise LockHeldError(f"{directory} is in use by another run ({_describe(holder)}); wait for it to end or "
                                f"use another output directory (if that run is gone, delete {path})")
        if _take_over(path, holder):
            print(f"[lock] took over {path} from a run that is gone ({_describe(holder)})", flush=True)
    try:
        yield path
    finally:
        if _read(path) == me:
            path.unlink()
