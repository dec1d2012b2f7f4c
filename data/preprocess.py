"""Stage 1: raw inputs -> canonical.jsonl, plus the ratio file the user edits to weight categories.

Formats (InputSpec.format, `auto` detects from the first row's keys):
- messages: OpenAI-style `messages` (content may be a list of parts: text / reasoning / tool_call, as in
  LLaMA-Factory's reasoning-tool-use data), optional `labels`, `tools`, `enable_thinking`, `structure`.
- sharegpt: `conversations` of {from, value}; from in human/user, gpt/assistant, system, function_call
  (an assistant tool call), observation/tool/function (a tool result); optional top-level `system`, `tools`.
- prompt_response: `prompt_key` (a string or a message list) and `response_key` columns (e.g. GSM8K
  question/answer); `InputSpec.system` is prepended when the prompt has no system message.
- verl: verl SFT parquet, `prompt` message list + `response_key` column, or `output` when there is none.
- function: `file.py:function` maps one raw row to a canonical record (None filters the row out, counted
  as `filtered_by_function`; an exception is a `function_error` for that row). It may set
  `meta.category_name`; other `meta` keys are kept.

Records get `meta = {category_id, category_name, uid, source}`; uids are sequential over the output. The category
is InputSpec.category_name, else the raw field InputSpec.category_field, else `untracked` (id 0). Category ids
come from the ratio file; new categories get the next free id, in order of first appearance.
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from data.config import ConfigError, DataConfig, InputSpec, closest_key_hint
from data.fsutil import atomic_write_bytes, atomic_writer
from data.io import expand_inputs, input_is_empty, ordered_parallel_map, read_rows
from data.progress import progress
from data.records import MAX_CATEGORY_ID, RecordError, parse_json_field, validate_canonical

from data.report import DroppedAt, check_arithmetic, sorted_counts, update_report

MAX_SAMPLE_RATE = 1000  # a larger rate is a typo (1e15 copies would exhaust memory), not a weighting
RATIO_FILE_KEYS = ("categories",)
RATIO_ENTRY_KEYS = ("category_id", "category_name", "size", "sample_rate")

CHUNK_ROWS = 256
UNTRACKED = "untracked"  # category 0
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


def _flatten_parts(msg: dict, source: str, field: str) -> dict:
    """A message whose content is a list of parts -> plain content, reasoning_content and tool_calls."""
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
        else:
            raise RecordError(source, where, f"unsupported content part type {kind!r} (text, reasoning, "
                              "tool_call)", "bad_content")
    out = {k: v for k, v in msg.items() if k != "content"}
    out["content"] = "".join(text)
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = list(msg.get("tool_calls") or []) + calls
    return out


def _message_list(messages: Any, source: str, field: str) -> list[dict]:
    if not isinstance(messages, list):
        raise RecordError(source, field, f"expected a list of messages, got {type(messages).__name__}",
                          "bad_record")
    return [_flatten_parts(m, source, f"{field}[{i}]") if isinstance(m, dict) else m
            for i, m in enumerate(messages)]


def _passthrough(raw: dict, rec: dict, spec: InputSpec) -> dict:
    tools = raw.get(spec.tools_key)
    if tools is not None:
        rec["tools"] = tools
    for key in ("enable_thinking", "structure"):
        if raw.get(key) is not None:
            rec[key] = raw[key]
    return rec


def convert_messages(raw: dict, spec: InputSpec, source: str) -> dict:
    rec = {"messages": _message_list(_required(raw, spec.messages_key, source), source, spec.messages_key)}
    if raw.get("labels") is not None:
        rec["labels"] = raw["labels"]
    return _passthrough(raw, rec, spec)


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
    return _passthrough(raw, {"messages": messages}, spec)


def _prompt_response(raw: dict, spec: InputSpec, source: str, prompt_key: str, response_key: str) -> dict:
    prompt = _required(raw, prompt_key, source)
    response = _required(raw, response_key, source)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = _message_list(prompt, source, prompt_key)
    if spec.system and not (messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": spec.system})
    if not isinstance(response, str):
        raise RecordError(source, response_key, f"expected a string, got {type(response).__name__}",
                          "bad_content")
    messages.append({"role": "assistant", "content": response})
    return _passthrough(raw, {"messages": messages}, spec)


def convert_prompt_response(raw: dict, spec: InputSpec, source: str) -> dict:
    return _prompt_response(raw, spec, source, spec.prompt_key, spec.response_key)


def convert_verl(raw: dict, spec: InputSpec, source: str) -> dict:
    response_key = spec.response_key if spec.response_key in raw else "output"
    return _prompt_response(raw, spec, source, spec.prompt_key, response_key)


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
    "verl": convert_verl, "function": convert_function,
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
    for prompt_key, response_key in KNOWN_PAIRS:
        if prompt_key in keys and response_key in keys:
            return "prompt_response", InputSpec(**{**vars(spec), "prompt_key": prompt_key,
                                                   "response_key": response_key})
    raise RecordError(source, "format", f"cannot detect the format from keys {sorted(keys)}; set format "
                      f"(messages, sharegpt, prompt_response, verl, function)", "unknown_format")


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


def convert_row(raw: dict, spec: InputSpec, fmt: str, source: str) -> tuple[dict, str] | None:
    """One raw row -> (validated canonical record, category name); None when a user function filters it."""
    rec = CONVERTERS[fmt](raw, spec, source)
    if rec is None:
        return None
    canonical = validate_canonical(rec, source)
    return canonical, category_of(raw, canonical, spec, source)


# ---------------------------------------------------------------------------------------------- workers
def convert_chunk(task: tuple[int, InputSpec, str, list]) -> tuple[int, list[tuple]]:
    """Worker (local pool or Ray): convert a chunk of rows of input `spec_index` (`convert_row`); returns
    (spec_index, per row ("ok", source, record, category), ("err", source, field, message, reason) or
    ("filtered", source))."""
    spec_index, spec, fmt, rows = task
    out = []
    for source, raw in rows:
        try:
            result = convert_row(raw, spec, fmt, source)
        except RecordError as exc:
            out.append(("err", source, exc.field, exc.message, exc.reason))
            continue
        if result is None:
            out.append(("filtered", source))
        else:
            out.append(("ok", source, result[0], result[1]))
    return spec_index, out


# ---------------------------------------------------------------------------------------------- ratio file
def _check_known_keys(obj: dict, known: tuple[str, ...], where: str) -> None:
    """A key the ratio file does not define is a typo (`sample_rat`) that would silently run at the default and
    vanish on the next rewrite: an error naming the closest key."""
    for key in obj:
        if key not in known:
            raise ValueError(f"{where}: unknown key {key!r}{closest_key_hint(key, known)} (known: {list(known)})")


def read_ratio_file(path: str | Path) -> list[dict]:
    """The ratio JSON `{"categories": [{category_id, category_name, size, sample_rate}]}`; [] if absent.
    Ids and names must be unique; id 0 is reserved for `untracked`; no other key is allowed (a typo is an error,
    so that the rewrite of the file never drops what the user wrote)."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return []
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from None
    if isinstance(data, dict):
        _check_known_keys(data, RATIO_FILE_KEYS, str(path))
    cats = data.get("categories") if isinstance(data, dict) else None
    if not isinstance(cats, list):
        raise ValueError(f"{path}: expected {{\"categories\": [...]}}")
    seen_ids, seen_names = set(), set()
    for i, cat in enumerate(cats):
        where = f"{path}: categories[{i}]"
        if isinstance(cat, dict):
            name = cat.get("category_name")
            _check_known_keys(cat, RATIO_ENTRY_KEYS,
                              f"{path}: entry {name!r} (categories[{i}])" if isinstance(name, str) else where)
        if not isinstance(cat, dict) or not isinstance(cat.get("category_name"), str):
            raise ValueError(f"{where}: needs category_name (a string)")
        cid = cat.get("category_id")
        if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid <= MAX_CATEGORY_ID:
            raise ValueError(f"{where}: category_id must be an integer in 0..{MAX_CATEGORY_ID} (stored as int16), "
                             f"got {cid!r}")
        if (cid == 0) != (cat["category_name"] == UNTRACKED):
            raise ValueError(f"{where}: category_id 0 is reserved for {UNTRACKED!r}")
        if cid in seen_ids or cat["category_name"] in seen_names:
            raise ValueError(f"{where}: duplicate category id {cid} or name {cat['category_name']!r}")
        rate = cat.get("sample_rate", 1.0)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= MAX_SAMPLE_RATE:
            raise ValueError(f"{where} ({cat['category_name']!r}): sample_rate must be a number in 0..{MAX_SAMPLE_RATE} "
                             f"(copies of each record), got {rate!r}")
        seen_ids.add(cid)
        seen_names.add(cat["category_name"])
    return cats


