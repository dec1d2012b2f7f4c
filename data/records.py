"""The canonical record: validation, normalization and the error every stage raises for bad input.

A canonical record (see docs/ARCHITECTURE.md) is
`{"messages": [...], "labels": [0/1 per message], "meta": {...}, "tools"?, "enable_thinking"?, "structure"?,
"images"?, "videos"?, "audios"?, "audio_in_video"?}` (media: one path or data: URI per `<image>` / `<video>` /
`<audio>` placeholder of the user messages; `audio_in_video`: the videos whose sound track is in their token run;
data/media.py).
"""
from __future__ import annotations

from typing import Any

import orjson

from data.shards.errors import RecordError

ROLES = ("system", "user", "assistant", "tool")
RECORD_KEYS = ("messages", "labels", "meta", "tools", "enable_thinking", "structure", "images", "videos", "audios",
               "audio_in_video")
MEDIA_KINDS = {"image": "images", "video": "videos", "audio": "audios"}  # kind -> the record's list of them
# where an item of a kind's list goes in a user message (LLaMA-Factory's convention)
PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
# message keys written first, in this order; any other message key passes through after them (templates
# may read e.g. `name` or `tool_call_id`)
MESSAGE_KEY_ORDER = ("role", "content", "reasoning_content", "tool_calls", "category_id")
MAX_CATEGORY_ID = 32767  # category ids are stored per token as int16


