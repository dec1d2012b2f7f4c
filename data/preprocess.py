"""Stage 1: raw inputs -> canonical.jsonl, plus the ratio file the user edits to weight categories.

Formats (InputSpec.format, `auto` detects from the first row's keys):
- messages: OpenAI-style `messages` (content may be a list of parts: text / reasoning / tool_call, as in
  LLaMA-Factory's reasoning-tool-use data, and media: `{"type": "image", "image": PATH}`,
  `{"type": "image_url", "image_url": {"url": PATH or data: URI}}`, `{"type": "video", "video": PATH}`,
  `{"type": "video_url", ...}`, `{"type": "audio", "audio": PATH}`, `{"type": "audio_url", ...}`,
  `{"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}`), optional `labels`, `tools`,
  `enable_thinking`, `structure`, `images` / `videos` / `audios` (LLaMA-Factory's multimodal records: one path per
  `<image>` / `<video>` / `<audio>`).
- sharegpt: `conversations` of {from, value}; from in human/user, gpt/assistant, system, function_call
  (an assistant tool call), observation/tool/function (a tool result); optional top-level `system`, `tools`,
  `images`, `videos`, `audios`.

Media paths are relative to the data file's directory (LLaMA-Factory's lists); a canonical record holds them
absolute, each media part or path becoming a placeholder of its user message, and a video named in both `videos`
and `audios` (its `<audio>` after its `<video>`) becomes a video with its sound track (`audio_in_video`;
data/media.py).
- prompt_response: `prompt_key` (a string or a message list) and `response_key` columns (e.g. GSM8K
  question/answer); `InputSpec.system` is prepended when the prompt has no system message.
- verl: verl SFT parquet, `prompt` message list + `response_key` column, or `output` when there is none.
- alpaca: Stanford Alpaca / LLaMA-Factory's alpaca records, `instruction`, optional `input` (joined to the
  instruction with a newline, as LLaMA-Factory does), `output`; optional `system` and `history` (earlier
  [user, assistant] pairs, trained like the last answer).
- function: `file.py:function` maps one raw row to a canonical record (None filters the row out, counted
  as `filtered_by_function`; an exception is a `function_error` for that row). It may set
  `meta.category_name`; other `meta` keys are kept.

Records get `meta = {category_id, category_name, uid, source}`; uids are sequential over the output. The category
is InputSpec.category_name, else the raw field InputSpec.category_field, else `untracked` (id 0). Category ids
come from the ratio file; new categories get the next free id, in order of first appearance.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import orjson

from common.config import ConfigError
from data.config import DataConfig, InputSpec, split_spec
from data.media import fold_audio_in_video, resolve_media
from data.executor import ByteRange, Executor, LocalExecutor, Part, byte_ranges
from data.io import (UTF8_BOM, LineMemoryError, expand_inputs, input_is_empty, iter_jsonl_range, parse_jsonl_line,
                     read_rows)
from data.progress import progress
from data.ratios import UNTRACKED, check_ratio_names, merge_ratio_categories, read_ratio_file, write_ratio_file
from data.records import (MAX_CATEGORY_ID, MEDIA_KINDS, PLACEHOLDERS, RecordError, parse_json_field,
                          validate_canonical)
from data.report import DROPPED_AT_LIMIT, DroppedAt, check_arithmetic, sorted_counts, update_report


CHUNK_ROWS = 256  # rows per task of an input read by the driver
INPUT_RANGE_BYTES = 16 << 20  # .jsonl input bytes per task (a worker holds its rows at once)
MAX_ROW_GROUP_BYTES = 16 << 20  # a .parquet input with a larger row group is read by the driver
META_KEYS = ("category_id", "category_name", "uid", "source")  # set here; others from a user function pass
SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
    "function_call": "function_call", "observation": "tool", "tool": "tool", "function": "tool",
}
# (prompt, response) column pairs that `auto` recognizes besides the configured prompt_key/response_key
KNOWN_PAIRS = (("question", "answer"), ("prompt", "response"), ("prompt", "completion"), ("query", "response"))


# ---------------------------------------------------------------------------------------------- converters
def _required(raw: dict, key: str, source: str) -> Any:
    if key not in raw or raw[key] is None:
        raise RecordError(source, key, f"missing field {key!r}; row has {sorted(raw)}", "missing_field")
    return raw[key]


def _tool_calls_from_text(text: Any, source: str, field: str) -> list:
    """A ShareGPT function_call / LLaMA-Factory tool_call part: JSON `{"name", "arguments"}` or a list."""
    calls = parse_json_field(text, source, field, "bad_tool_calls")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise RecordError(source, field, "expected a JSON tool call {name, arguments} or a list of them",
                          "bad_tool_calls")
    return calls


# content part type -> the kind of media it holds
MEDIA_PARTS = {"image": "image", "image_url": "image", "video": "video", "video_url": "video", "audio": "audio",
               "audio_url": "audio", "input_audio": "audio"}


def _media_part(part: dict, kind: str) -> Any:
    """The path or URI (or datasets' {path, bytes} dict) of an OpenAI / transformers media part (None: a bare
    `{"type": "image"}`, whose item is the next of the record's list). `input_audio` (OpenAI's base64 audio with
    its format) becomes a `data:` URI."""
    if part.get("type") == "input_audio":
        audio = part.get("input_audio")
        if isinstance(audio, dict) and isinstance(audio.get("data"), str):
            return f"data:audio/{audio.get('format') or 'wav'};base64,{audio['data']}"
        return audio
    ref = part.get(kind, part.get(f"{kind}_url", part.get("url", part.get("path"))))
    return ref.get("url") if isinstance(ref, dict) and "url" in ref else ref


def _flatten_parts(msg: dict, source: str, field: str, media: dict[str, list]) -> dict:
    """A message whose content is a list of parts -> plain content, reasoning_content and tool_calls; a media
    part becomes its kind's placeholder and its reference (or None) is appended to `media[kind]`."""
    content = msg.get("content")
    if not isinstance(content, list):
        return msg
    text, reasoning, calls = [], [], []
    for j, part in enumerate(content):
        where = f"{field}.content[{j}]"
        if isinstance(part, str):
            text.append(part)
            continue
        if not isinstance(part, dict):
            raise RecordError(source, where, "expected a string or an object", "bad_content")
        kind = part.get("type", "text")
        value = part.get("text", part.get("value"))
        if kind in ("text", "reasoning", "thinking") and not isinstance(value, str):
            raise RecordError(source, where, "part has no string text/value", "bad_content")
        if kind == "text":
            text.append(value)
        elif kind in ("reasoning", "thinking"):
            reasoning.append(value)
        elif kind == "tool_call":
            calls.extend(_tool_calls_from_text(value, source, where))
        elif kind in MEDIA_PARTS:
            text.append(PLACEHOLDERS[MEDIA_PARTS[kind]])
            media[MEDIA_PARTS[kind]].append(_media_part(part, MEDIA_PARTS[kind]))
        else:
            raise RecordError(source, where, f"unsupported content part type {kind!r} (text, reasoning, "
                              f"tool_call, {', '.join(MEDIA_PARTS)})", "bad_content")
    out = {k: v for k, v in msg.items() if k != "content"}
    out["content"] = "".join(text)
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = list(msg.get("tool_calls") or []) + calls
    return out


