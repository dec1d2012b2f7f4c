"""FSDP2 checkpoints in torch Distributed Checkpoint (DCP) format, loaded without running code from the files.

Every rank writes its shards (`__<rank>_0.distcp`); rank 0 writes `.metadata`, which says where each piece of every
tensor lies, so a checkpoint written by N ranks loads on M ranks (DCP reads the pieces each rank's shards need).
Under expert parallelism the FSDP2 engine describes each expert parameter as the whole tensor of every expert (a 2-D
mesh: the part, then its shard), so a checkpoint also loads on another expert_parallel_size.

What torch 2.13 unpickles on load, and what PackSFT does instead:
- `.metadata` is a pickle that `FileSystemReader.read_metadata` reads with plain `pickle.load` (any callable).
  `SafeReader` reads it with an unpickler that rebuilds only DCP's metadata records and the few torch values they
  hold (`METADATA_GLOBALS`); anything else is refused with the name it asked for.
- tensors: torch itself reads them weights-only.
- non-tensor values (the optimizer's lr, betas, ...) are `torch.save`d bytes that `DefaultLoadPlanner.load_bytes`
  unpickles without restriction (weights-only off); `SafePlanner` reads them through train.checkpoint.safe_load.

Which files torch reads: `.metadata` names, for every piece, a storage file, and `FileSystemReader` opens the
directory joined with that name, whatever it is (an absolute path, `../`, a link, a FIFO that blocks the open).
`load` checks the metadata first (`storage_problem`): each storage file is a relative path inside the directory, a
regular file (not a link, so nothing outside), listed in the checkpoint's manifest.json, and each piece lies within
its file; the checks name and `lstat` paths only, so nothing outside is opened. A problem is one CheckpointError
naming the path, raised on every rank before DCP reads anything.
"""
from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path, PurePosixPath

import orjson

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from train.checkpoint import MANIFEST, CheckpointError, _gather, safe_load

_METADATA_RECORDS = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
# (module, name) the metadata pickle may name: DCP's dataclasses, torch.Size, dtypes, the layout lookup by name
# and the checkpoint path it records; each only builds a value (none runs a command or opens a file)
METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA_RECORDS),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
})


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.path}: refused to load: it names {module}.{name}, which is not part of a DCP checkpoint's "
            "metadata. PackSFT never writes such files: it was replaced or crafted"
        )


def read_metadata(path: Path):
    """A DCP `.metadata` file, rebuilt from METADATA_GLOBALS only."""
    try:
        with open(path, "rb") as file:
            return _MetadataUnpickler(file, path).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot be read (truncated or corrupt): {exc}") from None


def _listed_files(manifest_dir: Path) -> set[str]:
    """The files manifest.json of `manifest_dir` lists (relative POSIX paths)."""
    manifest = manifest_dir / MANIFEST
    try:
        if not stat.S_ISREG(os.lstat(manifest).st_mode):
            raise CheckpointError(f"{manifest}: not a regular file; a DCP checkpoint is read only with the "
                                  f"{MANIFEST} that lists its files")
        files = orjson.loads(manifest.read_bytes())["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
        return set(files)
    except FileNotFoundError:
        raise CheckpointError(f"{manifest}: missing; a DCP checkpoint is read only with the {MANIFEST} that lists "
                              "its files") from None
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest}: unreadable ({exc})") from None


def _file_problem(directory: Path, name, listed: set[str], prefix: str, what: str) -> str | None:
    """Why `name` (a path relative to `directory`, from `what`) must not be read, else None. Refuses from the name
    alone (absolute, `..`, not in the manifest) before touching the path; then `lstat`s only (a FIFO is not opened)."""
    if not isinstance(name, str) or not name or "\0" in name:
        return f"{what} names the storage file {name!r}, which is not a file name"
    shown = directory / name
    if os.path.isabs(name):
        return (f"{what} names the storage file {name}, an absolute path; a checkpoint reads only files inside "
                f"its directory {directory}")
    parts = PurePosixPath(name).parts
    if ".." in parts:
        return f"{what} names the storage file {name}, which leaves the checkpoint directory {directory}"
    key = PurePosixPath(prefix, *parts).as_posix()
    if key not in listed:
        return (f"{what} names the storage file {shown}, which the checkpoint's {MANIFEST} does not list (only "
                "files it lists, checked against their size and blake2b, are read)")
    path = directory
    for part in parts:  # every component: a linked directory would lead outside too
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return f"{what} names the storage file {shown}, which is missing"
        if stat.S_ISLNK(mode):
            return f"{what} names the storage file {shown}, which is (or lies under) a symbolic link {path}"
    if not stat.S_ISREG(mode):
        return f"{what} names the storage file {shown}, which is not a regular file (a FIFO, device or directory)"
    return None