def parse_json_field(value: Any, source: str, field: str, reason: str) -> Any:
    """A field that may hold JSON text (e.g. `tools` stored as a string): parsed, or a RecordError."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return None
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise RecordError(source, field, f"invalid JSON string: {exc}", reason) from None


def normalize_tools(tools: Any, source: str) -> list | None:
    """`tools`: a list (or its JSON string) of function specs; bare `{name, parameters}` specs are wrapped as
    `{"type": "function", "function": spec}`, the shape chat templates and transformers expect. Empty -> None."""
    tools = parse_json_field(tools, source, "tools", "bad_tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RecordError(source, "tools", f"expected a list of tool specs, got {type(tools).__name__}", "bad_tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RecordError(source, f"tools[{i}]", "expected an object", "bad_tools")
        if "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        out.append(tool)
    return out or None


def normalize_tool_calls(calls: Any, source: str, field: str) -> list:
    """`tool_calls` in OpenAI shape `{"type": "function", "function": {"name", "arguments"}}` (a bare
    `{"name", "arguments"}` is wrapped). `arguments` is kept as given (JSON string or object); the tokenize stage
    parses a JSON string under `tool_arguments: parse` (data/fidelity.py), as chat templates expect an object."""
    calls = parse_json_field(calls, source, field, "bad_tool_calls")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise RecordError(source, field, "expected a non-empty list of tool calls", "bad_tool_calls")
    out = []
    for i, call in enumerate(calls):
        where = f"{field}[{i}]"
        if not isinstance(call, dict):
            raise RecordError(source, where, "expected an object", "bad_tool_calls")
        if "function" in call:
            fn = call["function"]
            wrapped = dict(call)
        else:
            fn = {k: v for k, v in call.items() if k in ("name", "arguments")}
            wrapped = {k: v for k, v in call.items() if k not in ("name", "arguments")}
            wrapped = {"type": "function", "function": fn, **wrapped}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RecordError(source, where, "a tool call needs function.name (a string)", "bad_tool_calls")
        args = fn.get("arguments", {})
        if not isinstance(args, (str, dict)):
            raise RecordError(source, where, "arguments must be a JSON string or an object", "bad_tool_calls")
        wrapped.setdefault("type", "function")
        out.append(wrapped)
    return out


def _normalize_message(msg: Any, i: int, source: str) -> dict:
    field = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise RecordError(source, field, f"expected an object, got {type(msg).__name__}", "bad_message")
    role = msg.get("role")
    if role not in ROLES:
        raise RecordError(source, f"{field}.role", f"unknown role {role!r}; expected one of {list(ROLES)}",
                          "unknown_role")
    if role == "system" and i != 0:
        raise RecordError(source, f"{field}.role", "a system message is only allowed as the first message",
                          "system_not_first")
    out: dict = {"role": role}
    tool_calls = msg.get("tool_calls")
    if tool_calls == []:  # an empty list is how many exporters write "no tool call"
        tool_calls = None
    if tool_calls is not None:
        if role != "assistant":
            raise RecordError(source, f"{field}.tool_calls", f"tool_calls on a {role} message", "bad_tool_calls")
        tool_calls = normalize_tool_calls(tool_calls, source, f"{field}.tool_calls")
    content = msg.get("content")
    reasoning = msg.get("reasoning_content")
    if content is None and (tool_calls or reasoning is not None):
        content = ""
    if not isinstance(content, str):
        what = "missing" if content is None else f"a {type(content).__name__}, expected a string"
        raise RecordError(source, f"{field}.content", f"content is {what}", "bad_content")
    out["content"] = content
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RecordError(source, f"{field}.reasoning_content", "expected a string", "bad_content")
        out["reasoning_content"] = reasoning
    if tool_calls is not None:
        out["tool_calls"] = tool_calls
    if "category_id" in msg and msg["category_id"] is not None:
        cat = msg["category_id"]
        if isinstance(cat, bool) or not isinstance(cat, int) or not 0 <= cat <= MAX_CATEGORY_ID:
            raise RecordError(source, f"{field}.category_id", f"expected an integer in 0..{MAX_CATEGORY_ID} "
                              f"(stored as int16), got {cat!r}", "bad_category")
        out["category_id"] = cat
    for key, value in msg.items():
        if key not in MESSAGE_KEY_ORDER and value is not None:
            out[key] = value
    return out


def validate_canonical(record: Any, source: str) -> dict:
    """Check a record against the canonical contract and return its normalized form (new dict).

    Raises RecordError with reasons: bad_record, unknown_key, empty_conversation, bad_message, unknown_role,
    system_not_first, bad_content, bad_tool_calls, bad_tools, labels_length, bad_label, no_trainable_token,
    empty_assistant (a trained assistant message with no content, reasoning or tool call), bad_{kind},
    {kind}_placement, {kind}_count_mismatch (kind: image, video, audio), bad_audio_in_video.
    """
    if not isinstance(record, dict):
        raise RecordError(source, "record", f"expected an object, got {type(record).__name__}", "bad_record")
    unknown = sorted(set(record) - set(RECORD_KEYS))
    if unknown:
        raise RecordError(source, "record", f"unknown key(s) {unknown}; a canonical record has {list(RECORD_KEYS)}",
                          "unknown_key")
    messages = record.get("messages")
    if messages is None or (isinstance(messages, list) and not messages):
        raise RecordError(source, "messages", "empty conversation", "empty_conversation")
    if not isinstance(messages, list):
        raise RecordError(source, "messages", f"expected a list, got {type(messages).__name__}", "bad_record")
    norm_messages = [_normalize_message(m, i, source) for i, m in enumerate(messages)]

    labels = record.get("labels")
    if labels is None:
        labels = [1 if m["role"] == "assistant" else 0 for m in norm_messages]
    else:
        if not isinstance(labels, list) or len(labels) != len(norm_messages):
            n = len(labels) if isinstance(labels, list) else type(labels).__name__
            raise RecordError(source, "labels", f"{n} labels for {len(norm_messages)} messages", "labels_length")
        checked = []
        for i, (lab, msg) in enumerate(zip(labels, norm_messages)):
            if lab not in (0, 1) or (isinstance(lab, float)):
                raise RecordError(source, f"labels[{i}]", f"a label is 0 or 1, got {lab!r}", "bad_label")
            if lab and msg["role"] != "assistant":
                raise RecordError(source, f"labels[{i}]", f"label 1 on a {msg['role']} message; only assistant "
                                  "messages can be trained", "bad_label")
            checked.append(int(lab))
        labels = checked
    if not any(labels):
        raise RecordError(source, "labels", "no assistant message is trained (no trainable token)",
                          "no_trainable_token")
    for i, (lab, msg) in enumerate(zip(labels, norm_messages)):
        if lab and not msg["content"].strip() and not (msg.get("reasoning_content") or "").strip() \
                and not msg.get("tool_calls"):
            raise RecordError(source, f"messages[{i}]", "trained assistant message has no content, reasoning or "
                              "tool call (it would train only the end-of-turn marker)", "empty_assistant")

    meta = record.get("meta")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise RecordError(source, "meta", f"expected an object, got {type(meta).__name__}", "bad_record")
    out = {"messages": norm_messages, "labels": labels, "meta": dict(meta)}
    tools = normalize_tools(record.get("tools"), source)
    if tools is not None:
        out["tools"] = tools
    thinking = record.get("enable_thinking")
    if thinking is not None:
        if not isinstance(thinking, bool):
            raise RecordError(source, "enable_thinking", f"expected true/false, got {thinking!r}", "bad_record")
        out["enable_thinking"] = thinking
    if record.get("structure") is not None:
        out["structure"] = record["structure"]
    for kind, key in MEDIA_KINDS.items():
        if record.get(key) is not None:
            out[key] = check_media(kind, norm_messages, record[key], source)
    if record.get("audio_in_video") is not None:
        out["audio_in_video"] = check_audio_in_video(record["audio_in_video"], len(out.get("videos", ())), source)
    return out


def check_media(kind: str, messages: list[dict], items: Any, source: str) -> list[str]:
    """A kind's list of a canonical record (`images`, `videos`, `audios`): strings, one per placeholder of that
    kind, all of them in user messages (a placeholder elsewhere would put media tokens in a trained turn or a
    system prompt)."""
    key, placeholder = MEDIA_KINDS[kind], PLACEHOLDERS[kind]
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise RecordError(source, key, f"expected a list of {kind} paths", f"bad_{kind}")
    count = 0
    for i, msg in enumerate(messages):
        n = msg["content"].count(placeholder)
        if n and msg["role"] != "user":
            raise RecordError(source, f"messages[{i}].content", f"{placeholder} in a {msg['role']} message; "
                              f"{key} go in user messages", f"{kind}_placement")
        count += n
    if count != len(items):
        raise RecordError(source, key, f"{count} {placeholder} placeholders in the messages but "
                          f"{len(items)} {key}", f"{kind}_count_mismatch")
    return list(items)


def check_audio_in_video(indices: Any, n_videos: int, source: str) -> list[int]:
    """`audio_in_video`: increasing indices of the record's videos (those whose sound track is in their run)."""
    if (not isinstance(indices, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in indices)
            or indices != sorted(set(indices)) or any(not 0 <= j < n_videos for j in indices)):
        raise RecordError(source, "audio_in_video", f"expected increasing indices of the record's {n_videos} videos, "
                          f"got {indices!r}", "bad_audio_in_video")
    return list(indices)


def has_media(record: dict) -> bool:
    """Whether a record holds media (images, videos or audio)."""
    return any(record.get(key) for key in MEDIA_KINDS.values())


def message_category(record: dict, i: int) -> int:
    """Category of message i: its own `category_id` (merged records) or the record's `meta.category_id`."""
    cat = record["messages"][i].get("category_id")
    return cat if cat is not None else record.get("meta", {}).get("category_id", 0)


def record_uids(record: dict) -> list[int]:
    """The original uids a record came from (`meta.uids` for merged records, else `[meta.uid]`)."""
    meta = record.get("meta", {})
    if "uids" in meta:
        return list(meta["uids"])
    return [meta["uid"]] if "uid" in meta else []
