"""Typed configuration of the data pipeline, loaded from the JSON file the user edits plus `key=value` overrides.

The generic helpers (`apply_overrides`, `from_dict`) are shared with the trainer's YAML config.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import difflib
import glob
import importlib.util
import inspect
import io
import os
import re
import tokenize
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

STAGES = ("preprocess", "sample", "merge", "tokenize", "pack")
# other tools' names for data config keys: the "did you mean" of an unknown key (difflib cannot find these)
DATA_KEY_ALIASES = {
    "max_seq_length": "max_length", "max_seq_len": "max_length", "cutoff_len": "max_length", "seq_length": "max_length",
    "tokenizer": "tokenizer_path", "tokenizer_name_or_path": "tokenizer_path", "template": "chat_template",
    "output_path": "output_dir", "out_dir": "output_dir", "dataset": "inputs", "datasets": "inputs",
    "data_files": "inputs", "preprocessing_num_workers": "num_workers", "workers": "num_workers",
    "val_size": "eval_size", "test_size": "eval_size", "validation_split": "eval_size", "eval_split": "eval_size",
}
DEFAULT_REASONING_TAGS = ("<think>\n", "\n</think>\n\n")
# how a run executes, not what it outputs
EXECUTION_KEYS = ("num_workers", "stages", "engine", "ray_address", "render_timeout")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or violates an invariant."""


# ---------------------------------------------------------------------------------------------- generic helpers
def parse_value(text: str) -> Any:
    """`key=value` override values: JSON when it parses (numbers, true/false/null, lists), else the string."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def closest_key_hint(key: str, known, prefix: str = "", aliases: dict[str, str] | None = None) -> str:
    """`; did you mean 'x'?` for the known key closest to a mistyped one, or "" when none is close. `aliases` maps
    other frameworks' names to ours (`learning_rate` -> `lr`), which no spelling distance finds."""
    known = list(known)
    alias = (aliases or {}).get(str(key))
    close = [alias] if alias in known else difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def check_keys(raw: dict, cls, origin: str, prefix: str = "", aliases: dict[str, str] | None = None,
               help_hint: str = "") -> None:
    """Unknown keys of `raw` (sections recursively) name where they came from (`origin`: the config file or an
    override) and the closest known key (`aliases` for the top-level keys)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        if key not in fields:
            hint = closest_key_hint(key, fields, prefix, aliases)
            raise ConfigError(f"{origin}: unknown key '{prefix}{key}'{hint}{help_hint}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            check_keys(value, hints[key], origin, f"{prefix}{key}.", help_hint=help_hint)


def check_override_values(cls, overrides: list[str]) -> None:
    """Type-check each `key=value` override on its own, so that a bad value names the override, not the config
    file it is applied to. Keys that are not typed fields (free-form mappings) are left to the full check."""
    for item in overrides:
        if "=" not in item:
            continue  # apply_overrides names the malformed item
        key, value = item.split("=", 1)
        tp = cls
        for part in key.strip().split("."):
            hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
            tp = hints.get(part)
            if tp is None:
                break
        if tp is not None:
            _convert(tp, parse_value(value), f"override {item!r}: {key.strip()}")


def relative_note(path: str | os.PathLike) -> str:
    """For messages about a path that does not resolve: which directory a relative path was resolved against."""
    return "" if Path(path).is_absolute() else f" ({path} is relative to the current directory {os.getcwd()})"


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[parts[-1]] = parse_value(value)
    return raw


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        # a value whose own type is one of the union's keeps it: `int | float` reads 1.0 as a float, not a count
        for arg in sorted(args, key=lambda arg: arg is not type(value)):
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple):
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            value = [value]
        inner = args[0] if args else Any
        return [_convert(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a section (mapping), got {value!r}")
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, raw: dict, where: str = "config"):
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types are ConfigErrors naming the key."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        hint = closest_key_hint(unknown[0], names, aliases=DATA_KEY_ALIASES if cls is DataConfig else None)
        raise ConfigError(f"{where}: unknown key(s) {unknown}{hint}; known: {sorted(names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _convert(hints[f.name], raw[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing required key {f.name!r}")
    return cls(**kwargs)


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


# ---------------------------------------------------------------------------------------------- --help from the source
def field_help(cls) -> dict[str, str]:
    """One line of help per field: the comment on its line, else the comment lines right above it, else (for a
    section) its class docstring. The source comments are the documentation, so they cannot drift apart."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    hints = typing.get_type_hints(cls)
    helps = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        text = comments.get(node.lineno) or comments.get(node.end_lineno)
        if not text:
            above, line = [], node.lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.insert(0, comments.get(line, ""))
                line -= 1
            text = " ".join(above)
        if not text and dataclasses.is_dataclass(hints.get(name)):
            text = (inspect.getdoc(hints[name]) or "").splitlines()[0]
        helps[name] = text
    return helps


