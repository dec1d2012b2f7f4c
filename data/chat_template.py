"""Chat-template analysis: where a rendered conversation's assistant turns start and end, for any template.

The loss mask is derived from character spans of ONE render of the whole conversation (never from renders of
prefixes: Qwen3 drops earlier `<think>` blocks and Phi-3's special tokens swallow the following newline, so a
prefix render is not a prefix of the full render). Two strings are learnt from probe renders:

- `header`: the assistant role header, i.e. the generation prompt (render with `add_generation_prompt=True`
  minus the render without), cut to the part common to every `enable_thinking` setting (Qwen3 appends an empty
  `<think></think>` block when thinking is off; that block is part of the trained answer, not of the header);
- `end_of_turn`: what the template writes right after an assistant message's text, whatever follows
  (another turn or the end of the conversation), without trailing whitespace (`<|im_end|>`, `<|eot_id|>`,
  `<|end|>`).

Probe differences are cut back to token boundaries: Phi-3 appends `<|endoftext|>` to a render without the
generation prompt, which shares the characters `<|` with `<|assistant|>`.
"""
from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.config import ConfigError
from data.shards.chat_templates import BUILTIN_TEMPLATES, builtin_name, names as template_names
from data.shards.processor import is_processor_dir, processor_chat_template
from data.timebound import TimeBoundExceeded, time_bound

PROBE_USER = "PackSFT probe question 1"
PROBE_ANSWER = "PackSFT probe answer 2"
PROBE_USER_2 = "PackSFT probe question 3"
THINKING_VARIANTS = ({}, {"enable_thinking": True}, {"enable_thinking": False})
DEFAULT_RENDER_TIMEOUT = 10.0  # `render_timeout`'s default (seconds)


class SpanError(ValueError):
    """A rendered conversation does not show one header ... end-of-turn per assistant message."""


@dataclass(frozen=True)
class TemplateInfo:
    header: str
    end_of_turn: str


def template_error(exc: BaseException) -> str:
    """`TemplateSyntaxError at template line 3: unexpected '}'`: the line is jinja's (a syntax error's `lineno`,
    else the innermost frame of the compiled template, which jinja maps back to template lines)."""
    line = getattr(exc, "lineno", None)
    if line is None:
        lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == "<template>"]
        line = lines[-1] if lines else None
    return f"{type(exc).__name__}{f' at template line {line}' if line else ''}: {exc}"


def template_origin(tokenizer_path: str, chat_template: str | None) -> str:
    """Where the chat template comes from, as the config key (and file) to fix."""
    if chat_template:
        builtin = " (built-in)" if builtin_name(chat_template) and not Path(chat_template).is_file() else ""
        return f"chat_template: {chat_template}{builtin} (tokenizer {tokenizer_path})"
    own = Path(tokenizer_path) / "chat_template.jinja"
    source = own if own.is_file() else Path(tokenizer_path) / "tokenizer_config.json"
    return f"tokenizer_path: {tokenizer_path}: the chat template of {source.name}"


@dataclass(frozen=True)
class RenderBound:
    """The time the chat template may take to render one record (`render_timeout`, None: no bound), and where the
    template comes from (`template_origin`), for the error that names both."""
    seconds: float | None
    origin: str

    @classmethod
    def of(cls, tokenizer_path: str, chat_template: str | None, seconds: float | None) -> "RenderBound":
        return cls(seconds, template_origin(tokenizer_path, chat_template))

    @contextlib.contextmanager
    def rendering(self, what: str) -> Iterator[None]:
        """The block renders `what` (a record's source): past the bound, a ConfigError naming the template and it."""
        try:
            with time_bound(self.seconds):
                yield
        except TimeBoundExceeded:
            raise ConfigError(f"{self.origin}: rendering {what} took more than render_timeout {self.seconds:g} s "
                              "(the template may loop): fix the template, or raise render_timeout (null: no "
                              "bound)") from None


def check_template_renders(tokenizer, bound: RenderBound) -> None:
    """A template that does not compile, raises for a plain user/assistant exchange, or renders it for longer than
    `bound`, is a ConfigError naming where it comes from and the template line (not a jinja traceback from deep
    inside a stage, nor a hang)."""
    probe = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ANSWER}]
    try:
        with bound.rendering("a user/assistant exchange (a probe)"):
            _render(tokenizer, probe)
    except ConfigError:
        raise
    except Exception as exc:  # jinja's TemplateSyntaxError, the template's raise_exception, an undefined value
        raise ConfigError(f"{bound.origin}: cannot render a user/assistant exchange: {template_error(exc)}") from None