def storage_problem(directory: Path, metadata, listed: set[str], prefix: str) -> str | None:
    """Why the storage files `metadata` (of `directory`/.metadata) names must not be read, else None: each must
    pass _file_problem, carry no load transforms (PackSFT writes none) and each piece must lie inside its file."""
    what = f"{directory / '.metadata'}"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return f"{what}: holds no storage table (not a DCP checkpoint's metadata)"
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if name not in sizes:
            problem = _file_problem(directory, name, listed, prefix, what)
            if problem:
                return problem
            sizes[name] = os.lstat(directory / name).st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length
                and offset + length <= sizes[name]):
            return (f"{what}: {getattr(index, 'fqn', index)} lies at bytes {offset!r}+{length!r} of {directory / name}, "
                    f"a file of {sizes[name]} bytes")
        if getattr(info, "transform_descriptors", None):
            return (f"{what}: {getattr(index, 'fqn', index)} asks for the load transforms "
                    f"{info.transform_descriptors!r}; PackSFT writes none")
    return None


def checked_metadata(directory: Path, manifest_dir: Path):
    """`directory`/.metadata, read safely, once its storage files passed storage_problem (else CheckpointError)."""
    listed = _listed_files(manifest_dir)
    try:
        prefix = directory.relative_to(manifest_dir).as_posix()
    except ValueError:
        raise CheckpointError(f"{directory}: not inside {manifest_dir}, whose {MANIFEST} must list its files") from None
    problem = _file_problem(directory, ".metadata", listed, prefix, str(directory))
    if problem:
        raise CheckpointError(problem)
    metadata = read_metadata(directory / ".metadata")
    problem = storage_problem(directory, metadata, listed, prefix)
    if problem:
        raise CheckpointError(problem)
    return metadata


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader over metadata already read and checked (`checked_metadata`). `read_metadata` takes no
    arguments: DCP then never falls back to rank-local `__<rank>.metadata` files (PackSFT writes none)."""

    def __init__(self, path, metadata):
        super().__init__(path)
        self.checked = metadata

    def read_metadata(self):
        metadata = self.checked
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner.load_bytes with train.checkpoint.safe_load (weights-only) in place of its unrestricted
    unpickling."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = directory

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = safe_load(self.directory / fqn, data=value.getvalue())
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _one_error(exc: CheckpointException, directory: Path, action: str) -> CheckpointError:
    """DCP's collective error (every rank's exception with its traceback) as one CheckpointError: a rank's own
    CheckpointError (a refused file) as it is, else the first rank's exception, named."""
    failures = sorted(exc.failures.items())
    for _, (error, _trace) in failures:
        if isinstance(error, CheckpointError):
            return error
    rank, (error, _trace) = failures[0]
    text = " ".join(str(error).split())
    return CheckpointError(f"{directory}: {action} failed on rank {rank} (of ranks {[r for r, _ in failures]}): "
                           f"{type(error).__name__}: {text}")


def save(state: dict, directory: Path) -> None:
    """Collective: every rank writes its shards of `state` (DTensors: each rank its part) into `directory`."""
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), single_file_per_rank=True,
                                                            sync_files=True))
    except CheckpointException as exc:  # a BaseException: no `except Exception` of a caller would see it
        raise _one_error(exc, directory, "writing the checkpoint") from None


def load(state: dict, directory: Path, manifest_dir: Path | None = None) -> None:
    """Collective: fill `state` (this run's sharded tensors, any number of ranks) in place from `directory`, whose
    files `manifest_dir`/manifest.json lists (default: the directory above, the checkpoint's). The metadata is
    checked first (checked_metadata); a problem on any rank is raised on every rank, before DCP reads a file."""
    directory = Path(directory)
    manifest_dir = directory.parent if manifest_dir is None else Path(manifest_dir)
    metadata, problem = None, None
    try:
        metadata = checked_metadata(directory, manifest_dir)
    except CheckpointError as exc:
        problem = str(exc)
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(problems[0])
    try:
        dcp.load(state, storage_reader=SafeReader(str(directory), metadata), planner=SafePlanner(directory))
    except CheckpointException as exc:
        raise _one_error(exc, directory, "reading the checkpoint") from None