def _no_media() -> dict[str, list]:
    return {kind: [] for kind in MEDIA_KINDS}


def _message_list(messages: Any, source: str, field: str, media: dict[str, list] | None = None) -> list[dict]:
    if not isinstance(messages, list):
        raise RecordError(source, field, f"expected a list of messages, got {type(messages).__name__}",
                          "bad_record")
    media = _no_media() if media is None else media
    return [_flatten_parts(m, source, f"{field}[{i}]", media) if isinstance(m, dict) else m
            for i, m in enumerate(messages)]


def _passthrough(raw: dict, rec: dict, spec: InputSpec, source: str, part_media: dict[str, list] | None = None
                 ) -> dict:
    """The record-level keys a format carries over; `part_media`: per kind, the references of the messages' media
    parts (None where a bare part takes the next of the row's list)."""
    tools = raw.get(spec.tools_key)
    if tools is not None:
        rec["tools"] = tools
    for key in ("enable_thinking", "structure", *MEDIA_KINDS.values()):
        if raw.get(key) is not None:
            rec[key] = raw[key]
    for kind, key in MEDIA_KINDS.items():
        parts = (part_media or {}).get(kind) or []
        given = [ref for ref in parts if ref is not None]
        if given:
            if len(given) != len(parts) or raw.get(key):
                raise RecordError(source, key, f"{kind} parts with paths and a row-level {key} list (or bare "
                                  f"{kind} parts) in one record; give each {kind} once", f"{kind}_count_mismatch")
            rec[key] = given
        elif parts and raw.get(key) is None:
            raise RecordError(source, key, f"{len(parts)} {kind} parts without a path and no {key} list",
                              f"{kind}_count_mismatch")
    return rec


def convert_messages(raw: dict, spec: InputSpec, source: str) -> dict:
    media = _no_media()
    rec = {"messages": _message_list(_required(raw, spec.messages_key, source), source, spec.messages_key, media)}
    if raw.get("labels") is not None:
        rec["labels"] = raw["labels"]
    return _passthrough(raw, rec, spec, source, media)


def convert_sharegpt(raw: dict, spec: InputSpec, source: str) -> dict:
    turns = _required(raw, "conversations", source)
    if not isinstance(turns, list):
        raise RecordError(source, "conversations", "expected a list of turns", "bad_record")
    messages = []
    if isinstance(raw.get("system"), str) and raw["system"]:
        messages.append({"role": "system", "content": raw["system"]})
    for i, turn in enumerate(turns):
        field = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(source, field, "expected an object {from, value}", "bad_message")
        speaker = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            raise RecordError(source, f"{field}.from", f"unknown role {speaker!r}; expected one of "
                              f"{sorted(SHAREGPT_ROLES)}", "unknown_role")
        if role == "function_call":
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": _tool_calls_from_text(value, source, f"{field}.value")})
        else:
            messages.append({"role": role, "content": value})
    return _passthrough(raw, {"messages": messages}, spec, source)