def load_chat_tokenizer(tokenizer_path: str, chat_template: str | None = None,
                        render_timeout: float | None = DEFAULT_RENDER_TIMEOUT):
    """A fast tokenizer with a chat template (`chat_template`, a Jinja file, replaces the tokenizer's own; in a
    processor directory the processor's template is the default) that renders a probe exchange within
    `render_timeout` seconds."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, JSON errors) for a bad directory
        raise ConfigError(f"tokenizer_path: cannot load a tokenizer from {tokenizer_path}: {type(exc).__name__}: "
                          f"{exc}") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ConfigError(f"tokenizer_path: {tokenizer_path} has no fast (Rust) tokenizer; offsets need one")
    if chat_template:
        path = Path(chat_template)
        if path.is_file():
            tokenizer.chat_template = path.read_text(encoding="utf-8")
        elif builtin_name(chat_template):
            tokenizer.chat_template = BUILTIN_TEMPLATES[builtin_name(chat_template)]
        else:
            raise ConfigError(f"chat_template: {chat_template} is neither a file nor a built-in template name "
                              f"({template_names()})")
    elif is_processor_dir(tokenizer_path) and processor_chat_template(tokenizer_path):
        tokenizer.chat_template = processor_chat_template(tokenizer_path)  # the one that renders media parts
    if not tokenizer.chat_template:
        raise ConfigError(
            f"tokenizer_path: the tokenizer at {tokenizer_path} has no chat template; set chat_template to the "
            f"model family's built-in template ({template_names()}) or to a Jinja file (path/to/template.jinja)"
        )
    check_template_renders(tokenizer, RenderBound.of(tokenizer_path, chat_template, render_timeout))
    return tokenizer


def _render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _token_starts_ends(tokenizer, text: str) -> tuple[list[int], list[int], list[int]]:
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    return enc.ids, [s for s, _ in enc.offsets], [e for _, e in enc.offsets]


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _generation_prompt(tokenizer, kwargs: dict) -> str:
    """Render with the generation prompt minus the render without; when the latter is not a prefix (Phi-3 ends
    a conversation with eos), split at the first differing TOKEN."""
    base = [{"role": "user", "content": PROBE_USER}]
    plain = _render(tokenizer, base, add_generation_prompt=False, **kwargs)
    with_gen = _render(tokenizer, base, add_generation_prompt=True, **kwargs)
    if with_gen.startswith(plain):
        return with_gen[len(plain):]
    ids_plain, _, _ = _token_starts_ends(tokenizer, plain)
    ids_gen, starts_gen, _ = _token_starts_ends(tokenizer, with_gen)
    i = 0
    while i < min(len(ids_plain), len(ids_gen)) and ids_plain[i] == ids_gen[i]:
        i += 1
    if i == len(ids_gen):
        return ""
    return with_gen[starts_gen[i]:]


def _probe_renders(tokenizer) -> tuple[list[str], str, str]:
    """The generation prompt of each `THINKING_VARIANTS`, a user/assistant exchange and the same with a user turn
    after it, rendered."""
    prompts = [_generation_prompt(tokenizer, kw) for kw in THINKING_VARIANTS]
    one = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ANSWER}]
    two = one + [{"role": "user", "content": PROBE_USER_2}]
    return prompts, _render(tokenizer, one), _render(tokenizer, two)


def analyze_template(tokenizer, bound: RenderBound = RenderBound(DEFAULT_RENDER_TIMEOUT, "the chat template")
                     ) -> TemplateInfo:
    """Learn the assistant header and end-of-turn marker of the tokenizer's chat template from probe renders
    (rendered within `bound`)."""
    try:
        with bound.rendering("the probe conversations"):
            prompts, text_one, text_two = _probe_renders(tokenizer)
    except ConfigError:
        raise
    except Exception as exc:  # a template that cannot render a plain user/assistant exchange
        raise ConfigError(f"chat template cannot render a probe conversation: {type(exc).__name__}: {exc}") from exc
    header = prompts[0]
    for other in prompts[1:]:
        header = header[: _common_prefix_len(header, other)]
    if not header.strip():
        raise ConfigError("chat template adds no generation prompt (add_generation_prompt=True changes nothing); "
                          "cannot tell where assistant turns start")
    for text in (text_one, text_two):
        if PROBE_ANSWER not in text:
            raise ConfigError("chat template does not render the assistant message's content verbatim")
    after_one = text_one[text_one.index(PROBE_ANSWER) + len(PROBE_ANSWER):]
    start_two = text_two.index(PROBE_ANSWER) + len(PROBE_ANSWER)
    after_two = text_two[start_two:]
    common = _common_prefix_len(after_one, after_two)
    # cut back to a token boundary of the longer render, then drop the separator whitespace
    _, starts, ends = _token_starts_ends(tokenizer, text_two)
    limit = start_two + common
    cut = max([e for e in ends if start_two <= e <= limit] + [s for s in starts if start_two <= s <= limit],
              default=start_two)
    end_of_turn = text_two[start_two:cut].rstrip()
    if not end_of_turn:
        raise ConfigError("chat template writes nothing after an assistant message (no end-of-turn marker); "
                          "cannot tell where assistant turns end")
    header_at = text_one.find(header)
    if header_at < 0 or header_at > text_one.index(PROBE_ANSWER):
        raise ConfigError(f"chat template: the generation prompt {header!r} does not precede the assistant message")
    return TemplateInfo(header=header, end_of_turn=end_of_turn)


def assistant_spans(text: str, info: TemplateInfo, n_assistant: int) -> list[tuple[int, int]]:
    """Character spans `[start, end)` of the n assistant turns in a rendered conversation, in order: from just
    after the assistant header to the end of the end-of-turn marker. Raises SpanError unless the text holds
    exactly `n_assistant` headers each followed by an end-of-turn marker before the next header."""
    header, eot = info.header, info.end_of_turn
    spans = []
    pos = 0
    for k in range(n_assistant):
        h = text.find(header, pos)
        if h < 0:
            raise SpanError(f"assistant message {k + 1} of {n_assistant}: header {header!r} not found in the render")
        body = h + len(header)
        e = text.find(eot, body)
        if e < 0:
            raise SpanError(f"assistant message {k + 1} of {n_assistant}: no end-of-turn {eot!r} after its header")
        nxt = text.find(header, body)
        if 0 <= nxt < e:
            raise SpanError(f"assistant message {k + 1} of {n_assistant}: another header before its end-of-turn")
        end = e + len(eot)
        spans.append((body, end))
        pos = end
    if text.find(header, pos) >= 0:
        raise SpanError(f"the render holds more assistant headers {header!r} than the {n_assistant} assistant "
                        "messages (header text inside a message, or a template that adds turns)")
    return spans
