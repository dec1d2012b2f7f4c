"""Typed configuration from dataclasses: a nested dict (the JSON or YAML file) plus `key=value` overrides checked
and converted field by field, errors that name the key and where it came from (with the closest known key), `--help`
lines read from the source comments, and Hugging Face Hub ids resolved to local directories. The data config
(data/config.py) and the trainer's (train/config/sections.py) are both built with it.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import os
import re
import tokenize
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import orjson

from common.errors import PackSFTError


class ConfigError(PackSFTError, ValueError):
    """A configuration value is missing, of the wrong type or violates an invariant."""

    label = "config error"
    exit_code = 2


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


def key_tree(key: str) -> dict:
    """`a.b.c` as {a: {b: {c: None}}}: an override's key in the shape `check_keys` walks."""
    node: dict = {}
    for part in reversed(key.split(".")):
        node = {part: node} if node else {part: None}
    return node


def field_type(cls, key: str) -> Any:
    """The type of field `a.b.c` of dataclass `cls`; None when the key is not a typed field (a free-form mapping)."""
    tp = cls
    for part in key.split("."):
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        tp = hints.get(part)
        if tp is None:
            return None
    return tp


def check_value(cls, key: str, value: Any, where: str) -> None:
    """`value` converts to the type of field `key` (dotted) of `cls`, else a ConfigError that starts with `where`."""
    tp = field_type(cls, key)
    if tp is not None:
        _convert(tp, value, where)


def check_override_values(cls, overrides: list[str], key_path: Callable[[str], str] | None = None) -> None:
    """Type-check each `key=value` override on its own, so that a bad value names the override, not the config
    file it is applied to. Keys that are not typed fields (free-form mappings) are left to the full check.
    `key_path`: the field's dotted path for a key as typed (a config whose section keys may be written flat)."""
    for item in overrides:
        if "=" not in item:
            continue  # apply_overrides names the malformed item
        key, value = item.split("=", 1)
        key = key.strip()
        check_value(cls, key_path(key) if key_path else key, parse_value(value), f"override {item!r}: {key}")


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


def from_dict(cls, raw: dict, where: str = "config", aliases: dict[str, str] | None = None):
    """Build dataclass `cls` from a nested dict; unknown keys and wrong types are ConfigErrors naming the key (and
    the closest known one, `aliases` for the top-level keys as in `closest_key_hint`)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        hint = closest_key_hint(unknown[0], names, aliases=aliases)
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
