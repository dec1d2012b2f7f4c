"""Resumable checkpoints under <output_dir>/checkpoints/, crash-safe and loadable without unpickling code.

Layout of `step-000012/`:
    ds/ (DeepSpeed's per-rank files), or dcp/ + scheduler.pt (FSDP2: torch Distributed Checkpoint, see
    train/engines/dcp.py), or model.pt, optimizer.pt, scheduler.pt   model, optimizer, lr scheduler
    trainer_state.json        step, sampler position, world size, the dataset's identity (`data`)
    rng/rank_<r>.json         python `random` and numpy generator states of rank r (plain ints)
    rng/rank_<r>.safetensors  torch CPU and CUDA generator states of rank r (uint8 tensors)
    manifest.json             written last: size and blake2b of every other file (the commit marker)

Every load of a `.pt` file goes through `safe_load` (weights_only=True, map_location cpu): a crafted pickle in a
checkpoint is refused instead of run. DeepSpeed's own `ds/` files too: its checkpoint engine's load is replaced by
`safe_load` with the few DeepSpeed classes those files hold (`load_deepspeed_files_safely`, with the ZeRO reshard
in train/engines/deepspeed_engine.py: each engine owns its checkpoint format).

Saving: every rank writes into `.step-000012.tmp/`; after a barrier rank 0 writes the manifest (fsyncing every
file), renames the directory to `step-000012/` and then replaces the `latest` pointer file (write temp + os.replace).
A crash at any point leaves `latest` naming a complete checkpoint. Before writing, rank 0 checks the free space
against the size of the last checkpoint and stops with the directory named when it is short. Saving a step that
already has a directory moves the old one aside (`.step-000012.old-*`) before the swap; a crash between the two
renames leaves `latest` naming a missing directory, and resume=latest then uses the moved-aside copy. Only the last
`save_total_limit` checkpoints are kept.

Resuming: a checkpoint is complete when its manifest exists, and usable when every file matches it. resume=latest
tries the checkpoint `latest` names, then (resume_corrupt=fallback) each older complete one, with a warning naming
the file that failed. A resume keeps the global batch (rows per step) and may change how a step is split over
ranks and micro-batches; on another number of ranks the ZeRO partitions are joined and cut anew
(`read_zero_state` / `install_zero_state`) and each rank's generators are seeded afresh (`reshard_rng_seed`).
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import random
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch
import torch.distributed as dist

from common.config import ConfigError
from common.errors import PackSFTError
from common.fsutil import (apply_umask, atomic_directory, atomic_write_bytes, file_blake2b, fsync_dir, replace_dir,
                           stale_temporaries)

logger = logging.getLogger("packsft.train")

CHECKPOINT_DIR = "checkpoints"
FINAL_DIR = "final"  # the exported model, in output_dir
LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
RNG_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_ASIDE_DIR = re.compile(r"^\.step-(\d+)\.old-.+$")
FREE_SPACE_MARGIN = 1.05  # the next checkpoint may be a little larger than the last one (optimizer state fills in)

disk_usage = shutil.disk_usage  # module attribute so tests can simulate a full disk
# what a write on a full disk raises: OSError (ENOSPC, EDQUOT), or torch.save's RuntimeError for a short write
# ("unexpected pos …", "file write failed")
WRITE_ERRORS = (OSError, RuntimeError)


class CheckpointError(PackSFTError, RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or directory and what to do."""

    label = "checkpoint error"


class ResumeRefused(CheckpointError, ConfigError):
    """The start-up checks' refusal of a resume (other data, global batch, step count or model than the checkpoint's):
    a config error of the run (exit 2, before any weight loads) about a checkpoint."""

    label = "config error"
    exit_code = 2


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def from_main(value: Any) -> Any:
    """Rank 0's `value` on every rank, so all ranks raise together instead of some waiting at a barrier."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _gather(value: Any) -> list:
    """`value` of every rank, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------------------------- loading .pt files
