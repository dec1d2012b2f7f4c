"""Filesystem plumbing shared by the pipeline and the trainer: crash-safe writes of files and directories, the
temporaries they leave when killed, fsync of directories and file hashes.

Every temporary is named `.NAME.KIND-PID-sTAG-RANDOM` (`temp_prefix`): the writer's pid and start tag let a later
run tell a killed writer's leftovers (`stale_temporaries`) from a live one's. Nothing here imports other modules
of the project but `common.lock` (process liveness).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from common.lock import pid_running, process_start

HASH_CHUNK = 1 << 20  # one reused read buffer: hashing a shard costs the driver 1 MiB, whatever the shard's size

TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


# ---------------------------------------------------------------------------------------------- durability
def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` and fsync it (not atomic: for files inside a temporary directory published whole)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def current_umask() -> int:
    """The process umask (it can only be read by setting it, so set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(directory: str | os.PathLike) -> None:
    """Give every file under `directory` the mode open() would (0666 minus the umask): some writers (mkstemp,
    safetensors) create files 0600, which would leave them alone unreadable next to the others."""
    mode = 0o666 & ~current_umask()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


# ---------------------------------------------------------------------------------------------- temporaries
def _start_tag(pid: int) -> str:
    """8 hex digits of process `pid`'s start (boot and start time, common.lock.process_start): a live process with a
    temporary's pid but another tag is not its writer, the pid was reused. Without /proc every process has one tag."""
    return hashlib.blake2b((process_start(pid) or "").encode(), digest_size=4).hexdigest()


# a temporary adds up to 34 bytes to its NAME (`.`, `.tmp-`, a pid, `-s` and a tag, `-` and 8 random characters)
TEMP_NAME_BYTES = 200


def temp_name(name: str) -> str:
    """NAME as temporaries carry it: itself when short, else its first bytes and `~` and 8 hex digits of its hash,
    so that a temporary of a legal name (up to NAME_MAX, 255 bytes) stays within NAME_MAX."""
    encoded = name.encode()
    if len(encoded) <= TEMP_NAME_BYTES:
        return name
    head = encoded[:TEMP_NAME_BYTES - 9].decode(errors="ignore")  # a character cut in two is left out
    return f"{head}~{hashlib.blake2b(encoded, digest_size=4).hexdigest()}"


def temp_prefix(name: str, kind: str = "tmp") -> str:
    """`.NAME.KIND-PID-sTAG-`, the start of every temporary's name (NAME shortened by `temp_name`): the writer's pid
    and start tag let a later run tell a killed writer's leftovers (`stale_temporaries`) from a live one's. `kind`
    is `tmp` (being written) or `old` (set aside)."""
    return f".{temp_name(name)}.{kind}-{os.getpid()}-s{_start_tag(os.getpid())}-"


def temp_sibling(dst: Path, kind: str = "tmp") -> Path:
    """A temporary next to `dst`: `temp_prefix` plus a random suffix."""
    return dst.parent / f"{temp_prefix(dst.name, kind)}{uuid.uuid4().hex[:8]}"


# the start tag is optional: temporaries of older versions carry the pid alone
_TEMP_NAME = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)(?:-s(?P<start>[0-9a-f]{8}))?-[0-9A-Za-z_]+$"
)


def _writer_alive(pid: int, start: str | None) -> bool:
    return pid_running(pid) and (start is None or _start_tag(pid) == start)


def _temporaries(directory: Path, names: Iterable[str] | None) -> Iterator[tuple[Path, re.Match, set[str]]]:
    """The temporaries (`temp_prefix` names) in `directory` for the outputs `names` (None: any), each with its name's
    match and the `temp_name`s of the directory's entries."""
    if not directory.is_dir():
        return
    entries = sorted(directory.iterdir())
    present = {temp_name(entry.name) for entry in entries}
    wanted = None if names is None else {temp_name(name) for name in names}
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if m and (wanted is None or m["name"] in wanted):
            yield entry, m, present


