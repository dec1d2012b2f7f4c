"""An exclusive lock on a directory, so two runs never write one output directory at once.

The lock is a file (`.packsft.lock`) created whole and exclusively (a hard link), holding who took it: pid, host, the process's start
time, the command and a run token. A second run is refused with the holder's identity. A lock whose holder is gone
is taken over (and said so): on the same host, gone means the pid is not running, or runs a process that started at
another time than the holder did (pids are reused), and no process that the holder started while it held the lock
is left: those carry the run token in their environment (`LOCKS_ENV`, inherited), so a run whose holder was killed
keeps its lock until its last process (e.g. a trainer rank in the middle of a save) has ended. A lock taken on
another host cannot be judged from here and is refused (delete the file if that run is gone). Reusable by any
stage or by the trainer: `with directory_lock(path): ...`.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from common.errors import PackSFTError

LOCK_NAME = ".packsft.lock"
LOCKS_ENV = "PACKSFT_LOCKS"  # the run tokens of the locks held by this process's ancestors, space-separated


class LockHeldError(PackSFTError, RuntimeError):
    """The directory is locked by a run that is still alive (or on another host)."""

    exit_code = 2


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


def processes_with_env(name: str, token: str) -> list[int]:
    """The live processes of this host (readable by this user) started with `token` among the space-separated
    words of environment variable `name` (their environment as it was at exec, /proc/PID/environ; Linux)."""
    entry = f"{name}=".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        for variable in environ.split(b"\0"):
            if variable.startswith(entry) and token.encode() in variable[len(entry):].split():
                found.append(int(proc.name))
    return sorted(found)


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
          "command": " ".join(sys.argv), "run": uuid.uuid4().hex}
    content = json.dumps(me).encode()
    while not _create(path, content):
        holder = _read(path)
        if holder is None:
            continue  # released between our two looks
        if not _holder_gone(holder):
            raise LockHeldError(f"{directory} is in use by another run ({_describe(holder)}); wait for it to end or "
                                f"use another output directory (if that run is gone, delete {path})")
        left = processes_with_env(LOCKS_ENV, holder["run"]) if isinstance(holder.get("run"), str) else []
        if left:
            raise LockHeldError(
                f"{directory} is in use by another run: its holder is gone ({_describe(holder)}) but process(es) it "
                f"started still run ({', '.join(map(str, left))}); wait for them to end (or stop them: kill "
                f"{' '.join(map(str, left))}), then start again"
            )
        if _take_over(path, holder):
            print(f"[lock] took over {path} from a run that is gone ({_describe(holder)})", flush=True)
    previous = os.environ.get(LOCKS_ENV)
    os.environ[LOCKS_ENV] = f"{previous or ''} {me['run']}".strip()  # inherited by every process started from here
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(LOCKS_ENV, None)
        else:
            os.environ[LOCKS_ENV] = previous
        if _read(path) == me:
            path.unlink()
