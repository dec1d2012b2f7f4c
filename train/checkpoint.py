"""Resumable checkpoints under <output_dir>/checkpoints/, crash-safe.

Layout: `step-000012/` holds the model + optimizer + scheduler (DeepSpeed's own per-rank files under `ds/`, or
`model.pt`, `optimizer.pt`, `scheduler.pt` without DeepSpeed), `trainer_state.json` (step, sampler position) and
`rng/rank_<r>.pt` (python, numpy, torch and CUDA generator states of every rank).

Every rank writes into `.step-000012.tmp/`; after a barrier rank 0 renames it to `step-000012/` and then replaces
the `latest` pointer file (write temp + os.replace). A crash at any point leaves `latest` naming a complete
checkpoint; half-written `.tmp` directories are ignored and cleaned up by the next save. Saving a step that already
has a directory moves the old one aside (`.step-000012.old-*`) before the swap; a crash between the two renames
leaves `latest` naming a missing directory, and resume=latest then uses the moved-aside copy. Only the last
`save_total_limit` checkpoints are kept.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import orjson
import torch
import torch.distributed as dist

from data.shards import replace_dir

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir, step: int, rank: int, save_fn, trainer_state: dict, keep: int) -> Path:
    """Collective: every rank calls it. `save_fn(tmp_dir)` writes the model/optimizer/scheduler state (each rank
    its part). Returns the final directory."""
    root = checkpoint_root(output_dir)
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step-*.tmp"):  # leftovers of a crashed save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        (tmp / "rng").mkdir()
    _barrier()
    save_fn(tmp)
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        (tmp / "trainer_state.json").write_bytes(orjson.dumps(trainer_state, option=orjson.OPT_INDENT_2))
    _barrier()
    if rank == 0:
        replace_dir(tmp, final)  # the same step saved again (e.g. after resuming from an earlier one): replace it
        write_atomic(root / LATEST, final.name.encode())
        for stale in root.glob(".step-*.old-*"):  # moved aside by a re-save that was killed mid-swap
            shutil.rmtree(stale, ignore_errors=True)
        _prune(root, keep)
    _barrier()
    return final


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete-or-not `step-N/` directories under output_dir, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    return [p for _, p in steps]


def discard_checkpoints(output_dir: str | os.PathLike) -> None:
    """Start over in output_dir (overwrite_output_dir): remove the earlier run's checkpoints."""
    shutil.rmtree(checkpoint_root(output_dir), ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    steps = list_checkpoints(root.parent)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    for path in steps[:-keep] if keep > 0 else []:
        if path.name != latest:
            shutil.rmtree(path, ignore_errors=True)


def _moved_aside(root: Path) -> Path | None:
    """The complete moved-aside copy of the checkpoint `latest` names, when a crash in the middle of re-saving that
    step left it missing (see save_checkpoint); else None."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if (root / name).exists():
        return None
    copies = sorted(p for p in root.glob(f".{name}.old-*") if (p / "trainer_state.json").is_file())
    return copies[-1] if copies else None


def resolve_resume(resume: str, output_dir) -> Path | None:
    """`none` -> None; `latest` -> the checkpoint named by the pointer (None when there is none yet); a path."""
    if resume == "none":
        return None
    if resume == "latest":
        pointer = checkpoint_root(output_dir) / LATEST
        if not pointer.is_file():
            return None
        path = checkpoint_root(output_dir) / pointer.read_text().strip()
        if not path.exists():
            path = _moved_aside(checkpoint_root(output_dir)) or path
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{pointer} names {path}, which is not a complete checkpoint")
        return path
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"resume: {path} is not a checkpoint directory (no trainer_state.json)")
    return path


def load_trainer_state(path: Path) -> dict:
    return orjson.loads((path / "trainer_state.json").read_bytes())


def load_rng(path: Path, rank: int) -> None:
    file = path / "rng" / f"rank_{rank}.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no rng state for rank {rank} (saved with fewer processes?)")
    set_rng_state(torch.load(file, weights_only=False))
