"""What each stage's output was made from, and the check that refuses a partial run on outputs made from something
else than the run's inputs and settings.

After a stage succeeds the driver records, in `<output_dir>/provenance.json` (the eval split's stages in
`<output_dir>/eval/provenance.json`), under the stage's name:

- `settings`: the config keys the stage reads that change its output (`stage_settings`), the tokenizer's and
  chat template's hashes for the stages that tokenize;
- `inputs`: the identity of each file it read, taken before it ran: the raw inputs, a user function's file and
  the files of the modules it imports that are neither the standard library, installed packages nor PackSFT's own
  (`converter_modules`: found from the source, transitively, nothing executed) for preprocess, the previous
  stage's output for the others;
- `outputs`: the identity of what it wrote.

A file's identity (`identity`) is its size, modification time (ns) and a blake2b of its first and last 64 KiB (cheap
for any size); a dataset directory's (tokenized/, packed/) the blake2b of its meta.json, which holds every shard's
checksum; a datasets directory input's a digest of its files' names, sizes and modification times.

A run whose first stage is not preprocess reads outputs of stages it does not run. `check_provenance` compares the
record of each of those stages with what that stage would use now (its settings under this run's config, its
inputs as they are on disk, its outputs as they are on disk); the first that differs stops the run with one line
naming the file the run would read, what changed (key, recorded value, this run's value; or the input) and the
command that re-runs from that stage. A stage output without a record (written by a version without provenance, or
by a stage called from Python rather than through the driver) is accepted with a warning that says so.
The ratio file is not part of it: an edit after sampling is the warning of `pipeline.stale_input_warnings`.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from common.config import ConfigError, to_dict
from common.fsutil import atomic_write_bytes, file_blake2b, tokenizer_hash
from data.config import STAGES, DataConfig
from data.shards.chat_templates import chat_template_hash
from data.shards.processor import MediaSettings

PROVENANCE_NAME = "provenance.json"
FORMAT = 1
EDGE_BYTES = 64 << 10  # the head and tail of a file hashed into its identity
EVAL_STAGES = ("merge", "tokenize", "pack")


class StaleOutputError(ConfigError):
    """An output a run would read was made from other inputs or settings than the run's."""


# ---------------------------------------------------------------------------------------------- identities
def _file_identity(path: Path, st: os.stat_result) -> dict:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        if st.st_size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, st.st_size - EDGE_BYTES))
            h.update(f.read(EDGE_BYTES))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edges_blake2b": h.hexdigest()}


def _tree_identity(path: Path) -> dict:
    h = hashlib.blake2b(digest_size=16)
    files = size = 0
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = Path(root, name)
            st = full.stat()
            files, size = files + 1, size + st.st_size
            h.update(orjson.dumps([str(full.relative_to(path)), st.st_size, st.st_mtime_ns]))
    return {"files": files, "size": size, "listing_blake2b": h.hexdigest()}