def check_ratio_names(ratio_cats: list[dict], data_names: Iterable[str], ratio_path: str | Path) -> None:
    """Every entry of the ratio file must name a category of the data (matched by name, never by id): an entry
    that matches nothing is a renamed or removed category whose rate would silently apply to nothing.
    `untracked` (id 0, managed by the pipeline) may be absent from the data."""
    names = set(data_names)
    orphans = [c for c in ratio_cats if c["category_name"] not in names and c["category_name"] != UNTRACKED]
    if orphans:
        listed = ", ".join(f"{c['category_name']!r} (id {c['category_id']}, sample_rate {c.get('sample_rate', 1.0)})"
                           for c in orphans)
        one = len(orphans) == 1
        raise ValueError(f"{ratio_path}: {'entry' if one else 'entries'} {listed} {'matches' if one else 'match'} no "
                         f"category of the data (categories: {sorted(names)}); categories are matched by name: put back the data's "
                         "name if you renamed one, delete the entry if the category is gone")


def merge_ratio_categories(existing: list[dict], ids: dict[str, int], sizes: dict[str, int]) -> list[dict]:
    """Refresh sizes; keep every existing id and sample_rate; new categories (already given ids) get rate 1.0.
    Categories absent from this data keep their entry with size 0. Sorted by id."""
    by_name = {c["category_name"]: dict(c) for c in existing}
    for name, cid in ids.items():
        if name not in by_name:
            by_name[name] = {"category_id": cid, "category_name": name, "size": 0, "sample_rate": 1.0}
    out = []
    for cat in sorted(by_name.values(), key=lambda c: c["category_id"]):
        cat["size"] = sizes.get(cat["category_name"], 0)
        cat.setdefault("sample_rate", 1.0)
        out.append({"category_id": cat["category_id"], "category_name": cat["category_name"],
                    "size": cat["size"], "sample_rate": cat["sample_rate"]})
    return out