def safe_load(path: str | os.PathLike, allowed_classes: list | tuple = (), data: bytes | None = None) -> Any:
    """The repo's only `torch.load`: tensors and plain containers only (weights_only=True), onto the CPU;
    `allowed_classes` adds classes the unpickler may rebuild (never call arbitrary functions). `data`: the bytes
    to load (a value inside a larger file), named `path` in errors."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allowed_classes)):
            source = io.BytesIO(data) if data is not None else path
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path}: refused to load: the file holds Python objects other than tensors and plain containers "
            f"(weights_only=True; {first_line}). PackSFT never writes such files: it was replaced or crafted"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as exc:  # zip / storage errors of a truncated or overwritten file
        size = len(data) if data is not None else path.stat().st_size if path.exists() else 0
        raise CheckpointError(f"{path}: cannot be read ({size} bytes; truncated or corrupt): {exc}") from None


# ---------------------------------------------------------------------------------------------- rng states
def _rng_files(directory: Path, rank: int) -> tuple[Path, Path]:
    return directory / "rng" / f"rank_{rank}.json", directory / "rng" / f"rank_{rank}.safetensors"


def save_rng(directory: Path, rank: int) -> None:
    """This rank's generator states: python and numpy as JSON, torch and CUDA as uint8 tensors (safetensors)."""
    from safetensors.torch import save_file

    version, internal, gauss_next = random.getstate()
    np_state = np.random.get_state(legacy=False)
    plain = {
        "format_version": RNG_FORMAT,
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}},
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    json_file, tensor_file = _rng_files(directory, rank)
    json_file.write_bytes(orjson.dumps(plain))
    save_file(tensors, str(tensor_file), metadata={"format_version": str(RNG_FORMAT)})