def _prompt_response(raw: dict, spec: InputSpec, source: str, prompt_key: str, response_key: str) -> dict:
    prompt = _required(raw, prompt_key, source)
    response = _required(raw, response_key, source)
    media = _no_media()
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = _message_list(prompt, source, prompt_key, media)
    if spec.system and not (messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": spec.system})
    if not isinstance(response, str):
        raise RecordError(source, response_key, f"expected a string, got {type(response).__name__}",
                          "bad_content")
    messages.append({"role": "assistant", "content": response})
    return _passthrough(raw, {"messages": messages}, spec, source, media)


def convert_prompt_response(raw: dict, spec: InputSpec, source: str) -> dict:
    return _prompt_response(raw, spec, source, spec.prompt_key, spec.response_key)


def convert_verl(raw: dict, spec: InputSpec, source: str) -> dict:
    response_key = spec.response_key if spec.response_key in raw else "output"
    return _prompt_response(raw, spec, source, spec.prompt_key, response_key)


def _text(raw: dict, key: str, source: str, required: bool = True) -> str:
    value = _required(raw, key, source) if required else raw.get(key) or ""
    if not isinstance(value, str):
        raise RecordError(source, key, f"expected a string, got {type(value).__name__}", "bad_content")
    return value


def convert_alpaca(raw: dict, spec: InputSpec, source: str) -> dict:
    """instruction (+ "\n" + input when it is not empty) -> the user turn, output -> the trained assistant turn;
    `history` pairs before them, `system` (else InputSpec.system) first."""
    instruction, extra = _text(raw, "instruction", source), _text(raw, "input", source, required=False)
    output = _text(raw, "output", source)
    system = _text(raw, "system", source, required=False) or spec.system
    messages = [{"role": "system", "content": system}] if system else []
    history = raw.get("history") or []
    if not isinstance(history, list):
        raise RecordError(source, "history", f"expected a list of [user, assistant] pairs, got "
                          f"{type(history).__name__}", "bad_record")
    for k, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise RecordError(source, f"history[{k}]", "expected a [user, assistant] pair of strings", "bad_record")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    messages += [{"role": "user", "content": f"{instruction}\n{extra}" if extra else instruction},
                 {"role": "assistant", "content": output}]
    return _passthrough(raw, {"messages": messages}, spec, source)


_USER_FUNCTIONS: dict[str, Any] = {}


def load_user_function(ref: str):
    """`path/to/file.py:name` -> the function (imported once per process from the file path)."""
    if ref in _USER_FUNCTIONS:
        return _USER_FUNCTIONS[ref]
    file, sep, name = ref.rpartition(":")
    if not sep or not file or not name:
        raise ValueError(f"function {ref!r}: expected 'path/to/file.py:function'")
    path = Path(file).resolve()
    if not path.is_file():
        raise ValueError(f"function {ref!r}: {path} is not a file")
    module_name = f"_packsft_user_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"function {ref!r}: {path} has no function {name!r}")
    _USER_FUNCTIONS[ref] = fn
    return fn


def convert_function(raw: dict, spec: InputSpec, source: str) -> dict | None:
    fn = load_user_function(spec.function)
    try:
        return fn(raw)
    except RecordError:
        raise
    except Exception as exc:  # the user's code: report which row broke it, and let on_error decide
        raise RecordError(source, "function", f"{spec.function} raised {type(exc).__name__}: {exc}",
                          "function_error") from exc


CONVERTERS = {
    "messages": convert_messages, "sharegpt": convert_sharegpt, "prompt_response": convert_prompt_response,
    "verl": convert_verl, "alpaca": convert_alpaca, "function": convert_function,
}


def detect_format(row: dict, spec: InputSpec, source: str) -> tuple[str, InputSpec]:
    """`auto` -> a concrete format from the row's keys; prompt/response column pairs are resolved too."""
    if spec.format != "auto":
        return spec.format, spec
    keys = set(row)
    if "conversations" in keys:
        return "sharegpt", spec
    if spec.messages_key in keys:
        return "messages", spec
    if spec.prompt_key in keys and spec.response_key in keys:
        return "prompt_response", spec
    if "prompt" in keys and "output" in keys:
        return "verl", spec
    if "instruction" in keys and "output" in keys:
        return "alpaca", spec
    for prompt_key, response_key in KNOWN_PAIRS:
        if prompt_key in keys and response_key in keys:
            return "prompt_response", InputSpec(**{**vars(spec), "prompt_key": prompt_key,
                                                   "response_key": response_key})
    raise RecordError(source, "format", f"cannot detect the format from keys {sorted(keys)}; set format "
                      f"(messages, sharegpt, prompt_response, verl, alpaca, function)", "unknown_format")


def category_of(raw: dict, rec: dict, spec: InputSpec, source: str) -> str:
    if spec.category_name:
        return spec.category_name
    if spec.category_field:
        value = raw.get(spec.category_field)
        if value is None or value == "":
            raise RecordError(source, spec.category_field, "missing category field", "missing_category")
        return str(value)
    name = (rec.get("meta") or {}).get("category_name")
    return str(name) if name else UNTRACKED


def convert_row(raw: dict, spec: InputSpec, fmt: str, source: str, base_dir: str = ".",
                image_roots: tuple[str, ...] = ()) -> tuple[dict, str] | None:
    """One raw row -> (validated canonical record, category name); None when a user function filters it. Media
    paths are resolved against `base_dir` (the data file's directory), must exist and lie under it or one of
    `image_roots` (`media.resolve_media`); a video named in `audios` too becomes a video with its sound track
    (`media.fold_audio_in_video`)."""
    rec = CONVERTERS[fmt](raw, spec, source)
    if rec is None:
        return None
    if isinstance(rec, dict):
        for kind, key in MEDIA_KINDS.items():
            if isinstance(rec.get(key), list):
                rec[key] = [resolve_media(kind, ref, base_dir, source, f"{key}[{k}]", image_roots)
                            for k, ref in enumerate(rec[key])]
        rec = fold_audio_in_video(rec, source)
    canonical = validate_canonical(rec, source)
    return canonical, category_of(raw, canonical, spec, source)


class CategoryIds:
    """Name -> id: existing ratio-file ids first, `untracked` is 0, new names get the next free id in order of
    first appearance (so ids do not depend on the worker count)."""

    def __init__(self, existing: list[dict]):
        self.ids = {c["category_name"]: c["category_id"] for c in existing}
        self.next_id = max(self.ids.values(), default=0) + 1

    def __call__(self, name: str) -> int:
        cid = self.ids.get(name)
        if cid is None:
            if name == UNTRACKED:
                cid = 0
            else:
                cid = self.next_id
                if cid > MAX_CATEGORY_ID:
                    raise ValueError(f"category {name!r}: no free category id left (ids are 0..{MAX_CATEGORY_ID})")
                self.next_id += 1
            self.ids[name] = cid
        return cid


# ---------------------------------------------------------------------------------------------- first pass
Where = int | str  # a row's place in its task: its source (`path:line`, `path:row`, ...), or in a .jsonl range
# its line number within the range (the driver, which knows the lines before the range, makes the source)


@dataclasses.dataclass(frozen=True)
class ConvertTask:
    """Rows of one input to convert (`convert_to_part`): its index in `cfg.inputs`, its spec (with the
    prompt/response keys `detect_format` found), its format, the part file the kept records go to, and the
    directories besides the data file's that media paths may resolve under (`image_roots`)."""
    spec_index: int
    spec: InputSpec
    fmt: str
    part: str
    image_roots: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)

    # the most sources a worker returns per drop reason (None: all); enough where the rows are in source order
    dropped_at_limit: ClassVar[int | None] = DROPPED_AT_LIMIT

    def read(self) -> tuple[int, list[tuple[Where, dict | RecordError]]]:
        """(lines read: a .jsonl range's, else 0; each row, or the RecordError that rejects it, with its place)."""
        raise NotImplementedError

    def source(self, where: Where, lines_before: int) -> str:
        """The source of the row at `where`; `lines_before`: the lines of the file before a .jsonl range."""
        return where

    def base_dir(self, where: Where) -> str:
        """The directory of the file holding the row at `where` (media paths are relative to it)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class JsonlRangeTask(ConvertTask):
    """The lines of a byte range of a .jsonl input, read by the worker. `lines_before`: the file's lines before
    the range where the driver knows them (an input's first range, after the lines it read to detect the
    format); None for the next ranges, whose lines follow those of the range before (`Converted.lines`)."""
    range: ByteRange
    lines_before: int | None

    def read(self) -> tuple[int, list[tuple[int, dict | RecordError]]]:
        return iter_jsonl_range(self.range.path, self.range.start, self.range.end)

    def source(self, where: int, lines_before: int) -> str:
        return f"{self.range.path}:{lines_before + where}"

    def base_dir(self, where: int) -> str:
        return os.path.dirname(self.range.path)


@dataclasses.dataclass(frozen=True)
class RowGroupTask(ConvertTask):
    """Row group `group` of a .parquet input (whose rows before it number `first_row`), read by the worker."""
    path: str
    group: int
    first_row: int

    def read(self) -> tuple[int, list[tuple[str, dict]]]:
        import pyarrow.parquet as pq

        with pq.ParquetFile(self.path) as pf:
            rows = pf.read_row_group(self.group).to_pylist()
        return 0, [(f"{self.path}:{self.first_row + i}", row) for i, row in enumerate(rows)]

    def base_dir(self, where: str) -> str:
        return os.path.dirname(self.path)


@dataclasses.dataclass(frozen=True)
class RowsTask(ConvertTask):
    """At most `CHUNK_ROWS` rows the driver read (`RowChunker`: inputs that do not split), with their sources."""
    rows: list[tuple[str, dict]]
    dirs: dict[str, str]  # source -> the directory of its file

    # every source: the rows of a .json object of arrays come key by key, not in source order
    dropped_at_limit: ClassVar[int | None] = None

    def read(self) -> tuple[int, list[tuple[str, dict]]]:
        return 0, self.rows

    def base_dir(self, where: str) -> str:
        return self.dirs[where]


@dataclasses.dataclass(frozen=True)
class RowError:
    """A row's RecordError, at its place in its task."""
    where: Where
    field: str
    message: str
    reason: str


