"""FSDP2 checkpoints in torch Distributed Checkpoint (DCP) format, loaded without running code from the files.

Every rank writes its shards (`__<rank>_0.distcp`); rank 0 writes `.metadata`, which says where each piece of every
tensor lies, so a checkpoint written by N ranks loads on M ranks (DCP reads the pieces each rank's shards need).

What torch 2.13 unpickles on load, and what PackSFT does instead:
- `.metadata` is a pickle that `FileSystemReader.read_metadata` reads with plain `pickle.load` (any callable).
  `SafeReader` reads it with an unpickler that rebuilds only DCP's metadata records and the few torch values they
  hold (`METADATA_GLOBALS`); anything else is refused with the name it asked for.
- tensors: torch itself reads them weights-only.
- non-tensor values (the optimizer's lr, betas, ...) are `torch.save`d bytes that `DefaultLoadPlanner.load_bytes`
  unpickles without restriction (weights-only off); `SafePlanner` reads them through train.checkpoint.safe_load.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from train.checkpoint import CheckpointError, safe_load

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


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata(Path(self.path) / name)
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


def load(state: dict, directory: Path) -> None:
    """Collective: fill `state` (this run's sharded tensors, any number of ranks) in place from `directory`."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(directory)), planner=SafePlanner(directory))
    except CheckpointException as exc:
        raise _one_error(exc, directory, "reading the checkpoint") from None
