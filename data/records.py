"""The canonical record: validation, normalization and the error every stage raises for bad input.

A canonical record (see docs/ARCHITECTURE.md) is
`{"messages": [...], "labels": [0/1 per message], "meta": {...}, "tools"?, "enable_thinking"?, "structure"?,
"images"?}` (images: one path or data: URI per `<image>` placeholder of the user messages, data/images.py).
"""
from __future__ import annotations

from typing import Any

import orjson

ROLES = ("system", "user", "assistant", "tool")
RECORD_KEYS = ("messages", "labels", "meta", "tools", "enable_thinking", "structure", "images")
IMAGE_PLACEHOLDER = "<image>"  # where an image of `images` goes in a user message (LLaMA-Factory's convention)
# message keys written first, in this order; any other message key passes through after them (templates
# may read e.g. `name` or `tool_call_id`)
MESSAGE_KEY_ORDER = ("role", "content", "reasoning_content", "tool_calls", "category_id")
MAX_CATEGORY_ID = 32767  # category ids are stored per token as int16


class RecordError(ValueError):
    """Bad input in one record: `str()` is `path:line: field: message`; `.reason` keys the skip counts."""

    def __init__(self, source: str, field: str, message: str, reason: str = "invalid_record"):
        super().__init__(source, field, message, reason)
        self.source = source
        self.field = field
        self.message = message
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.source}: {self.field}: {self.message}"


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
    empty_assistant (a trained assistant message with no content, reasoning or tool call), bad_image,
    image_placement, image_count_mismatch.
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
    if record.get("images") is not None:
        out["images"] = check_images(norm_messages, record["images"], source)
    return out


def check_images(messages: list[dict], images: Any, source: str) -> list[str]:
    """The `images` of a canonical record: a list of strings, one per `<image>` placeholder, all of them in user
    messages (a placeholder elsewhere would put image tokens in a trained turn or a system prompt)."""
    if not isinstance(images, list) or not all(isinstance(x, str) and x for x in images):
        raise RecordError(source, "images", "expected a list of image paths", "bad_image")
    count = 0
    for i, msg in enumerate(messages):
        n = msg["content"].count(IMAGE_PLACEHOLDER)
        if n and msg["role"] != "user":
            raise RecordError(source, f"messages[{i}].content", f"{IMAGE_PLACEHOLDER} in a {msg['role']} message; "
                              "images go in user messages", "image_placement")
        count += n
    if count != len(images):
        raise RecordError(source, "images", f"{count} {IMAGE_PLACEHOLDER} placeholders in the messages but "
                          f"{len(images)} images", "image_count_mismatch")
    return list(images)


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