@dataclasses.dataclass
class Converted:
    """What `convert_to_part` found in a task, for the driver's accounting (the kept records are in its part)."""
    lines: int  # a .jsonl range's lines (blank ones too), from which the next range's are numbered
    rows: int  # rows read, kept and dropped
    categories: dict[str, int] = dataclasses.field(default_factory=dict)  # kept, in order of first appearance
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # per reason
    dropped_at: dict[str, list[Where]] = dataclasses.field(default_factory=dict)  # the first per reason
    first_error: RowError | None = None
    out_of_memory: RowError | None = None  # a line the parser could not hold: fatal whatever on_error says

    @property
    def kept(self) -> int:
        return sum(self.categories.values())


def line_pieces(rec: dict) -> tuple[bytes, bytes]:
    """A converted record's canonical.jsonl line but for the values of the meta keys the driver decides (its
    category id, uid and source; category_name between them): the bytes before and after them. The line is
    `orjson.dumps(rec)` with `rec["meta"] = {category_id, category_name, uid, source, <its other meta keys>}`,
    in `validate_canonical`'s key order (messages, labels, meta, then the others)."""
    head = b'{"messages":%s,"labels":%s,"meta":{"category_id":' % (orjson.dumps(rec["messages"]),
                                                                    orjson.dumps(rec["labels"]))
    rest = {k: v for k, v in rec.items() if k not in ("messages", "labels", "meta")}
    tail = b"}," + orjson.dumps(rest)[1:] if rest else b"}}"
    extra = {k: v for k, v in rec["meta"].items() if k not in META_KEYS}  # a user function's, kept after ours
    return head, b"," + orjson.dumps(extra)[1:-1] + tail if extra else tail