def load_rng(directory: Path, rank: int) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    json_file, tensor_file = _rng_files(directory, rank)
    for file in (json_file, tensor_file):
        if not file.is_file():
            raise CheckpointError(f"{file}: no rng state for rank {rank} (saved with fewer processes?)")
    try:
        plain = orjson.loads(json_file.read_bytes())
        py, npy = plain["python"], plain["numpy"]
        python_state = (py["version"], tuple(py["internal"]), py["gauss_next"])
        numpy_state = {**npy, "state": {"key": np.asarray(npy["state"]["key"], dtype=np.uint32),
                                        "pos": npy["state"]["pos"]}}
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{json_file}: not a PackSFT rng state ({type(exc).__name__}: {exc})") from None
    try:
        tensors = load_file(str(tensor_file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{tensor_file}: not a safetensors file ({exc})") from None
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda_{i}"] for i in range(len(tensors) - 1) if f"cuda_{i}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# ---------------------------------------------------------------------------------------------- manifest
def _files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, step: int) -> dict:
    """The commit marker: size + blake2b of every file, written (atomically) after all of them are on disk."""
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "blake2b": file_blake2b(p, sync=True)}
             for p in _files_under(directory)}
    manifest = {"format_version": MANIFEST_FORMAT, "algorithm": "blake2b-256", "step": step, "files": files}
    for sub in sorted({p.parent for p in _files_under(directory)} | {directory}):
        fsync_dir(sub)
    atomic_write_bytes(directory / MANIFEST, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    return manifest


def verify_checkpoint(directory: Path) -> list[str]:
    """Every problem of `directory` against its manifest (empty: usable), each naming the file."""
    manifest_file = directory / MANIFEST
    if not manifest_file.is_file():
        return [f"{manifest_file}: missing (an incomplete checkpoint, or one written before PackSFT had manifests)"]
    try:
        files = orjson.loads(manifest_file.read_bytes())["files"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return [f"{manifest_file}: unreadable ({exc})"]
    if not isinstance(files, dict):
        return [f"{manifest_file}: `files` is {_shown(files)}, not an object of file names"]
    problems = [f"{manifest_file}: the entry of {name!r} is {_shown(entry)}, not "
                '{"size": <bytes>, "blake2b": <hex digest>} (the file was edited: PackSFT writes no such entry)'
                for name, entry in files.items() if not _manifest_entry_ok(entry)]
    if problems:
        return problems
    for name, expected in files.items():
        path = directory / name
        if not isinstance(name, str) or os.path.isabs(name) or ".." in Path(name).parts:
            problems.append(f"{manifest_file}: lists {name!r}, which is not a path inside {directory}")
            continue
        if any(p.is_symlink() for p in [path, *path.parents[:len(Path(name).parts) - 1]]):
            problems.append(f"{path}: a symbolic link (PackSFT writes none; it may lead outside the checkpoint)")
            continue
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        if size != expected["size"]:
            kind = "empty" if size == 0 else "truncated" if size < expected["size"] else "larger than written"
            problems.append(f"{path}: {kind} ({size} bytes, {expected['size']} written)")
        elif file_blake2b(path) != expected["blake2b"]:
            problems.append(f"{path}: content changed since it was written (blake2b mismatch)")
    for parent, dirs, names in os.walk(directory):  # what the manifest does not list too (links are not followed)
        for name in dirs + names:
            path = Path(parent, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                problems.append(f"{path}: a symbolic link (PackSFT writes none; it may lead outside the checkpoint)")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # opening a FIFO would block the resume
                problems.append(f"{path}: not a regular file (a FIFO, socket or device; PackSFT writes none)")
    return list(dict.fromkeys(problems))


def _manifest_entry_ok(entry: Any) -> bool:
    """A manifest entry as write_manifest writes it: a non-negative integer size and a hex digest."""
    return (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
            and isinstance(entry.get("blake2b"), str))


def _shown(value: Any, limit: int = 60) -> str:
    text = orjson.dumps(value).decode() if isinstance(value, (dict, list, str, int, float, bool, type(None))) \
        else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def is_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- saving
def remove_stale_saves(output_dir: str | os.PathLike) -> list[Path]:
    """Half-written `.step-N.tmp/` directories and pointer temporaries of a crashed or killed save (one run per
    output_dir, so nothing else is writing them), and a killed export's `final/` temporaries. Returns what was
    removed."""
    root = checkpoint_root(output_dir)
    stale = stale_temporaries(output_dir, [FINAL_DIR])
    if root.is_dir():
        stale += sorted([*root.glob(".step-*.tmp"), *root.glob(f".{LATEST}.tmp-*")])
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def free_space_problem(root: Path, step: int, estimate_bytes: int | None, keep: int) -> str | None:
    """None when `root` has room for the next checkpoint: the size of the newest complete one there, else
    `estimate_bytes` (before the first save), plus a margin."""
    previous = [p for p in reversed(list_checkpoints(root.parent)) if is_complete(p)]
    if previous:
        need, source = checkpoint_bytes(previous[0]), f"the size of {previous[0].name}"
    elif estimate_bytes:
        need, source = estimate_bytes, "the model and optimizer state"
    else:
        return None
    need = int(need * FREE_SPACE_MARGIN)
    free = disk_usage(root).free
    if free >= need:
        return None
    return (
        f"checkpoint directory {root}: {_gib(free)} free, the checkpoint of step {step} needs about {_gib(need)} "
        f"(estimated from {source}); nothing was written. Free space there: save_total_limit={keep} keeps {keep} "
        f"checkpoint(s) and the next one is written before the oldest is removed. resume=latest continues from the "
        "last complete checkpoint"
    )


def save_checkpoint(output_dir, step: int, rank: int, save_fn, trainer_state: dict, keep: int,
                    estimate_bytes: int | None = None) -> Path:
    """Collective: every rank calls it. `save_fn(tmp_dir)` writes the model/optimizer/scheduler state (each rank
    its part). `estimate_bytes`: the expected size when there is no earlier checkpoint to measure. Returns the
    final directory."""
    root = checkpoint_root(output_dir)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    problem = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_saves(output_dir)  # leftovers of a crashed save
        problem = free_space_problem(root, step, estimate_bytes, keep)
        if problem is None:
            tmp.mkdir()
            (tmp / "rng").mkdir()
    problem = from_main(problem)
    if problem is not None:
        raise CheckpointError(problem)
    _barrier()
    error = None
    try:
        save_fn(tmp)
        save_rng(tmp, rank)
        if rank == 0:
            (tmp / "trainer_state.json").write_bytes(orjson.dumps(trainer_state, option=orjson.OPT_INDENT_2))
    except WRITE_ERRORS as exc:
        error = f"rank {rank}: {_one_line(exc)}"
    errors = _gather(error)  # in place of a barrier: every rank learns of any rank's failure and raises
    if rank == 0 and not any(errors):
        try:
            write_manifest(tmp, step)
            replace_dir(tmp, final)  # the same step saved again (e.g. after resuming from an earlier one): replace it
            atomic_write_bytes(root / LATEST, final.name.encode())
        except OSError as exc:
            errors = [f"rank 0: {_one_line(exc)}"]
    errors = from_main(errors)  # rank 0's last word: also the barrier after the commit
    if any(errors):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"checkpoint directory {root}: writing step {step} failed ({'; '.join(e for e in errors if e)}); the "
            f"partial {tmp.name} was removed and the last complete checkpoint is intact: free space there (or lower "
            "save_total_limit), then resume=latest continues from it"
        )
    if rank == 0:
        for stale in root.glob(".step-*.old-*"):  # moved aside by a re-save that was killed mid-swap
            shutil.rmtree(stale, ignore_errors=True)
        _prune(root, keep)
    _barrier()
    return final


@contextmanager
def export_directory(out_dir: Path) -> Iterator[Path]:
    """A temporary directory to write an exported model into, moved to `out_dir` (replacing an earlier export)
    when the block ends, its files given the umask's permissions (safetensors creates them 0600). A write error (a
    full disk) removes it and raises a CheckpointError naming `out_dir`: nothing partial is left."""
    from safetensors import SafetensorError

    try:
        with atomic_directory(out_dir) as tmp:  # removed, whatever the error
            yield tmp
            apply_umask(tmp)
    except (*WRITE_ERRORS, SafetensorError) as exc:
        raise CheckpointError(
            f"export directory {out_dir}: writing the model failed ({_one_line(exc)}); the partial {tmp.name} was "
            "removed. Free space there, then run the same command with resume=latest: it resumes at the last step "
            "and exports again"
        ) from None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete-or-not `step-N/` directories under output_dir, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    return [p for _, p in steps]


def not_packsft_checkpoint(directory: Path) -> str | None:
    """Why `directory` is not a checkpoint PackSFT wrote (None when it is): one is a real directory whose
    manifest.json (PackSFT's format) lists every file it holds, and holds no link. Names only: nothing is hashed."""
    if directory.is_symlink():
        return "a symbolic link"
    manifest_file = directory / MANIFEST
    if manifest_file.is_symlink() or not manifest_file.is_file():
        return f"no {MANIFEST}"
    try:
        manifest = orjson.loads(manifest_file.read_bytes())
        listed = set(manifest["files"]) if manifest["format_version"] == MANIFEST_FORMAT else None
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
        listed = None
    if listed is None:
        return f"its {MANIFEST} is not PackSFT's"
    links, extra = [], []
    for parent, dirs, files in os.walk(directory):  # does not follow links
        for name in dirs + files:
            path = Path(parent, name)
            relative = path.relative_to(directory).as_posix()
            if path.is_symlink():
                links.append(relative)
            elif name in files and relative != MANIFEST and relative not in listed:
                extra.append(relative)
    if links:
        return f"it holds the symbolic link {links[0]}"
    if extra:
        return f"{', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''} {'is' if len(extra) == 1 else 'are'} not in " \
               f"its {MANIFEST}"
    return None


def foreign_step_dirs(output_dir: str | os.PathLike) -> list[str]:
    """Each `step-N` entry of checkpoints/ that PackSFT did not write, with the reason (overwrite_output_dir removes
    only PackSFT's own checkpoints, and a new run's step N would replace one of these)."""
    root = checkpoint_root(output_dir)
    if root.is_symlink() or not root.is_dir():
        return []
    return [f"{entry} is not a checkpoint PackSFT wrote ({problem})" for entry in sorted(root.iterdir())
            if _STEP_DIR.match(entry.name) and (problem := not_packsft_checkpoint(entry))]


def discard_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Start over in output_dir (overwrite_output_dir): remove the earlier run's checkpoints, the `step-N/`
    directories PackSFT wrote (`not_packsft_checkpoint`), and the `latest` pointer; anything else in checkpoints/
    stays (config validation refuses a `step-N` that is not PackSFT's, and links). Returns what was removed."""
    root = checkpoint_root(output_dir)
    if root.is_symlink() or not root.is_dir():
        return []
    removed = [p for p in list_checkpoints(output_dir) if not_packsft_checkpoint(p) is None]
    pointer = root / LATEST
    if pointer.is_file() and not pointer.is_symlink():
        removed.append(pointer)
        pointer.unlink()
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
    kept = sorted(p.name for p in root.iterdir())
    if removed:
        logger.info("overwrite_output_dir: removed the earlier run's %s%s", ", ".join(p.name for p in removed),
                    f"; kept what PackSFT did not write in {root}: {', '.join(kept)}" if kept else "")
    return removed


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints PackSFT wrote (a `step-N/` it did not write is left alone)."""
    steps = [p for p in list_checkpoints(root.parent) if not_packsft_checkpoint(p) is None]
    try:
        latest = latest_pointer(root)[0]
    except CheckpointError:
        latest = None
    for path in steps[:-keep] if keep > 0 else []:
        if path.name != latest:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- resuming
def _step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name) or _ASIDE_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def _moved_aside(root: Path, name: str) -> Path | None:
    """The complete moved-aside copy of checkpoint `name`, when a crash in the middle of re-saving that step left
    it missing (see save_checkpoint); else None."""
    if (root / name).exists():
        return None
    copies = sorted(p for p in root.glob(f".{name}.old-*") if is_complete(p))
    return copies[-1] if copies else None


POINTER_MAX_BYTES = 256  # `latest` holds one checkpoint name (step-NNNNNN); more is not PackSFT's pointer


def latest_pointer(root: Path) -> tuple[str | None, str | None]:
    """(the checkpoint name `root/latest` holds, or None; why it cannot be followed, or None). PackSFT writes one
    name there, `step-NNNNNN`, of a directory beside it. A pointer that names a path (a separator, `..`, an absolute
    path) would resume a checkpoint outside this run's checkpoints/ (another run's): CheckpointError. A link is
    refused as well (preflight names it first). An empty, non-text or mistyped pointer, or one that is not a
    regular file (a FIFO is never opened: lstat first) is a problem resume=latest warns about and falls back from.
    Without a pointer: (None, None)."""
    pointer = root / LATEST
    try:
        mode = os.lstat(pointer).st_mode
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{pointer}: cannot be read ({_one_line(exc)})"
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{pointer}: a symbolic link to {os.readlink(pointer)}; PackSFT writes the pointer as a "
                              "file naming a checkpoint in this run's checkpoints/ and follows no link there")
    if not stat.S_ISREG(mode):
        return None, f"{pointer}: not a regular file (a FIFO, socket, device or directory; PackSFT writes a text file)"
    try:
        with open(pointer, "rb") as f:
            data = f.read(POINTER_MAX_BYTES + 1)
    except OSError as exc:
        return None, f"{pointer}: cannot be read ({_one_line(exc)})"
    if len(data) > POINTER_MAX_BYTES:
        return None, f"{pointer}: more than {POINTER_MAX_BYTES} bytes, not a checkpoint name"
    try:
        name = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{pointer}: not text"
    if not name:
        return None, f"{pointer}: empty"
    if "/" in name or "\\" in name or name in (".", "..") or os.path.isabs(name):
        raise CheckpointError(
            f"{pointer} names {name!r}, a path, not a checkpoint of this run: PackSFT writes there only the name of "
            f"a step-NNNNNN directory beside it, and resume=latest never leaves {root}. Remove the pointer "
            "(resume=latest then resumes from the newest complete checkpoint there), or resume=<directory> to resume "
            "from another checkpoint on purpose")
    if not _STEP_DIR.match(name):
        return None, f"{pointer}: names {name!r}, which is not a checkpoint name (step-NNNNNN)"
    return name, None


def resume_candidates(resume: str, output_dir, warn=logger.warning) -> list[Path]:
    """The checkpoints to try, in order. `none`: none. A path: that one. `latest`: the one the pointer names (or
    its moved-aside copy), then every older complete checkpoint, newest first (the fallbacks). A pointer that cannot
    be followed (`latest_pointer`; it names a checkpoint that does not exist) is warned about through `warn`, and
    every complete checkpoint is tried, newest first."""
    if resume == "none":
        return []
    if resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"resume: {path} is not a checkpoint directory")
        return [path]
    root = checkpoint_root(output_dir)
    name, problem = latest_pointer(root)
    first = None
    if name is not None:
        first = _moved_aside(root, name) or root / name
        if not first.is_dir() or first.is_symlink():
            problem, first = f"{root / LATEST}: names {name}, which is not a checkpoint directory in {root}", None
    complete = [p for p in reversed(list_checkpoints(output_dir)) if is_complete(p)]
    if problem is not None:
        warn(f"{problem}; " + (f"resuming from the newest complete checkpoint, {complete[0].name}" if complete
                               else "and there is no complete checkpoint"))
    if first is None:
        if not complete and list_checkpoints(output_dir):
            raise CheckpointError(f"{root}: no complete checkpoint (none has {MANIFEST}); resume=none starts over")
        return complete
    return [first, *(p for p in complete if _step_of(p) < _step_of(first))]


def resolve_resume(resume: str, output_dir) -> Path | None:
    """The first checkpoint resume=`resume` tries (None: start from step 0)."""
    candidates = resume_candidates(resume, output_dir)
    return candidates[0] if candidates else None


def choose_checkpoint(candidates: list[Path], on_corrupt: str, warn=logger.warning) -> Path:
    """The first candidate that matches its manifest (rank 0 checks, every rank gets the answer). A bad one is
    an error naming its files, or (on_corrupt="fallback") a warning and the next candidate."""
    for i, path in enumerate(candidates):
        problems = from_main(verify_checkpoint(path) if not dist.is_initialized() or dist.get_rank() == 0 else None)
        if not problems:
            return path
        listing = "; ".join(problems)
        if on_corrupt == "fallback" and i + 1 < len(candidates):
            warn(f"checkpoint {path} is not usable: {listing}. Falling back to {candidates[i + 1]}")
            continue
        hint = " (no earlier complete checkpoint to fall back to)" if on_corrupt == "fallback" else (
            " (resume_corrupt=fallback resumes from the previous complete checkpoint instead)")
        raise CheckpointError(f"checkpoint {path} is not usable: {listing}{hint}")
    raise CheckpointError("no checkpoint to resume from")


def load_trainer_state(path: Path) -> dict:
    file = path / "trainer_state.json"
    try:
        return orjson.loads(file.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None


def dataset_identity(data_path: str | os.PathLike, rows: int) -> dict:
    """What a checkpoint remembers of its training data: the manifest's checksum (it holds every shard's
    checksum) and the row count."""
    meta = Path(data_path) / "meta.json"
    return {"path": str(data_path), "meta_blake2b": file_blake2b(meta), "rows": int(rows)}


def data_mismatch(saved: dict | None, current: dict) -> str | None:
    """Why the checkpoint's data differs from this run's (None: the same, or an old checkpoint without it)."""
    if not saved:
        return None
    diffs = []
    if saved.get("rows") != current["rows"]:
        diffs.append(f"{saved.get('rows')} rows then, {current['rows']} now")
    if saved.get("meta_blake2b") != current["meta_blake2b"]:
        diffs.append("a different meta.json (other shards or settings)")
    if not diffs:
        return None
    return (f"the checkpoint was trained on {saved.get('path')}, this run reads {current['path']}: "
            + ", ".join(diffs))


def resume_refusal(path: Path, state: dict, layout: dict | None, data: dict | None,
                   data_policy: str) -> tuple[str | None, str | None]:
    """(why resuming from checkpoint `path`, whose trainer_state.json is `state`, is refused; a warning): other data
    (`data`: `dataset_identity` of this run's; refused unless `data_policy` is "allow", then the warning), another
    global batch or step count (`layout`: this run's, as `layout_mismatch` reads it). None for what is not known
    yet (the start-up checks, before the data is opened, on online packing's rows)."""
    mismatch = data_mismatch(state.get("data"), data) if data is not None else None
    warning = None
    if mismatch:
        if data_policy == "error":
            return (f"resume from {path}: {mismatch}; resume with the same data_path, or set "
                    "resume_data_mismatch=allow to continue on the new data (the sampler order then differs)", None)
        warning = f"resume from {path}: {mismatch} (resume_data_mismatch=allow: continuing)"
    other = layout_mismatch(state, layout, compare_steps=not mismatch) if layout is not None else None
    if other:
        return (f"resume from {path}: {other}: the resumed run would train other rows than the run it continues "
                "(some twice, some never); resume with the checkpoint's value (any dp x grad_accum x micro_batch_rows "
                "giving its rows per step), or start a new run (another output_dir, or overwrite_output_dir=true "
                "with resume=none)", warning)
    return None, warning


def layout_mismatch(saved: dict, current: dict, compare_steps: bool = True) -> str | None:
    """Why this run's steps differ from the checkpoint's run (None: the same, or a checkpoint that predates these
    keys): another global batch (`rows_per_step` = dp x grad_accum x micro_batch_rows) gives every step other rows,
    another step count (`max_steps`, or `num_epochs` without it) another lr schedule, so a resumed run would train
    some rows twice and skip others. How a step's rows are split over ranks and micro-batches may change: the step
    loss is exact however it is split. `compare_steps=False`: the step count may differ (resuming on other data,
    allowed by the user)."""
    if "rows_per_step" in saved:
        if saved["rows_per_step"] != current["rows_per_step"]:
            return (f"the global batch is {current['rows_per_step']} rows per step here ({_split(current)}), but the "
                    f"checkpoint was saved with {saved['rows_per_step']} rows per step ({_split(saved)})")
    else:  # a checkpoint older than the global batch record: only its own split is known to give the same rows
        for key in ("grad_accum", "micro_batch_rows"):
            if key in saved and saved[key] != current[key]:
                return f"{key}={current[key]}, but the checkpoint was saved with {key}={saved[key]}"
    if compare_steps and saved.get("total_steps") not in (None, current["total_steps"]):
        key = "max_steps" if current["max_steps"] is not None or saved.get("max_steps") is not None else "num_epochs"
        return (f"{key}={current[key]} ({current['total_steps']} steps), but the checkpoint was saved with "
                f"{key}={saved.get(key, 'unrecorded')} ({saved['total_steps']} steps; another lr schedule)")
    return None


def _split(layout: dict) -> str:
    return (f"dp {layout.get('dp_size', '?')} x grad_accum {layout['grad_accum']} x micro_batch_rows "
            f"{layout['micro_batch_rows']}")


def _engine_name(values: dict) -> str:
    """How the resume line names the engine of a layout: `engine` (trainer_state.json since FSDP2; older checkpoints
    have only `deepspeed_stage`)."""
    if values.get("engine") == "fsdp2":
        return "FSDP2"
    stage = values.get("deepspeed_stage")
    return "no DeepSpeed" if stage is None else f"ZeRO-{stage}"


def describe_resume(saved: dict, current: dict) -> str | None:
    """What a resume changes of the checkpoint's layout (None: nothing): the dp / sp degrees, the split of a step
    into micro-batches, and what that did to the optimizer state. `saved`: trainer_state.json; `current`: the same
    keys for this run (dp_size, sp_size, grad_accum, micro_batch_rows, world_size, engine, deepspeed_stage,
    expert_parallel_size: another degree regroups the experts)."""
    keys = ("dp_size", "sp_size", "grad_accum", "micro_batch_rows")
    ep_before, ep_now = int(saved.get("expert_parallel_size", 1)), int(current.get("expert_parallel_size", 1))
    experts = "" if ep_before == ep_now else (
        f"experts regrouped: expert_parallel_size {ep_before} → {ep_now} ("
        + ("each rank read its experts from the whole tensors of the DCP checkpoint" if current["engine"] == "fsdp2"
           else "the saved parts put together, each rank's part cut from them") + ", weights and Adam moments)")
    if all(saved.get(k) == current[k] for k in keys):
        return experts or None

    def layout(values: dict) -> str:
        return (f"dp={values.get('dp_size')} sp={values.get('sp_size')} grad_accum={values['grad_accum']} "
                f"micro_batch_rows={values['micro_batch_rows']} ({_engine_name(values)})")

    before, now = int(saved["world_size"]), current["world_size"]
    if before == now:
        what = "optimizer state loaded as saved (the same number of processes)"
    elif current["engine"] == "fsdp2":
        what = f"weights and optimizer state resharded {before} → {now} FSDP2 shards (DCP)"
    elif current["deepspeed_stage"] is None:
        what = "optimizer state loaded whole, as saved (no DeepSpeed: it is not partitioned)"
    else:
        what = f"optimizer state resharded {before} → {now} ZeRO partitions"
    rng = "" if before == now else "; rng: fresh per-rank streams seeded from (seed, step, rank)"
    return f"saved on {layout(saved)}, now {layout(current)}: {what}{rng}" + (f"; {experts}" if experts else "")


# Model config keys a resumed run may change: they change how it trains, what it outputs or how the config is filed,
# not the function the weights compute. Any key with "dropout" in its name (or gpt2's `*_pdrop`) is one too.
RESUME_FREE_MODEL_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype",  # filing; the trainer sets the precision
    "attn_implementation", "_attn_implementation", "use_cache",  # the attention kernel and the inference cache
    "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",  # outputs, chunking
    "id2label", "label2id", "problem_type",  # classification heads, unused by a causal LM
    "initializer_range",  # random init only: a resume loads every weight
    "output_router_logits", "router_aux_loss_coef",  # the MoE aux loss: part of the objective (train keys too)
})


def _resume_free(key: str) -> bool:
    return key in RESUME_FREE_MODEL_KEYS or "dropout" in key or key.endswith("_pdrop")


def _flat_config(config: dict, prefix: str = "") -> dict:
    """Dotted keys (`rope_parameters.rope_theta`) of a config's leaves, the keys a resume may change left out."""
    flat = {}
    for key, value in config.items():
        if _resume_free(key):
            continue
        if isinstance(value, dict) and value:
            flat.update(_flat_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def model_identity(model_config, lora) -> dict:
    """What a checkpoint remembers of its model (`model_mismatch`): the model config as transformers reads it
    (`model_config`), and the LoRA settings that shape the adapters or scale them (`lora`: the config's section)."""
    record = {"lora_rank": lora.lora_rank}
    if lora.lora_rank:
        targets = lora.target_modules
        record.update(lora_alpha=lora.lora_alpha,
                      target_modules="all-linear" if targets == ["all-linear"] else sorted(targets))
        if lora.target_parameters:  # recorded when set (older checkpoints have none)
            record["target_parameters"] = sorted(lora.target_parameters)
    return {"config": orjson.loads(model_config.to_json_string(use_diff=False)), "lora": record}


def model_mismatch(saved: dict | None, current: dict, source: str) -> str | None:
    """How this run's model differs from the checkpoint's (None: the same, or a checkpoint that predates the
    record): each model config key (`source` names where this run's config comes from) and LoRA setting with both
    values. `current` / `saved`: {"config": the model config as a dict, "lora": {"lora_rank", and with a rank
    "lora_alpha", "target_modules"}}."""
    if not saved:
        return None
    current = orjson.loads(orjson.dumps(current))  # as the checkpoint stored it (tuples as lists, ...)

    def shown(values: dict, key: str) -> str:
        return repr(values[key]) if key in values else "unset"

    def differences(before: dict, now: dict, keys) -> list[str]:
        return [f"{key} is {shown(now, key)} here, {shown(before, key)} in the checkpoint" for key in keys
                if key not in before or key not in now or before[key] != now[key]]

    before, now = _flat_config(saved.get("config") or {}), _flat_config(current["config"])
    config_diffs = differences(before, now, sorted(set(before) | set(now)))
    diffs = [f"{source}: " + "; ".join(config_diffs)] if config_diffs else []
    lora_before, lora_now = saved.get("lora") or {"lora_rank": 0}, current["lora"]
    diffs += differences(lora_before, lora_now, [k for k in lora_now if k == "lora_rank" or k in lora_before])
    return "; and ".join(diffs) or None


# ---------------------------------------------------------------------------------------------- another world size
def reshard_rng_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank `rank`'s generators when a run resumes on another number of ranks: the saved per-rank
    states cannot map onto the new ranks (rows move between ranks), so each rank starts fresh streams, reproducibly."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def check_same_model(path: Path, state: dict, identity: dict, model) -> None:
    """Before any tensor of checkpoint `path` loads (`state`: its trainer state): its weights belong to the model
    of `identity` (`model_identity`), the one of config section `model`, or CheckpointError."""
    source = f"model_path {model.model_path}" if model.model_path is not None else f"model_config {model.model_config}"
    mismatch = model_mismatch(state.get("model"), identity, source)
    if mismatch:
        raise CheckpointError(
            f"resume from {path}: the model is not the one the checkpoint was trained as: {mismatch}. Its weights "
            "and optimizer state belong to that model: resume with the checkpoint's model config and LoRA "
            "settings, or start a new run (another output_dir, or overwrite_output_dir=true with resume=none)"
        )