def identity(path: str | os.PathLike) -> dict | None:
    """The identity of a file or directory (see the module's docstring); None when it does not exist."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if not path.is_dir():
        return _file_identity(path, st)
    meta = path / "meta.json"
    if meta.is_file():  # a dataset the shard writer made: its manifest lists every shard's checksum
        return {"meta_blake2b": file_blake2b(meta)}
    return _tree_identity(path)


# ---------------------------------------------------------------------------------------------- what a stage reads
def _tokenizer_settings(cfg: DataConfig) -> dict:
    tokenizer = tokenizer_hash(cfg.tokenizer_path) if Path(cfg.tokenizer_path).is_dir() else None
    return {"tokenizer": tokenizer,
            "chat_template": chat_template_hash(cfg.chat_template)}  # a file's bytes, or a built-in name's text


def stage_settings(cfg: DataConfig, stage: str) -> dict[str, Any]:
    """The config keys `stage` reads that change its output ({dotted key: value}); `tokenizer` and `chat_template`
    are the hashes of the tokenizer files and of the template file (None: not known here). Not `on_error`: a
    stage that ran under `error` met no bad record, so under `skip` it makes the same output, and the other way
    round it makes the same or stops."""
    if stage == "preprocess":
        return {"inputs": to_dict(cfg)["inputs"], "image_root": list(cfg.image_root)}
    if stage == "sample":
        return {"seed": cfg.seed, "eval_size": cfg.eval_size}
    if stage == "merge":
        settings = {"merge.probability": cfg.merge.probability, "loss_turns": cfg.loss_turns}
        if cfg.merge.probability > 0:  # records are drawn and their tokens counted
            # the token budget of a merged conversation: merge.max_tokens, else max_length
            settings.update({"seed": cfg.seed, "merge.max_tokens or max_length": cfg.merge.max_tokens or cfg.max_length})
            settings.update(_fidelity_settings(cfg), **_tokenizer_settings(cfg))
        return settings
    if stage == "tokenize":
        return {**_tokenizer_settings(cfg), "max_length": cfg.max_length, "overlong": cfg.overlong,
                "truncation": cfg.truncation, "structure": cfg.structure,
                **_fidelity_settings(cfg), **{key: getattr(cfg, key) for key in MediaSettings.keys()},
                "stepwise": cfg.stepwise,
                # a tree longer than the row is split between steps at tokenize
                **({"pack.max_length": cfg.pack_max_length} if cfg.stepwise == "tree" else {})}
    if stage == "pack":
        return {"pack.max_length": cfg.pack_max_length, "pack.algorithm": cfg.pack.algorithm, "seed": cfg.seed}
    raise ValueError(f"unknown stage {stage!r}")


def _fidelity_settings(cfg: DataConfig) -> dict:
    return {"enable_thinking": cfg.enable_thinking, "reasoning": cfg.reasoning,
            "reasoning_tags": list(cfg.reasoning_tags), "tool_arguments": cfg.tool_arguments}


def _raw_inputs(cfg: DataConfig) -> list[str]:
    """The files preprocess reads: every input (globs expanded; a missing one is left out), user functions' and the
    files of the modules they import (`converter_modules`)."""
    from data.config import split_spec
    from data.io import expand_inputs

    paths = []
    for spec in cfg.inputs:
        for pattern in spec.path:
            try:
                paths += expand_inputs(pattern)
            except FileNotFoundError:
                pass
        if spec.function:
            file = spec.function.rsplit(":", 1)[0]
            paths += [file, *(converter_modules(file)[0] if Path(file).is_file() else [])]
    return [split_spec(p)[1] for p in paths]


# ---------------------------------------------------------------------------------------------- a converter's modules
PACKSFT_ROOT = Path(__file__).resolve().parents[1]
PACKSFT_PACKAGES = ("common", "data", "train")
DYNAMIC_IMPORTS = ("import_module", "__import__", "spec_from_file_location", "run_path", "run_module", "exec")


def _installed_or_standard(path: Path) -> bool:
    """A module file of the standard library, of an installed package, or of PackSFT itself."""
    import sysconfig

    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return True
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    if any(path.is_relative_to(Path(root).resolve()) for root in roots if root):
        return True
    return any(path.is_relative_to(PACKSFT_ROOT / package) for package in PACKSFT_PACKAGES)


def _module_files(name: str, search: list[Path]) -> list[Path]:
    """The files that `import name` runs (each package's __init__.py on the way, then the module; a later part
    that is no module is an attribute), found in the first directory of `search` that has the first part, as
    Python's path finder looks; [] for a builtin or unknown module."""
    parts = name.split(".")
    for base in search:
        files, here = [], base
        for part in parts:
            here = here / part
            if (here / "__init__.py").is_file():
                files.append(here / "__init__.py")
            elif here.with_suffix(".py").is_file():
                files.append(here.with_suffix(".py"))
                break
            else:
                break
        if files:
            return [f.resolve() for f in files]
    return []