def stale_temporaries(directory: str | os.PathLike, names: Iterable[str] | None = None) -> list[Path]:
    """Temporaries (`temp_prefix` names) in `directory` whose writer process is gone (its pid not running, or
    running a process that started at another time), for the outputs `names` (None: any). A set-aside `.NAME.old-*`
    whose NAME is missing is not stale: it is the previous output, which the next writer moves back (`set_aside`).
    Pids are of this machine: run one pipeline per output directory."""
    out = []
    for entry, m, present in _temporaries(Path(directory), names):
        if _writer_alive(int(m["pid"]), m["start"]) or (m["kind"] == "old" and m["name"] not in present):
            continue
        out.append(entry)
    return out


def undecided_temporaries(directory: str | os.PathLike, names: Iterable[str] | None = None
                          ) -> list[tuple[Path, int]]:
    """Temporaries named by pid alone (older versions: no start tag) whose pid is running, with that pid: a live
    writer's or a killed one's whose pid was reused, which cannot be told apart; kept, and worth saying so."""
    return [(entry, int(m["pid"])) for entry, m, _ in _temporaries(Path(directory), names)
            if m["start"] is None and pid_running(int(m["pid"]))]


@contextlib.contextmanager
def scratch_dir(near: str | os.PathLike, name: str) -> Iterator[Path]:
    """A temporary directory `.NAME.tmp-…` in directory `near` (on the output's filesystem, so its files can be
    renamed or copied into the output cheaply; created if missing), removed with its content when the block ends."""
    Path(near).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=temp_prefix(name), dir=near))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- atomic writes
@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temp file next to `path` (empty, with the mode open() would give), for writers that open it themselves,
    other processes included; fsynced and renamed over `path` on success (the directory fsynced after), removed
    on error. The temp name carries the writer's pid and start (`stale_temporaries`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp creates 0600
        os.close(fd)
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Binary file opened on a temp file next to `path`, which replaces `path` on success (`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, "r+b", buffering=1 << 20) as f:
        yield f
        f.flush()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a file so readers see the old or the new content, never a partial one."""
    with atomic_writer(path) as f:
        f.write(data)


def replace_dir(src: Path, dst: Path, durable: bool = True) -> None:
    """Move `src` to `dst`; an existing `dst` is renamed aside first and deleted after the swap.

    A process killed between the two renames leaves no `dst` and the previous one at `.NAME.old-*`
    (`set_aside`): the next writer of `dst` moves it back, and reading `dst` meanwhile names it.
    The parent directory is fsynced after the swap unless not `durable` (`src`'s content is the caller's to sync
    before)."""
    old = None
    if dst.exists():
        old = temp_sibling(dst, "old")
        os.replace(dst, old)
    os.replace(src, dst)
    if durable:
        fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def set_aside(dst: Path) -> list[Path]:
    """When `dst` is missing: the `.NAME.old-*` siblings a `replace_dir` killed between its renames left."""
    if dst.exists():
        return []
    return sorted(dst.parent.glob(f".{glob.escape(temp_name(dst.name))}.old-*"))


@contextlib.contextmanager
def atomic_directory(dst: Path) -> Iterator[Path]:
    """A temporary directory next to `dst` to write into, moved to `dst` (`replace_dir`, replacing an earlier one)
    when the block ends; removed, with nothing of it left, when the block raises."""
    tmp = temp_sibling(dst)
    try:
        yield tmp
        replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------------------------- hashes
def file_blake2b(path: str | os.PathLike, sync: bool = False) -> str:
    """blake2b-256 of a file's bytes, read in chunks; `sync`: fsync the file too (one pass for both)."""
    h = hashlib.blake2b(digest_size=32)
    buffer = bytearray(HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while size := f.readinto(buffer):
            h.update(view[:size])
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def tokenizer_hash(tokenizer_dir: str | os.PathLike) -> str:
    """blake2b over the names and bytes of the tokenizer files (vocab, merges, configs, chat template)."""
    root = Path(tokenizer_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name in TOKENIZER_FILE_NAMES)
    if not files:
        raise FileNotFoundError(f"{root}: no tokenizer files (looked for {list(TOKENIZER_FILE_NAMES)})")
    h = hashlib.blake2b(digest_size=32)
    for p in files:
        data = p.read_bytes()
        h.update(p.name.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()