def canonical_line(head: bytes, category_id: int, category: bytes, uid: int, source: bytes, tail: bytes) -> bytes:
    """A line of canonical.jsonl from `line_pieces` and the meta values (`category` and `source` as JSON)."""
    return b"".join((head, b"%d" % category_id, b',"category_name":', category, b',"uid":', b"%d" % uid,
                     b',"source":', source, tail, b"\n"))


def convert_to_part(task: ConvertTask) -> Converted:
    """Worker, first pass: the task's rows read and converted (`convert_row`); each kept record written to the
    task's part as `where, category, line_pieces` (JSON and numbers, which hold no tab, joined by tabs)."""
    n_lines, rows = task.read()
    done = Converted(n_lines, len(rows))
    limit = task.dropped_at_limit
    with open(task.part, "wb") as out:  # a scratch file (not synced): it lives until canonical.jsonl is written
        for where, row in rows:
            if isinstance(row, LineMemoryError):  # the run stops here: nothing after it matters
                done.out_of_memory = RowError(where, "line", row.detail, "out_of_memory")
                break
            try:
                if isinstance(row, RecordError):
                    raise row
                # the source names a range's row only for an error, whose source the driver makes from `where`
                converted = convert_row(row, task.spec, task.fmt, str(where), task.base_dir(where), task.image_roots)
                reason = None if converted is not None else "filtered_by_function"
            except RecordError as exc:
                reason = exc.reason
                done.first_error = done.first_error or RowError(where, exc.field, exc.message, exc.reason)
            if reason is not None:
                done.dropped[reason] = done.dropped.get(reason, 0) + 1
                sources = done.dropped_at.setdefault(reason, [])
                if limit is None or len(sources) < limit:
                    sources.append(where)
                continue
            rec, category = converted
            place = b"%d" % where if isinstance(where, int) else orjson.dumps(where)
            out.write(b"%s\t%s\t%s\t%s\n" % (place, orjson.dumps(category), *line_pieces(rec)))
            done.categories[category] = done.categories.get(category, 0) + 1
    return done


# ---------------------------------------------------------------------------------------------- second pass
@dataclasses.dataclass(frozen=True)
class FinishTask:
    """A first-pass part to write as canonical.jsonl lines (`out`): uids from `first_uid`, `category_ids` by
    name; `range_path`: the .jsonl input of a range's part (its places are line numbers within the range, after
    `lines_before` lines), None for a part whose places are sources."""
    part: str
    out: str
    first_uid: int
    category_ids: dict[str, int]
    range_path: str | None
    lines_before: int


@dataclasses.dataclass(frozen=True)
class FinishedPart:
    part: Part
    records: int


def finish_part(task: FinishTask) -> FinishedPart:
    """Worker, second pass: a part's canonical.jsonl lines (`canonical_line`), written to `task.out`."""
    ids = {orjson.dumps(name): cid for name, cid in task.category_ids.items()}
    in_range = task.range_path is not None
    source_head = orjson.dumps(f"{task.range_path}:")[:-1] if in_range else b""  # `"path:`, JSON-escaped
    uid = task.first_uid
    with open(task.part, "rb") as f, open(task.out, "wb") as out:  # a scratch file too
        for line in f:
            place, category, head, tail = line[:-1].split(b"\t")
            source = b'%s%d"' % (source_head, task.lines_before + int(place)) if in_range else place
            out.write(canonical_line(head, ids[category], category, uid, source, tail))
            uid += 1
    return FinishedPart(Part.written(task.out), uid - task.first_uid)