def write_ratio_file(path: str | Path, categories: list[dict]) -> None:
    atomic_write_bytes(path, orjson.dumps({"categories": categories}, option=orjson.OPT_INDENT_2) + b"\n")


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


# ---------------------------------------------------------------------------------------------- stage
class RowChunker:
    """Chunks of raw rows of one input spec, read in this process, its format detected from its first row (under
    skip: its first row of a detectable format). Unreadable rows and undetectable first rows get the error policy
    here and are counted in `st` / `dropped` / `dropped_at`; kept rows are counted in `st["in"]` here when
    `count_kept` (the Ray engine counts them from its workers' results instead). `fmt` / `spec` may be set from
    outside (an input whose format was found another way); `add_rows(path)` and `flush()` yield
    `(spec, fmt, chunk)`."""

    def __init__(self, cfg: DataConfig, spec: InputSpec, st: dict, dropped: dict, dropped_at: DroppedAt,
                 count_kept: bool = True):
        self.cfg, self.spec, self.st, self.count_kept = cfg, spec, st, count_kept
        self.dropped, self.dropped_at = dropped, dropped_at
        self.fmt: str | None = None
        self.chunk: list = []

    def count_dropped(self, exc: RecordError) -> None:
        """A row read here and dropped under skip."""
        self.st["in"] += 1
        self.st["dropped"] += 1
        self.dropped[exc.reason] = self.dropped.get(exc.reason, 0) + 1
        self.dropped_at.add(exc.reason, exc.source)

    def add_rows(self, path: str) -> Iterator[tuple[InputSpec, str, list]]:
        for source, row in read_rows(path, self.cfg.on_error, on_skip=self.count_dropped):
            if self.fmt is None:
                try:
                    self.fmt, self.spec = detect_format(row, self.spec, source)
                except RecordError as exc:  # under skip: count the row, detect again on the next one
                    if self.cfg.on_error != "skip":
                        raise
                    self.count_dropped(exc)
                    continue
                self.st["format"] = self.fmt
            self.st["in"] += self.count_kept
            self.chunk.append((source, row))
            if len(self.chunk) >= CHUNK_ROWS:
                yield from self.flush()

    def flush(self) -> Iterator[tuple[InputSpec, str, list]]:
        if self.chunk:
            yield self.spec, self.fmt, self.chunk
            self.chunk = []