def _imports_of(path: Path) -> tuple[list[tuple[str, Path | None]], list[str]]:
    """(modules `path` imports, each with the directory of a relative import's package; the calls that import by a
    computed name, as `file:line: name(...)`) from its source."""
    import ast

    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return [], [f"{path}: unreadable as Python source"]
    names, dynamic = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = path.parent
            for _ in range(max(node.level - 1, 0)):
                base = base.parent
            relative = base if node.level else None
            if node.module:
                names.append((node.module, relative))
            names += [(f"{node.module}.{alias.name}" if node.module else alias.name, relative)
                      for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if called in DYNAMIC_IMPORTS:
                dynamic.append(f"{path}:{node.lineno}: {called}(...)")
    return names, dynamic


def converter_modules(function_file: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(the files of the modules a user function's file imports, transitively, other than the standard library,
    installed packages and PackSFT's own: what else its output depends on; the imports by a computed name found on
    the way, which cannot be followed). Found from the source alone, in the function file's directory first, then
    on sys.path; nothing is executed."""
    import sys

    start = Path(function_file).resolve()
    search = [start.parent, *(Path(p or ".").resolve() for p in sys.path if Path(p or ".").is_dir())]
    seen, found, dynamic, todo = {start}, [], [], [start]
    while todo:
        names, calls = _imports_of(todo.pop())
        dynamic += calls
        for name, relative in names:
            for file in _module_files(name, [relative] if relative is not None else search):
                if file not in seen and not _installed_or_standard(file):
                    seen.add(file)
                    found.append(str(file))
                    todo.append(file)
    return sorted(found), dynamic


def stage_files(cfg: DataConfig, stage: str) -> tuple[dict[str, Path], dict[str, Path]]:
    """({name: path} the stage reads, {name: path} it writes); names of outputs relative to output_dir."""
    out = cfg.out
    if stage == "preprocess":
        return {p: Path(p) for p in dict.fromkeys(_raw_inputs(cfg))}, {"canonical.jsonl": cfg.canonical_path}
    if stage == "sample":
        written = {"sampled.jsonl": cfg.sampled_path}
        if cfg.eval_size is not None:
            written[os.path.relpath(cfg.eval_config().sampled_path, out)] = cfg.eval_config().sampled_path
        return {"canonical.jsonl": cfg.canonical_path}, written
    if stage == "merge":
        return {"sampled.jsonl": cfg.sampled_path}, {"merged.jsonl": cfg.merged_path}
    if stage == "tokenize":
        return {"merged.jsonl": cfg.merged_path}, {"tokenized": cfg.tokenized_dir}
    if stage == "pack":
        return {"tokenized": cfg.tokenized_dir}, {"packed": cfg.packed_dir}
    raise ValueError(f"unknown stage {stage!r}")


# ---------------------------------------------------------------------------------------------- the record
def provenance_path(cfg: DataConfig) -> Path:
    return cfg.out / PROVENANCE_NAME


def read_provenance(cfg: DataConfig) -> dict[str, dict]:
    """{stage: record} of `cfg`'s output_dir ({} when none was recorded; an unreadable file counts as none)."""
    try:
        data = orjson.loads(provenance_path(cfg).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {}
    return data.get("stages", {}) if isinstance(data, dict) and data.get("format") == FORMAT else {}


def capture(cfg: DataConfig, stage: str) -> dict:
    """What `stage` is about to run on (settings, input identities): taken before it runs."""
    reads, _ = stage_files(cfg, stage)
    return {"settings": stage_settings(cfg, stage), "inputs": {name: identity(p) for name, p in reads.items()}}


def record(cfg: DataConfig, stage: str, captured: dict) -> None:
    """After `stage` succeeded: its record (`capture`'s, with its outputs' identities) into provenance.json."""
    _, written = stage_files(cfg, stage)
    stages = read_provenance(cfg)
    stages[stage] = {**captured, "outputs": {name: identity(p) for name, p in written.items()}}
    ordered = {s: stages[s] for s in STAGES if s in stages}
    cfg.out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(provenance_path(cfg), orjson.dumps({"format": FORMAT, "stages": ordered},
                                                          option=orjson.OPT_INDENT_2) + b"\n")


# ---------------------------------------------------------------------------------------------- the check
def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 80 else text[:77] + "..."


def _settings_change(stage: str, recorded: dict, current: dict) -> str | None:
    changed = []
    common = [key for key in recorded if key in current]  # keys one setting brings in (merge.probability > 0)
    keys = common if any(recorded[k] != current[k] for k in common) else sorted(set(recorded) | set(current))
    for key in keys:
        old, new = recorded.get(key), current.get(key)
        if key in ("tokenizer", "chat_template"):
            if new is None and key == "tokenizer":
                continue  # the tokenizer is not at hand (a Hub id a pack-only run does not resolve): not compared
            if old != new:
                changed.append(f"another {key.replace('_', ' ')} (hash {str(old)[:12]}, this run's {str(new)[:12]})")
        elif old != new:
            changed.append(f"{key}={_short(old)} (this run: {_short(new)})")
    return f"{stage} ran with {', '.join(changed)}" if changed else None


def _identity_change(old: dict | None, new: dict | None) -> str:
    if new is None:
        return "no longer exists"
    if old is None:
        return "did not exist then"
    if "size" in old and "size" in new and old["size"] != new["size"]:
        return f"changed (size {old['size']} -> {new['size']} bytes)"
    return "changed (rewritten or edited since)"


def _stage_problem(cfg: DataConfig, stage: str, rec: dict) -> str | None:
    """Why `stage`'s output is not what `stage` would make now, or None."""
    changed = _settings_change(stage, rec.get("settings", {}), stage_settings(cfg, stage))
    if changed:
        return changed
    reads, written = stage_files(cfg, stage)
    recorded_inputs = rec.get("inputs", {})
    for name in list(recorded_inputs) + [n for n in reads if n not in recorded_inputs]:
        old, new = recorded_inputs.get(name), identity(reads[name]) if name in reads else None
        if old != new:
            where = name if stage == "preprocess" else str(cfg.out / name)
            if old is None:
                return f"{where} is an input of {stage} now, which it did not read when it ran"
            return f"an input of {stage}, {where}, {_identity_change(old, new)} since {stage} ran"
    for name, path in written.items():
        old = rec.get("outputs", {}).get(name)
        new = identity(path)
        if old != new and new is not None:
            return (f"{path} {_identity_change(old, new)} after {stage} recorded what it was made from (edited, "
                    f"or written by a run that stopped before recording, or by the stage called from Python)")
    return None


def _unfollowed_imports(cfg: DataConfig, rerun: str) -> list[str]:
    """A warning per user function whose modules are imported by a computed name: their changes are not seen."""
    warnings = []
    for spec in cfg.inputs:
        file = spec.function.rsplit(":", 1)[0] if spec.function else None
        dynamic = converter_modules(file)[1] if file and Path(file).is_file() else []
        if dynamic:
            warnings.append(f"{cfg.canonical_path} is reused, but the converter {spec.function} imports modules by a "
                            f"computed name ({'; '.join(dynamic[:3])}), whose changes PackSFT cannot see: if they "
                            f"changed, re-run from preprocess: {rerun}")
    return warnings


def check_provenance(cfg: DataConfig, command: Callable[[list[str]], str]) -> list[str]:
    """Before a run: refuse (StaleOutputError) when an output that a stage of the run reads, or any output before
    it, was made from other inputs or settings than the run's; returns warnings (outputs with no record). The
    eval split's outputs are judged alike (eval/provenance.json)."""
    planned = [s for s in STAGES if s in cfg.stages]
    if not planned or planned[0] == "preprocess":
        return []
    first, last = planned[0], planned[-1]

    def rerun(stage: str) -> str:
        return command(list(STAGES[STAGES.index(stage):STAGES.index(last) + 1]))

    chains = [(cfg, STAGES[:STAGES.index(first)])]
    if cfg.eval_size is not None and first in EVAL_STAGES[1:]:
        chains.append((cfg.eval_config(), EVAL_STAGES[:EVAL_STAGES.index(first)]))
    warnings, problem = [], None
    for config, upstream in chains:
        records = read_provenance(config)
        for stage in upstream:
            rec = records.get(stage)
            if rec is None:
                written = [str(p) for p in stage_files(config, stage)[1].values() if p.exists()]
                if written and not warnings:
                    warnings.append(f"{', '.join(written)} {'has' if len(written) == 1 else 'have'} no record of what "
                                    f"it was made from (written by a version without {PROVENANCE_NAME}, or by a stage "
                                    f"called from Python): its inputs and settings are not checked; re-run from "
                                    f"{stage} once to record them: {rerun(stage)}")
                continue
            why = _stage_problem(config, stage, rec)
            if why:
                if problem is None or STAGES.index(stage) < STAGES.index(problem[0]):
                    problem = (stage, why, config)
                break
            if stage == "preprocess":
                warnings += _unfollowed_imports(config, rerun(stage))
    if problem:
        stage, why, config = problem
        path = next(iter(stage_files(config, first)[0].values()))  # the eval split's, for a problem of its own
        raise StaleOutputError(f"{first} would read {path}, made from other inputs or settings than this run's: "
                               f"{why}; re-run from {stage}: {rerun(stage)}")
    return warnings