# ---------------------------------------------------------------------------------------------- tasks
class RowChunker:
    """The driver's reading of one input spec: `RowsTask`s of the rows of inputs that do not split (read here),
    and the detection of the spec's format from its first row (under skip: its first row of a detectable
    format). Rows dropped here (unreadable, or undetectable first rows) get the error policy here and are
    counted in `st` / `dropped` / `dropped_at`; the workers count the others. `fmt` / `spec` may be set from
    outside (an input whose format was found another way)."""

    def __init__(self, cfg: DataConfig, spec_index: int, st: dict, dropped: dict, dropped_at: DroppedAt,
                 part_paths: Iterator[str]):
        self.cfg, self.spec_index, self.spec, self.st = cfg, spec_index, cfg.inputs[spec_index], st
        self.dropped, self.dropped_at, self.part_paths = dropped, dropped_at, part_paths
        self.fmt: str | None = None
        self.chunk: list = []
        self.dirs: dict[str, str] = {}

    def count_dropped(self, exc: RecordError) -> None:
        """A row read here and dropped under skip."""
        self.st["in"] += 1
        count_input_drops(self.st, {exc.reason: 1}, exc.source, str(exc), self.dropped_at.order)
        self.dropped[exc.reason] = self.dropped.get(exc.reason, 0) + 1
        self.dropped_at.add(exc.reason, exc.source)

    def detect(self, row: Any, source: str) -> bool:
        """Whether `row` (a row or the RecordError that rejects it) gave the spec's format; under skip, a row
        that did not is counted as dropped."""
        try:
            if isinstance(row, RecordError):
                raise row
            self.fmt, self.spec = detect_format(row, self.spec, source)
        except RecordError as exc:
            if self.cfg.on_error != "skip":
                raise
            self.count_dropped(exc)
            return False
        self.st["format"] = self.fmt
        return True

    def detect_in_jsonl(self, path: str) -> tuple[int, int] | None:
        """The format from the first rows of a .jsonl input, read here as `io.iter_rows` reads them: (byte offset
        of the row that gave it, lines before it), or None when no row of the file does."""
        offset = 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                start, offset = offset, offset + len(line)
                if lineno == 1:
                    line = line.removeprefix(UTF8_BOM)
                if not line.strip():
                    continue
                source = f"{path}:{lineno}"
                if self.detect(parse_jsonl_line(line, source), source):
                    return start, lineno - 1
        return None

    def add_rows(self, path: str) -> Iterator[RowsTask]:
        """The rows of `path`, read here. A read error raised under on_error=error goes out after the rows
        before it (which may hold an earlier error)."""
        split, local = split_spec(path)
        base = local if split is not None else os.path.dirname(local)  # a datasets directory, or the file's
        try:
            for source, row in read_rows(path, self.cfg.on_error, on_skip=self.count_dropped):
                if self.fmt is None and not self.detect(row, source):
                    continue
                self.chunk.append((source, row))
                self.dirs[source] = base
                if len(self.chunk) >= CHUNK_ROWS:
                    yield from self.flush()
        except Exception:
            yield from self.flush()
            raise

    def flush(self) -> Iterator[RowsTask]:
        if self.chunk:
            yield RowsTask(self.spec_index, self.spec, self.fmt, next(self.part_paths), self.chunk, self.dirs,
                           image_roots=image_roots(self.cfg))
            self.chunk, self.dirs = [], {}


def _parquet_row_groups(path: str) -> list[int] | None:
    """Rows per row group of a readable .parquet file (its footer only); None for any other input, for a file
    pyarrow cannot open (read by the driver then, so that it fails as any input does) and for one with a row
    group over `MAX_ROW_GROUP_BYTES` (a worker holds a row group's rows at once)."""
    if not (path.lower().endswith(".parquet") and os.path.isfile(path)):
        return None
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as pf:
            groups = [pf.metadata.row_group(k) for k in range(pf.num_row_groups)]
    except (pa.ArrowException, OSError):
        return None
    if any(group.total_byte_size > MAX_ROW_GROUP_BYTES for group in groups):
        return None
    return [group.num_rows for group in groups]


def image_roots(cfg: DataConfig) -> tuple[str, ...]:
    """The config's `image_root` directories, symlinks resolved (what `media.resolve_media` compares with)."""
    return tuple(os.path.realpath(root) for root in cfg.image_root)


def convert_tasks(cfg: DataConfig, parts_dir: str | os.PathLike, stats: list[dict], dropped: dict,
                  dropped_at: DroppedAt) -> Iterator[ConvertTask]:
    """The first pass's tasks, inputs in order: the workers read the inputs that split cheaply, .jsonl by byte
    ranges (once the input's format is known: a set one, or detected here from its first rows) and .parquet by
    row groups (when the input's format is set: `auto` needs a row); the others (.json arrays, .csv, .arrow,
    datasets directories) are read here, in `RowsTask`s."""
    part_paths = (os.path.join(parts_dir, f"converted_{k:08d}.jsonl") for k in itertools.count())
    for spec_index in range(len(cfg.inputs)):
        st = stats[spec_index]
        rows = RowChunker(cfg, spec_index, st, dropped, dropped_at, part_paths)
        for path in expand_inputs(cfg.inputs[spec_index].path):
            split, local = split_spec(path)
            if split is None and local.lower().endswith(".jsonl") and os.path.isfile(local):
                start, lines_before = 0, 0
                if rows.fmt is None:
                    found = rows.detect_in_jsonl(path)
                    if found is None:
                        continue
                    start, lines_before = found
                yield from rows.flush()
                for k, byte_range in enumerate(byte_ranges(path, INPUT_RANGE_BYTES, start)):
                    yield JsonlRangeTask(spec_index, rows.spec, rows.fmt, next(part_paths), byte_range,
                                         lines_before if k == 0 else None, image_roots=image_roots(cfg))
                continue
            known = rows.fmt is not None or rows.spec.format != "auto"  # a set format needs no row to detect it
            row_groups = _parquet_row_groups(local) if split is None and known else None
            if row_groups is not None:
                rows.fmt = rows.fmt or rows.spec.format
                st["format"] = rows.fmt
                yield from rows.flush()
                first_row = 0
                for group, n_rows in enumerate(row_groups):
                    yield RowGroupTask(spec_index, rows.spec, rows.fmt, next(part_paths), path, group, first_row,
                                       image_roots=image_roots(cfg))
                    first_row += n_rows
                continue
            yield from rows.add_rows(path)
        yield from rows.flush()