def _tasks(cfg: DataConfig, stats: list[dict], dropped: dict, dropped_at: DroppedAt):
    """Chunks of raw rows for the workers, inputs in order (`RowChunker`)."""
    for spec_index, spec in enumerate(cfg.inputs):
        chunker = RowChunker(cfg, spec, stats[spec_index], dropped, dropped_at)
        for path in expand_inputs(spec.path):
            for chunk_spec, fmt, chunk in chunker.add_rows(path):
                yield (spec_index, chunk_spec, fmt, chunk)
        for chunk_spec, fmt, chunk in chunker.flush():
            yield (spec_index, chunk_spec, fmt, chunk)


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


def canonical_line(rec: dict, category: str, category_id: int, uid: int, source: str) -> bytes:
    """A converted record's line of canonical.jsonl: its meta set here (user-function keys kept after ours)."""
    extra = {k: v for k, v in rec["meta"].items() if k not in META_KEYS}
    rec["meta"] = {"category_id": category_id, "category_name": category, "uid": uid, "source": source, **extra}
    return orjson.dumps(rec) + b"\n"


def run(cfg: DataConfig, parallel_map: Callable[[Callable, Iterable], Iterator] | None = None,
        convert_all: Callable[..., int] | None = None, executor=None) -> dict:
    """Convert every input to canonical.jsonl, update the ratio file, record the `preprocess` report section.

    `parallel_map(fn, chunks)` yields `fn(chunk)` in chunk order (default: `ordered_parallel_map` over
    `num_workers` local processes). `convert_all(cfg, stats, dropped, dropped_at, category_ids, sizes, out, bar)`
    replaces reading, converting and writing (the Ray engine's workers do all three): it writes canonical.jsonl's
    lines to `out` in input order, does this loop's accounting and returns the records written."""
    paths = [path for spec in cfg.inputs for path in expand_inputs(spec.path)]
    empty = [path for path in paths if input_is_empty(path)]
    if paths and len(empty) == len(paths):
        raise ConfigError(f"preprocess: every input is empty (no row): {', '.join(empty)}")
    ratio_path = cfg.ratio_file
    existing = read_ratio_file(ratio_path)
    category_ids = CategoryIds(existing)
    stats = [{"path": spec.path, "format": spec.format, "in": 0, "out": 0, "dropped": 0} for spec in cfg.inputs]
    dropped: dict[str, int] = {}
    dropped_at = DroppedAt(source_order(paths))
    sizes: dict[str, int] = {}
    uid = 0
    with atomic_writer(cfg.canonical_path) as out, progress(desc="preprocess", unit="rec") as bar:
        if convert_all is not None:
            uid = convert_all(cfg, stats, dropped, dropped_at, category_ids, sizes, out, bar)
        else:
            tasks = _tasks(cfg, stats, dropped, dropped_at)
            results_in_order = (parallel_map(convert_chunk, tasks) if parallel_map is not None
                                else ordered_parallel_map(convert_chunk, tasks, cfg.workers))
            for spec_index, results in results_in_order:
                st = stats[spec_index]
                for result in results:
                    kind, source = result[0], result[1]
                    if kind == "ok":
                        rec, category = result[2], result[3]
                        out.write(canonical_line(rec, category, category_ids(category), uid, source))
                        sizes[category] = sizes.get(category, 0) + 1
                        st["out"] += 1
                        uid += 1
                        continue
                    if kind == "filtered":
                        reason = "filtered_by_function"
                    else:
                        _, source, field, message, reason = result
                        if cfg.on_error != "skip":
                            raise RecordError(source, field, message, reason)
                    st["dropped"] += 1
                    dropped[reason] = dropped.get(reason, 0) + 1
                    dropped_at.add(reason, source)
                bar.update(len(results))
        check_ratio_names(existing, sizes, ratio_path)  # before canonical.jsonl is replaced
    write_ratio_file(ratio_path, merge_ratio_categories(existing, category_ids.ids, sizes))
    section = {
        "in": sum(st["in"] for st in stats), "out": uid, "dropped": sorted_counts(dropped),
        "dropped_at": dropped_at.section(), "inputs": stats,
        "category_sizes": {name: sizes[name] for name in sorted(sizes, key=category_ids)},
        "ratio_file": str(ratio_path), "output": str(cfg.canonical_path),
        "empty_inputs": empty, "warnings": [f"input {path} is empty (no row)" for path in empty],
    }
    check_arithmetic(section)
    update_report(cfg.report_path, "preprocess", section)
    return section


if __name__ == "__main__":
    from data.pipeline import cli_main

    cli_main(run, "preprocess")
