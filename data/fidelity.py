"""What a record asks to train reaches the loss: render preparation, the conservation check, merged records.

A canonical record is rendered by `render_record` (one chat-template render in the common case):

1. preparation of the messages given to the template: JSON-string tool-call `arguments` parsed to objects
   (`tool_arguments: parse`), and the `reasoning_content` of every TRAINED assistant message handled by the
   `reasoning` policy: `drop` removes it; `auto` inlines it into the content as
   `open + reasoning.strip("\\n") + close + content.lstrip("\\n")` (the shape Qwen3 renders natively) when the
   template never renders reasoning; a turn whose reasoning the template still strips because it is not the
   last turn (Qwen3 before the last user query) gets its text from a render of the conversation up to that
   turn; `template` and `error` keep the reasoning as given;
2. the conservation check: inside the trained span of every labelled assistant message its content, its
   reasoning (unless dropped) and every tool call (name and arguments, as JSON) must appear, and every tool
   message must appear in the render. A missing piece is a RecordError (`template_drops_content`,
   `template_drops_tools`, `reasoning_not_rendered` under `reasoning: error`) or, for reasoning under
   `reasoning: template`, a counted loss of a kept record.

A merged record (`meta.parts`, written by data/merge.py) is rendered as one conversation, and then every
assistant turn's text (header excluded, end-of-turn included) is replaced by that turn's text in its original
record rendered alone (`render_merged`): each original trains exactly the tokens it trains alone, whatever
the template does to earlier turns (Qwen3 strips their `<think>` blocks, and writes an empty one only in the
last turn). The context of a turn is therefore: system prompt, tools, user and tool messages as the template
renders the merged conversation, and every earlier assistant turn as it was rendered in its own record.

Everything here is pure (text in, text out) and returns plain values, so any engine can run it per record.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from common.config import ConfigError
from data.chat_template import SpanError, TemplateInfo, assistant_spans, template_error
from data.config import DEFAULT_REASONING_TAGS
from data.media import with_media_parts
from data.records import RecordError, has_media

REASONING_POLICIES = ("auto", "template", "drop", "error")
TOOL_ARGUMENT_POLICIES = ("parse", "keep")
PROBE_REASONING = "PackSFT probe reasoning 7"
# per-record counters (plain ints; summed into report.json's tokenize section)
STAT_KEYS = ("trained_messages", "trained_chars", "content_chars", "reasoning_messages", "reasoning_chars",
             "reasoning_by_template", "reasoning_inlined", "reasoning_not_rendered", "reasoning_dropped",
             "reasoning_by_template_chars", "reasoning_inlined_chars", "reasoning_not_rendered_chars",
             "reasoning_dropped_chars", "tool_calls", "tool_call_chars", "tool_arguments_parsed")


@dataclass(frozen=True)
class FidelityOptions:
    reasoning: str = "auto"
    reasoning_tags: tuple[str, str] = DEFAULT_REASONING_TAGS
    tool_arguments: str = "parse"
    enable_thinking: bool | None = None  # default for records without their own

    def __post_init__(self):
        if self.reasoning not in REASONING_POLICIES:
            raise ConfigError(f"reasoning must be one of {REASONING_POLICIES}, got {self.reasoning!r}")
        if self.tool_arguments not in TOOL_ARGUMENT_POLICIES:
            raise ConfigError(f"tool_arguments must be one of {TOOL_ARGUMENT_POLICIES}, got {self.tool_arguments!r}")
        if len(self.reasoning_tags) != 2 or not all(self.reasoning_tags):
            raise ConfigError(f"reasoning_tags must be two non-empty strings, got {self.reasoning_tags!r}")

    @classmethod
    def from_config(cls, cfg) -> "FidelityOptions":
        return cls(reasoning=cfg.reasoning, reasoning_tags=tuple(cfg.reasoning_tags),
                   tool_arguments=cfg.tool_arguments, enable_thinking=cfg.enable_thinking)


@dataclass
class Rendered:
    """One record's render: the text, the character span of every assistant message (header excluded,
    end-of-turn included), and the per-record counters of STAT_KEYS."""

    text: str
    spans: list[tuple[int, int]]
    stats: dict[str, int] = field(default_factory=dict)


def template_renders_reasoning(tokenizer) -> bool:
    """Whether the template renders `reasoning_content` of a final assistant turn (probe render)."""
    probe = [{"role": "user", "content": "PackSFT probe question 1"},
             {"role": "assistant", "content": "PackSFT probe answer 2", "reasoning_content": PROBE_REASONING}]
    try:
        return PROBE_REASONING in tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that rejects the key renders nothing of it
        return False


def _call_arguments(call: dict) -> Any:
    return call.get("function", {}).get("arguments", {})


def _tool_call_chars(call: dict) -> int:
    args = _call_arguments(call)
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return len(call["function"]["name"]) + len(text)


def squash(text: str) -> str:
    """Text without whitespace: the conservation check compares modulo whitespace, which templates trim or
    reformat (Llama 3.1 trims content, Qwen3 rewrites the newlines around <think>, `tojson` separators)."""
    return "".join(text.split())


def _arguments_in(squashed_body: str, args: Any) -> bool:
    """The arguments appear in the render as JSON (`tojson`, i.e. `json.dumps`, with any separators); a kept
    string as given or as `tojson` writes it (double-encoded)."""
    if isinstance(args, str):
        forms = (args, json.dumps(args, ensure_ascii=False))
    else:
        forms = (json.dumps(args, ensure_ascii=False), json.dumps(args, ensure_ascii=True))
    return any(squash(f) in squashed_body for f in forms)


def parse_tool_arguments(messages: list[dict], source: str, index_map: list[int], stats: dict) -> list[dict]:
    """Tool calls whose `arguments` is a JSON string get the parsed object (new dicts; input unchanged)."""
    out = []
    for local, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if not calls or not any(isinstance(_call_arguments(c), str) for c in calls):
            out.append(msg)
            continue
        new_calls = []
        for j, call in enumerate(calls):
            args = _call_arguments(call)
            if isinstance(args, str):
                where = f"messages[{index_map[local]}].tool_calls[{j}].function.arguments"
                try:
                    parsed = orjson.loads(args)
                except orjson.JSONDecodeError as exc:
                    raise RecordError(source, where, f"invalid JSON ({exc}): {args[:80]!r}",
                                      "bad_tool_arguments") from None
                if not isinstance(parsed, dict):
                    raise RecordError(source, where, f"expected a JSON object, got {type(parsed).__name__}: "
                                      f"{args[:80]!r}", "bad_tool_arguments")
                call = {**call, "function": {**call["function"], "arguments": parsed}}
                stats["tool_arguments_parsed"] += 1
            new_calls.append(call)
        out.append({**msg, "tool_calls": new_calls})
    return out


def _inline(msg: dict, tags: tuple[str, str]) -> dict:
    out = {k: v for k, v in msg.items() if k != "reasoning_content"}
    out["content"] = tags[0] + msg["reasoning_content"].strip("\n") + tags[1] + msg["content"].lstrip("\n")
    return out


def _has_reasoning(msg: dict) -> bool:
    return bool((msg.get("reasoning_content") or "").strip())


def _empty(msg: dict) -> bool:
    return not msg["content"].strip() and not _has_reasoning(msg) and not msg.get("tool_calls")


def _template_kwargs(record: dict, opts: FidelityOptions) -> dict:
    kwargs: dict[str, Any] = {}
    if record.get("tools"):
        kwargs["tools"] = record["tools"]
    thinking = record.get("enable_thinking", opts.enable_thinking)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    return kwargs


def _render(tokenizer, messages: list[dict], kwargs: dict, source: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # jinja raise_exception / TemplateError: the template rejects this conversation
        raise RecordError(source, "messages", f"chat template failed: {template_error(exc)}",
                          "template_error") from None


def _spans(text: str, info: TemplateInfo, n: int, source: str) -> list[tuple[int, int]]:
    try:
        return assistant_spans(text, info, n)
    except SpanError as exc:
        raise RecordError(source, "messages", str(exc), "template_mismatch") from None


def render_record(tokenizer, info: TemplateInfo, record: dict, opts: FidelityOptions, renders_reasoning: bool,
                  source: str, index_map: list[int] | None = None) -> Rendered:
    """Render one normalized (validated) record, apply the policies and check conservation; RecordError when
    the record cannot be trained as asked (see the module docstring). `index_map` maps message positions to
    the ones named in errors (a part of a merged record names its position in the merged record)."""
    messages = [{k: v for k, v in m.items() if k != "category_id"} for m in record["messages"]]
    if has_media(record):  # placeholders -> the template's media parts (user messages only: validated)
        messages = with_media_parts(messages, record)
    labels = record["labels"]
    index_map = index_map if index_map is not None else list(range(len(messages)))
    stats = dict.fromkeys(STAT_KEYS, 0)
    if opts.tool_arguments == "parse":
        messages = parse_tool_arguments(messages, source, index_map, stats)
    trained = [i for i, m in enumerate(messages) if labels[i] and m["role"] == "assistant"]
    asked = {i: messages[i] for i in trained}  # before the reasoning policy: what the conservation check wants
    reasoning_of = {i: messages[i]["reasoning_content"] for i in trained if _has_reasoning(messages[i])}
    inlined: set[int] = set()
    for i in trained:
        if i in reasoning_of and opts.reasoning == "drop":
            messages[i] = {k: v for k, v in messages[i].items() if k != "reasoning_content"}
            stats["reasoning_dropped"] += 1
            stats["reasoning_dropped_chars"] += len(reasoning_of[i])
        elif i in reasoning_of and opts.reasoning == "auto" and not renders_reasoning:
            messages[i] = _inline(messages[i], opts.reasoning_tags)
            inlined.add(i)
        if _empty(messages[i]):
            raise RecordError(source, f"messages[{index_map[i]}]", "trained assistant message has no content, "
                              "reasoning or tool call (it would train only the end-of-turn marker)",
                              "empty_assistant")
    kwargs = _template_kwargs(record, opts)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    text = _render(tokenizer, messages, kwargs, source)
    spans = _spans(text, info, len(assistant), source)
    if opts.reasoning == "auto":
        # a template may strip reasoning from turns that are not the last one (Qwen3 before the last user
        # query, natively or as <think> in the content): such a turn is rendered as the last turn of its
        # prefix, one more render per turn, and its text replaces the stripped one
        trained_set = set(trained)
        last_turn_bodies = {}
        for j, i in enumerate(assistant):
            body = squash(text[slice(*spans[j])])
            if i in trained_set and ((i in reasoning_of and squash(reasoning_of[i]) not in body)
                                     or squash(messages[i]["content"]) not in body):
                prefix = _render(tokenizer, messages[: i + 1], kwargs, source)
                a, b = _spans(prefix, info, j + 1, source)[j]
                last_turn_bodies[j] = prefix[a:b]
        if last_turn_bodies:
            text, spans = splice(text, spans, last_turn_bodies)
    span_of = dict(zip(assistant, spans))
    for i in trained:
        _check_turn(squash(text[slice(*span_of[i])]), asked[i], reasoning_of.get(i), i in inlined, opts, stats,
                    source, f"messages[{index_map[i]}]")
    stats["trained_chars"] = stats["content_chars"] + stats["reasoning_chars"] + stats["tool_call_chars"]
    squashed_text = None
    for i, msg in enumerate(messages):
        if msg["role"] != "tool" or not msg["content"].strip():
            continue
        squashed_text = squashed_text if squashed_text is not None else squash(text)
        if squash(msg["content"]) not in squashed_text \
                and squash(json.dumps(msg["content"], ensure_ascii=False)) not in squashed_text:
            raise RecordError(source, f"messages[{index_map[i]}]", "the chat template does not render tool "
                              "messages", "template_drops_tools")
    return Rendered(text=text, spans=spans, stats=stats)


def _check_turn(body: str, msg: dict, reasoning: str | None, inlined: bool, opts: FidelityOptions,
                stats: dict, source: str, field_name: str) -> None:
    """The conservation check of one trained assistant turn (`body`: its rendered span, squashed)."""
    content = msg["content"]
    stats["trained_messages"] += 1
    stats["content_chars"] += len(content)
    if content.strip() and squash(content) not in body:
        raise RecordError(source, f"{field_name}.content", f"the chat template does not render this content "
                          f"(tool-call turns of some templates render only the call): {content.strip()[:60]!r}",
                          "template_drops_content")
    if reasoning is not None:
        stats["reasoning_messages"] += 1
        stats["reasoning_chars"] += len(reasoning)
        if opts.reasoning != "drop":
            present = squash(reasoning) in body
            if inlined and not present:
                raise RecordError(source, f"{field_name}.content", "the chat template does not render the content "
                                  "the reasoning was inlined into", "template_drops_content")
            if inlined:
                stats["reasoning_inlined"] += 1
                stats["reasoning_inlined_chars"] += len(reasoning)
            elif present:
                stats["reasoning_by_template"] += 1
                stats["reasoning_by_template_chars"] += len(reasoning)
            elif opts.reasoning == "error":
                raise RecordError(source, f"{field_name}.reasoning_content", "the chat template does not render "
                                  "this reasoning (reasoning: error; use auto to inline it)", "reasoning_not_rendered")
            else:  # template: kept, counted as lost
                stats["reasoning_not_rendered"] += 1
                stats["reasoning_not_rendered_chars"] += len(reasoning)
    for j, call in enumerate(msg.get("tool_calls") or ()):
        stats["tool_calls"] += 1
        stats["tool_call_chars"] += _tool_call_chars(call)
        if squash(call["function"]["name"]) not in body or not _arguments_in(body, _call_arguments(call)):
            raise RecordError(source, f"{field_name}.tool_calls[{j}]", "the chat template does not render this "
                              "tool call", "template_drops_tools")


def asked_chars(record: dict) -> int:
    """Characters a normalized record asks to train: content, reasoning and tool calls of labelled assistant
    messages (what report.json counts as lost when the record, or a piece of it, is not trained)."""
    total = 0
    for msg, label in zip(record["messages"], record["labels"]):
        if label and msg["role"] == "assistant":
            total += len(msg["content"]) + (len(msg["reasoning_content"]) if _has_reasoning(msg) else 0)
            total += sum(_tool_call_chars(c) for c in msg.get("tool_calls") or ())
    return total


# ---------------------------------------------------------------------------------------------- splicing
def splice(text: str, spans: list[tuple[int, int]], bodies: dict[int, str]) -> tuple[str, list[tuple[int, int]]]:
    """`text` with the span of assistant turn j replaced by `bodies[j]`; returns the new text and spans."""
    pieces, new_spans, prev, length = [], [], 0, 0
    for j, (a, b) in enumerate(spans):
        body = bodies.get(j, text[a:b])
        pieces += [text[prev:a], body]
        length += a - prev
        new_spans.append((length, length + len(body)))
        length += len(body)
        prev = b
    pieces.append(text[prev:])
    return "".join(pieces), new_spans


# ---------------------------------------------------------------------------------------------- merged records
def split_parts(record: dict, source: str) -> list[tuple[dict, list[int]]]:
    """The original records of a merged record (`meta.parts`: [{"start": first message, "system": shown the
    system prompt alone}]), each with the positions of its messages in the merged record."""
    parts = record["meta"].get("parts")
    messages, labels = record["messages"], record["labels"]
    if not parts or len(parts) < 2:
        return [(record, list(range(len(messages))))]
    starts = [p.get("start") if isinstance(p, dict) else None for p in parts] + [len(messages)]
    if starts[0] != 0 or not all(isinstance(a, int) and not isinstance(a, bool) and a < b
                                 for a, b in zip(starts, starts[1:])):
        raise RecordError(source, "meta.parts", f"expected [{{start, system}}] with increasing starts from 0 "
                          f"below {len(messages)}, got {parts!r}", "bad_record")
    out = []
    for k, part in enumerate(parts):
        idx = list(range(starts[k], starts[k + 1]))
        if k > 0 and part.get("system") and messages[0]["role"] == "system":
            idx = [0] + idx
        sub = {"messages": [messages[i] for i in idx], "labels": [labels[i] for i in idx], "meta": {}}
        for key in ("tools", "enable_thinking"):
            if key in record:
                sub[key] = record[key]
        out.append((sub, idx))
    return out


def render_merged(tokenizer, info: TemplateInfo, record: dict, opts: FidelityOptions, renders_reasoning: bool,
                  source: str) -> Rendered:
    """A (possibly merged) record: one render of the whole conversation, each assistant turn's text replaced by
    its text in its original record rendered alone (see the module docstring). A record with one part is
    `render_record` itself."""
    parts = split_parts(record, source)
    if len(parts) == 1:
        return render_record(tokenizer, info, record, opts, renders_reasoning, source)
    alone = [render_record(tokenizer, info, sub, opts, renders_reasoning, f"{source} part {k + 1}", idx)
             for k, (sub, idx) in enumerate(parts)]
    bodies = []  # every assistant turn's text alone, in merged order
    for (sub, _), rendered in zip(parts, alone):
        bodies += [rendered.text[a:b] for a, b in rendered.spans]
    messages = [{k: v for k, v in m.items() if k != "category_id"} for m in record["messages"]]
    if opts.tool_arguments == "parse":
        messages = parse_tool_arguments(messages, source, list(range(len(messages))), dict(tool_arguments_parsed=0))
    text = _render(tokenizer, messages, _template_kwargs(record, opts), source)
    text, spans = splice(text, _spans(text, info, len(bodies), source), dict(enumerate(bodies)))
    stats = dict.fromkeys(STAT_KEYS, 0)
    for rendered in alone:
        for key, value in rendered.stats.items():
            stats[key] += value
    return Rendered(text=text, spans=spans, stats=stats)