def source_order(paths: list[str]) -> Callable[[str], tuple[int, int]]:
    """Sort key of a raw row's source in input order, for `DroppedAt`: (index of its input in `paths`, the
    expanded inputs; its line or row number, the integer that ends `path:line`, `path:row` and `path:key[row]`).
    The path is matched whole (paths and keys of .json objects may hold colons). Rows of a .json object of
    arrays sort by row number, then (`DroppedAt`'s tie-break) by key."""
    index: dict[str, int] = {}
    for i, path in enumerate(paths):
        index.setdefault(path, i)

    def order(source: str) -> tuple[int, int]:
        colon = source.find(":")
        while colon != -1 and source[:colon] not in index:
            colon = source.find(":", colon + 1)
        where = source[colon + 1:].removesuffix("]")
        digits = len(where) - len(where.rstrip("0123456789"))
        return index.get(source[:colon], len(paths)), int(where[len(where) - digits:] or -1)

    return order


# ---------------------------------------------------------------------------------------------- per input losses
FILTERED = "filtered_by_function"  # a drop the user asked for: not a loss


def count_input_drops(st: dict, reasons: dict[str, int], source: str | None, error: str | None,
                      order: Callable[[str], tuple]) -> None:
    """Add drops to an input's stats (`dropped`, `dropped_by_reason`); `error` (`source: field: message`) is kept as
    the input's first drop (`first_drop`) when `source` comes before the one kept (`order`: input order), so the
    same row is kept whatever order the drops are found in."""
    st["dropped"] += sum(reasons.values())
    for reason, n in reasons.items():
        st["dropped_by_reason"][reason] = st["dropped_by_reason"].get(reason, 0) + n
    kept = st["first_drop"]
    if error is not None and (kept is None or (order(source), source) < (order(kept[0]), kept[0])):
        st["first_drop"] = (source, error)


def _format_keys(spec: InputSpec, fmt: str) -> str:
    """The keys of `spec` that `fmt` reads its rows with (for a message about rows that lack them)."""
    keys = {"messages": ("messages_key",), "prompt_response": ("prompt_key", "response_key"),
            "verl": ("prompt_key", "response_key"), "function": ("function",)}.get(fmt, ())
    return ", ".join(f"{key} {getattr(spec, key)!r}" for key in keys)


def input_losses(cfg: DataConfig, stats: list[dict]) -> tuple[list[str], list[str]]:
    """(inputs that lost every row, inputs that lost more than `input_loss_warning` of them), as sentences naming
    the input, its format, the drop reasons and its first dropped row. Rows a user function filters out are not
    losses."""
    emptied, warnings = [], []
    for i, st in enumerate(stats):
        reasons = {r: n for r, n in sorted(st["dropped_by_reason"].items()) if r != FILTERED}
        lost = sum(reasons.values())
        rows = st["in"] - st["dropped_by_reason"].get(FILTERED, 0)
        if not lost:
            continue
        first = f"; the first: {st['first_drop'][1]}" if st["first_drop"] else ""
        what = f"inputs[{i}] ({', '.join(st['path'])}, format {st['format']})"
        counts = ", ".join(f"{reason} {n}" for reason, n in reasons.items())
        if not st["out"]:
            keys = _format_keys(cfg.inputs[i], st["format"])
            emptied.append(f"{what} lost all its {lost} rows ({counts}{first}): nothing of it would be trained. Check "
                           f"its format and keys{f' ({keys})' if keys else ''}, or remove it from inputs")
        elif lost > cfg.input_loss_warning * rows:
            warnings.append(f"{what} lost {lost} of its {rows} rows ({lost / rows:.0%}: {counts}{first}), more than "
                            f"input_loss_warning {cfg.input_loss_warning:g}")
    return emptied, warnings