def type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join("null" if a is None else str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return "|".join(names + (["null"] if type(None) in args else []))
    if origin in (list, tuple):
        return f"list[{type_name(args[0]) if args else 'any'}]"
    if origin is dict or tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field, format_value: Callable[[Any], str]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "section"
    return format_value(value)


def key_help_lines(cls, format_value: Callable[[Any], str], prefix: str = "") -> list[str]:
    """`--help` lines of every key of config dataclass `cls` (sections flattened with dots): `key (type, default
    value)` and its help line from the source comments (`field_help`); `format_value` writes a default as the
    config file would (JSON for the data config, YAML for the train config)."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.append(f"{prefix}{f.name}.*: {helps.get(f.name, '')}")
            out.extend(key_help_lines(hints[f.name], format_value, f"{prefix}{f.name}."))
            continue
        out.append(f"  {prefix}{f.name} ({type_name(hints[f.name])}, default {_default_text(f, format_value)})")
        out.append(f"      {helps.get(f.name, '')}")
    return out


# ---------------------------------------------------------------------------------------------- the data config
@dataclass
class InputSpec:
    """One raw input: a file, a glob, or a list of them (`split@path` selects a split of a datasets dir)."""

    path: list[str]  # a file, a glob, split@dir (a datasets directory), or a list of them
    # auto | messages | sharegpt | prompt_response | verl | function
    format: Literal["auto", "messages", "sharegpt", "prompt_response", "verl", "function"] = "auto"
    category_name: str | None = None  # fixed category for every record of this input
    category_field: str | None = None  # or: the raw field holding the category name
    prompt_key: str = "prompt"  # prompt_response / verl single-turn (prompt: string or message list)
    response_key: str = "response"  # prompt_response / verl: the answer column (verl falls back to `output`)
    system: str | None = None  # system prompt added to prompt_response records
    messages_key: str = "messages"  # messages format: the column holding the message list
    tools_key: str = "tools"  # the column holding the tool specs, if any
    function: str | None = None  # "path/to/file.py:function" mapping one raw row to a canonical record


@dataclass
class MergeConfig:
    """Pseudo-multiturn: consecutive records merged with this probability; token budget (None: max_length)."""

    probability: float = 0.0  # probability that a record is appended to the previous conversation
    max_tokens: int | None = None  # token budget of a merged conversation; None: max_length


@dataclass
class PackConfig:
    """Packing of tokenized sequences into fixed-capacity rows."""

    max_length: int | None = None  # row capacity; None: DataConfig.max_length
    shard_size_mb: int = 1024  # shard size of tokenized/ and packed/ (MB)
    # exact_fill: rows filled one at a time toward exact sums (never more rows than best_fit); best_fit and
    # first_fit over lengths in decreasing order
    algorithm: Literal["exact_fill", "best_fit", "first_fit"] = "exact_fill"


class UnderOutput:
    """A read-only path attribute of `DataConfig`: `name` under its output_dir."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, cfg, owner=None):
        return self if cfg is None else Path(cfg.output_dir) / self.name


@dataclass
class DataConfig:
    inputs: list[InputSpec]  # the raw inputs (keys of each below)
    output_dir: str  # where every output goes: canonical/sampled/merged.jsonl, tokenized/, packed/, report.json
    tokenizer_path: str  # a local tokenizer directory (fast tokenizer) or a Hub id org/name; needed by merge and tokenize
    chat_template: str | None = None  # a Jinja file, for tokenizers without (or to replace) a chat template
    ratio_path: str | None = None  # the ratio JSON the user edits; None: <output_dir>/ratios.json
    max_length: int = 131072  # longest tokenized sequence (tokens); longer records follow `overlong`
    seed: int = 42  # seeds sampling, merging and packing
    num_workers: int = 0  # worker processes; 0: all cores (outputs are byte-identical for any count)
    on_error: Literal["error", "skip"] = "error"  # bad record: stop with path:line: field, or drop and count it
    # drop | error | truncate (at the last whole assistant turn that fits) | left | right (verl token truncation)
    overlong: Literal["drop", "error", "truncate", "left", "right"] = "drop"
    truncation: Literal["left", "right", "error"] | None = None  # verl's name; when set it overrides `overlong`
    loss_turns: Literal["all", "last"] = "all"  # rllm: cumulative (all assistant turns) or stepwise (last only)
    structure: Literal["parallel_thinking"] | None = None  # Parallel-R1 data: per-token block and path ids
    enable_thinking: bool | None = None  # default for records without their own `enable_thinking`
    # seconds the chat template may take to render one record (and a probe conversation); longer is an error naming
    # the template and the record (a template that loops); null: no bound
    render_timeout: float | None = 10.0
    # a category that loses more than this fraction of its records in tokenize (overlong, bad records) is a
    # warning at the end of the run and in report.json; one that loses all of them is an error
    category_loss_warning: float = 0.5
    # an input that loses more than this fraction of its rows in preprocess (bad rows under on_error: skip; rows a
    # user function filters out do not count) is a warning; one that loses all of them is an error
    input_loss_warning: float = 0.5
    # held-out eval split, taken per category before sampling copies and merging, packed into <output_dir>/eval/:
    # a fraction in (0, 1) of each category (0.05), or an integer count of records shared out over the categories by
    # size (40; 1.0 is a fraction, refused); null: none
    eval_size: int | float | None = None
    merge: MergeConfig = field(default_factory=MergeConfig)
    # ---- fidelity: what a record asks to train reaches the loss (docs/DATA.md, "What is trained")
    # reasoning_content of trained turns: auto (template renders it, else inline with reasoning_tags) |
    # template (the template's behaviour, losses counted) | drop | error (a turn whose reasoning would be lost)
    reasoning: Literal["auto", "template", "drop", "error"] = "auto"
    reasoning_tags: list[str] = field(default_factory=lambda: list(DEFAULT_REASONING_TAGS))  # [open, close]
    tool_arguments: Literal["parse", "keep"] = "parse"  # JSON-string tool-call arguments parsed to an object
    pack: PackConfig = field(default_factory=PackConfig)
    stages: list[str] = field(default_factory=lambda: list(STAGES))  # the stages to run (in pipeline order)
    # ---- execution engine (data/engine_ray.py): the output is byte-identical whichever engine runs it
    engine: Literal["local", "ray"] = "local"  # local: processes on this machine; ray: Ray Data (optional dep)
    ray_address: str | None = None  # ray: None starts a local instance; "auto" or "ray://host:10001" joins one

    # ------------------------------------------------------------------ derived paths
    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    @property
    def ratio_file(self) -> Path:
        return Path(self.ratio_path) if self.ratio_path else self.out / "ratios.json"

    canonical_path = UnderOutput("canonical.jsonl")
    sampled_path = UnderOutput("sampled.jsonl")
    merged_path = UnderOutput("merged.jsonl")
    tokenized_dir = UnderOutput("tokenized")
    packed_dir = UnderOutput("packed")
    report_path = UnderOutput("report.json")
    eval_dir = UnderOutput("eval")

    def eval_config(self) -> "DataConfig":
        """The config the eval split's merge, tokenize and pack stages run with: the same settings with every
        output under <output_dir>/eval/ (its sampled.jsonl holds the held-out records) and no pseudo-multiturn
        merging, so an eval record is scored on its own."""
        return dataclasses.replace(self, output_dir=str(self.eval_dir), ratio_path=str(self.ratio_file),
                                   merge=dataclasses.replace(self.merge, probability=0.0), eval_size=None)

    @property
    def pack_max_length(self) -> int:
        return self.pack.max_length or self.max_length

    @property
    def effective_overlong(self) -> str:
        return self.truncation if self.truncation else self.overlong

    @property
    def workers(self) -> int:
        return self.num_workers if self.num_workers > 0 else (os.cpu_count() or 1)

    def validate(self) -> None:
        """Invariants checked before any heavy work."""
        for st in self.stages:
            if st not in STAGES:
                raise ConfigError(f"stages: unknown stage {st!r}; known: {list(STAGES)}")
        if self.max_length <= 0:
            raise ConfigError(f"max_length must be positive, got {self.max_length}")
        if self.pack_max_length > self.max_length and "tokenize" in self.stages:
            raise ConfigError(
                f"pack.max_length={self.pack_max_length} exceeds max_length={self.max_length}"
            )
        if not 0.0 <= self.merge.probability <= 1.0:
            raise ConfigError(f"merge.probability must be in [0, 1], got {self.merge.probability}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        for key in ("category_loss_warning", "input_loss_warning"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"{key} must be in [0, 1], got {getattr(self, key)}")
        if self.render_timeout is not None and not self.render_timeout > 0:
            raise ConfigError(f"render_timeout must be a positive number of seconds (null: no bound), got "
                              f"{self.render_timeout}")
        if self.pack.shard_size_mb <= 0:
            raise ConfigError(f"pack.shard_size_mb must be positive, got {self.pack.shard_size_mb}")
        self._validate_eval_size()
        if "preprocess" in self.stages:
            for i, spec in enumerate(self.inputs):
                for pattern in spec.path:
                    local = pattern.split("@", 1)[1] if _has_split(pattern) else pattern
                    if not glob.glob(local):
                        raise ConfigError(f"inputs[{i}].path: no file matches {pattern!r}{relative_note(local)}")
                if spec.format == "function" and not spec.function:
                    raise ConfigError(f"inputs[{i}]: format 'function' needs function: 'file.py:name'")
        self._validate_inputs_are_not_outputs()
        needs_tokenizer = {"tokenize", "merge"} & set(self.stages)
        if needs_tokenizer:
            self.tokenizer_path = str(check_tokenizer_dir(self.tokenizer_path))  # a Hub id: its cached snapshot
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ConfigError(f"chat_template: {self.chat_template} is not a file{relative_note(self.chat_template)}")
        self._validate_fidelity()
        self._validate_engine()

    def _validate_eval_size(self) -> None:
        """An integer is a count of records, a number with a decimal point a fraction of each category: 1 holds
        out one record, 1.0 every record (refused, as is any fraction outside (0, 1))."""
        size = self.eval_size
        if isinstance(size, float) and not 0 < size < 1:
            whole = (f": {size} would hold out every record and leave nothing to train" if size == 1 else "")
            raise ConfigError(f"eval_size={size}: a fraction (a number with a decimal point) must be in (0, 1)"
                              f"{whole}; for a count of records write an integer (eval_size: 1 holds out one record)")
        if isinstance(size, int) and size < 1:
            raise ConfigError(f"eval_size={size}: a count of records must be >= 1 (a fraction in (0, 1) holds out "
                              "that share of each category; null: no eval split)")

    def written_paths(self) -> list[tuple[Path, str]]:
        """What the stages write (a file, or a directory and everything under it), each with who writes it."""
        return [(self.canonical_path, "preprocess"), (self.ratio_file, "preprocess (the ratio file)"),
                (self.sampled_path, "sample"), (self.merged_path, "merge"), (self.tokenized_dir, "tokenize"),
                (self.packed_dir, "pack"), (self.eval_dir, "the eval split's stages"),
                (self.report_path, "every stage")]

    def _validate_inputs_are_not_outputs(self) -> None:
        """An input that a stage writes over (canonical.jsonl or merged.jsonl in output_dir, a file under packed/,
        the ratio file) would be lost the first time that stage runs, or read back as its own output: refused,
        whichever stages this run has."""
        written = [(os.path.realpath(path), who) for path, who in self.written_paths()]
        for i, spec in enumerate(self.inputs):
            for pattern in spec.path:
                for match in sorted(glob.glob(split_spec(pattern)[1])):
                    real = os.path.realpath(match)
                    for path, who in written:
                        if real == path or real.startswith(path + os.sep):
                            raise ConfigError(
                                f"inputs[{i}].path: {match} is an output of {who} (output_dir {self.output_dir}): a "
                                "run would write over this input, or read an earlier run's output as input; move "
                                "the input out of the output directory, or set another output_dir")

    def _validate_fidelity(self) -> None:
        tags = self.reasoning_tags
        if len(tags) != 2 or not all(tags):
            raise ConfigError(f"reasoning_tags must be two non-empty strings [open, close], got {tags!r}")

    def _validate_engine(self) -> None:
        """`engine: ray` needs Ray importable (an optional dependency); `ray_address` is only read by it."""
        if self.engine == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("engine: ray needs Ray installed: pip install -r requirements-ray.txt")
        if self.ray_address is not None and self.engine != "ray":
            raise ConfigError(f"ray_address={self.ray_address!r} is only used with engine: ray (engine is "
                              f"{self.engine!r})")


def check_tokenizer_dir(path: str) -> Path:
    """`tokenizer_path`: a local directory holding tokenizer files (their hash identifies the tokenizer), or a
    Hugging Face Hub id resolved to its snapshot (from the cache when offline). Returns the directory."""
    from data.fsutil import TOKENIZER_FILE_NAMES

    if Path(path).is_file():
        raise ConfigError(f"tokenizer_path: {path} is a file; give the tokenizer's directory (the one holding "
                          "tokenizer.json / tokenizer_config.json)")
    where = pretrained_dir(path, "tokenizer_path")
    if not any((where / name).is_file() for name in TOKENIZER_FILE_NAMES):
        raise ConfigError(f"tokenizer_path: {path} holds no tokenizer files (looked for "
                          f"{', '.join(TOKENIZER_FILE_NAMES[:3])}, ...)")
    return where


def output_config(cfg: DataConfig) -> dict:
    """The config stored in tokenized/ and packed/ meta.json: without the keys that do not change the output
    (`EXECUTION_KEYS`: `num_workers`, `stages`, `engine`, `ray_address`, `render_timeout`), so meta.json is
    byte-identical whatever the worker count, the stages run or the engine."""
    return {k: v for k, v in to_dict(cfg).items() if k not in EXECUTION_KEYS}


def _has_split(pattern: str) -> bool:
    """`train@data/dir` selects a split; an '@' inside a real path (rare) is taken literally if it exists."""
    return "@" in pattern and not os.path.exists(pattern) and "/" not in pattern.split("@", 1)[0]


def split_spec(pattern: str) -> tuple[str | None, str]:
    """`split@path` -> (split, path); a plain path -> (None, path)."""
    if _has_split(pattern):
        split, path = pattern.split("@", 1)
        return split, path
    return None, pattern


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> DataConfig:
    try:
        raw = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist{relative_note(path)}") from None
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    for item in overrides or []:
        if "=" in item:
            key = item.split("=", 1)[0].strip()
            check_keys(key_tree(key), DataConfig, f"override {item!r}", aliases=DATA_KEY_ALIASES,
                       help_hint=" (sh data_process.sh --help lists every key)")
    check_override_values(DataConfig, overrides or [])
    apply_overrides(raw, overrides or [])
    return from_dict(DataConfig, raw, where=str(path))


def key_tree(key: str) -> dict:
    """`a.b.c` as {a: {b: {c: None}}}: an override's key in the shape `check_keys` walks."""
    node: dict = {}
    for part in reversed(key.split(".")):
        node = {part: node} if node else {part: None}
    return node


# ---------------------------------------------------------------------------------------------- Hub ids
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # configs and tokenizers, not the weights


@functools.lru_cache(maxsize=None)
def pretrained_dir(name: str, key: str) -> Path:
    """A local directory as is; else a Hugging Face Hub id (`org/name`), resolved to its local snapshot of config
    and tokenizer files (from the cache when offline). The weights are fetched later by from_pretrained."""
    path = Path(name)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}: {name} is a file; give the directory that holds it (or a Hub id org/name)")
        return path
    if not _HUB_ID.fullmatch(name) or name.startswith("."):
        raise ConfigError(f"{key}: {name} does not exist (a local directory, or a Hugging Face Hub id org/name)"
                          f"{relative_note(name)}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError as exc:
        offline = " (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"{key}: {name} is not a local directory, and the Hugging Face Hub is unreachable{offline} with no cached "
            f"copy: download it where the Hub is reachable (hf download {name}) or give a local "
            f"directory ({type(exc).__name__})"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: {name} is neither a local directory nor a Hugging Face Hub model id (not found, or gated: log in "
            "with hf auth login)"
        ) from None
    except OSError as exc:  # network errors after retries
        raise ConfigError(f"{key}: {name} is not a local directory, and the Hugging Face Hub failed: {exc}") from None