# ---------------------------------------------------------------------------------------------- stage
def convert_all(cfg: DataConfig, executor: Executor, parts_dir: Path, stats: list[dict], dropped: dict,
                dropped_at: DroppedAt, category_ids: CategoryIds, sizes: dict[str, int]) -> list[FinishTask]:
    """The first pass: the workers convert the tasks (`convert_tasks`) and write the kept records as parts; the
    driver does the accounting in task order: line numbers (a range's lines follow those of the ranges before
    it, so sources and errors read `path:line`), under on_error=error the first error in input order, drop
    counts and sources, category ids in order of first appearance, each part's first uid. Returns the second
    pass's tasks."""
    in_flight: collections.deque[ConvertTask] = collections.deque()  # the tasks whose results are to come
    failed: list[Exception] = []

    def tasks() -> Iterator[ConvertTask]:
        """An error of the driver's own reading is raised after the results of the tasks before it."""
        try:
            for task in convert_tasks(cfg, parts_dir, stats, dropped, dropped_at):
                in_flight.append(task)
                yield task
        except Exception as exc:
            failed.append(exc)

    next_line: dict[str, int] = {}  # a .jsonl input's lines numbered so far
    parts: list[tuple[str, int, str | None, int]] = []  # (part, first uid, range path, lines before)
    uid = 0
    with progress(desc="preprocess", unit="rec") as bar:
        for done in executor.map(convert_to_part, tasks(), size="records"):
            task = in_flight.popleft()
            st = stats[task.spec_index]
            range_path, lines_before = None, 0
            if isinstance(task, JsonlRangeTask):
                range_path = task.range.path
                lines_before = next_line[range_path] if task.lines_before is None else task.lines_before
                next_line[range_path] = lines_before + done.lines
            error = done.first_error
            if error is not None and cfg.on_error != "skip":
                raise RecordError(task.source(error.where, lines_before), error.field, error.message, error.reason)
            if done.out_of_memory is not None:
                raise LineMemoryError(task.source(done.out_of_memory.where, lines_before), done.out_of_memory.message)
            st["in"] += done.rows
            source = None if error is None else task.source(error.where, lines_before)
            count_input_drops(st, done.dropped, source,
                              None if error is None else f"{source}: {error.field}: {error.message}", dropped_at.order)
            for reason, n in done.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + n
            for reason, places in done.dropped_at.items():
                for where in places:
                    dropped_at.add(reason, task.source(where, lines_before))
            for category, n in done.categories.items():
                category_ids(category)
                sizes[category] = sizes.get(category, 0) + n
            if done.kept:
                parts.append((task.part, uid, range_path, lines_before))
            st["out"] += done.kept
            uid += done.kept
            bar.update(done.rows)
    if failed:
        raise failed[0]
    return [FinishTask(part, part.removesuffix(".jsonl") + ".canonical.jsonl", first_uid, category_ids.ids,
                       range_path, lines_before) for part, first_uid, range_path, lines_before in parts]


def run(cfg: DataConfig, executor: Executor | None = None) -> dict:
    """Convert every input to canonical.jsonl, update the ratio file, record the `preprocess` report section.

    Two passes of the workers: they convert the inputs into parts of kept records (`convert_all`, with the
    driver's accounting), then write each part's canonical.jsonl lines with the uids and category ids the driver
    gave (`finish_part`), concatenated into canonical.jsonl in order (`Executor.concatenate`)."""
    executor = executor or LocalExecutor(cfg.workers)
    paths = [path for spec in cfg.inputs for path in expand_inputs(spec.path)]
    empty = [path for path in paths if input_is_empty(path)]
    if paths and len(empty) == len(paths):
        raise ConfigError(f"preprocess: every input is empty (no row): {', '.join(empty)}")
    ratio_path = cfg.ratio_file
    existing = read_ratio_file(ratio_path)
    category_ids = CategoryIds(existing)
    stats = [{"path": spec.path, "format": spec.format, "in": 0, "out": 0, "dropped": 0, "dropped_by_reason": {},
              "first_drop": None} for spec in cfg.inputs]
    dropped: dict[str, int] = {}
    dropped_at = DroppedAt(source_order(paths))
    sizes: dict[str, int] = {}
    with executor.scratch(Path(cfg.canonical_path).parent, "preprocess-parts") as parts_dir:
        finish = convert_all(cfg, executor, parts_dir, stats, dropped, dropped_at, category_ids, sizes)
        emptied, lossy = input_losses(cfg, stats)
        if emptied:  # before canonical.jsonl is replaced
            raise ConfigError(f"preprocess: {'; '.join(emptied)}")
        check_ratio_names(existing, sizes, ratio_path)  # before canonical.jsonl is replaced
        n_out = sum(st["out"] for st in stats)
        with progress(total=n_out, desc="preprocess: canonical lines", unit="rec") as bar:
            finished = executor.map(finish_part, finish, size="ranges")
            executor.concatenate(cfg.canonical_path, (bar.update(done.records) or done.part for done in finished))
    write_ratio_file(ratio_path, merge_ratio_categories(existing, category_ids.ids, sizes))
    for st in stats:
        st["dropped_by_reason"] = sorted_counts(st["dropped_by_reason"])
        st["first_drop"] = st["first_drop"] and st["first_drop"][1]
    section = {
        "in": sum(st["in"] for st in stats), "out": n_out, "dropped": sorted_counts(dropped),
        "dropped_at": dropped_at.section(), "inputs": stats,
        "category_sizes": {name: sizes[name] for name in sorted(sizes, key=category_ids)},
        "ratio_file": str(ratio_path), "output": str(cfg.canonical_path),
        "empty_inputs": empty, "warnings": [f"input {path} is empty (no row)" for path in empty] + lossy,
        "input_loss_warning": cfg.input_loss_warning,
    }
    check_arithmetic(section)
    update_report(cfg.report_path, "preprocess", section)
    return section


if __name__ == "__main__":
    from data.pipeline import cli_main

    cli_main(run, "preprocess")
