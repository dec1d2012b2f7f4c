"""Tokenize stage: merged.jsonl -> tokenized/ (one sequence per row) with exact loss masks.

Per record the whole conversation is rendered with the tokenizer's chat template (text; once in the common
case), a batch of texts is encoded by the fast tokenizer, and the loss mask comes from character spans of that
render (see data/chat_template.py): for every trained assistant message, the tokens that START inside
`[end of its assistant header, end of its end-of-turn marker)`. The messages given to the template are those of
the record after the `reasoning` and `tool_arguments` policies, and every trained turn passes the conservation
check (data/fidelity.py); for an unmerged record whose reasoning the template renders (or which has none) and
whose tool arguments are objects, the token ids are exactly
`tokenizer.apply_chat_template(messages, tools=tools, **kwargs)["input_ids"]`. A merged record's assistant turns
are rendered as in their original records alone (data/fidelity.py, `render_merged`).

A record with media (data/media.py: images, videos, audio) is rendered with the processor's chat template and each
item's placeholder replaced by the processor's token run: its ids are exactly
`processor(text=rendered, images=..., videos=..., audio=...)["input_ids"]` (checked per record); tokens of a media
run (a video's timestamps and its sound track's tokens included) never carry a label nor a turn id; the media's
bytes, grids and token counts go into the shards beside the tokens. Such a record is never truncated (a cut would
split or drop a clip): over-long, it is dropped (or an error under `overlong: error`).

Per token: `input_ids`, `labels` (= input id where trained, -100 elsewhere), `category_ids` (category of the
assistant message the token belongs to: its own turn, or the prompt that precedes it; tokens after the last
assistant turn belong to it), `turn_ids` (k = 1..T on the k-th trained turn, 0 elsewhere), and in structure
mode `block_ids`/`path_ids` from `data.shards.parallel_thinking.token_structure`.

`stepwise` (docs/DATA.md): `samples` expands a record with K trained assistant turns into K step records (record
k: the messages up to and including the k-th trained assistant turn, only that turn labelled), each tokenized as
above, so sequence k is the chat template's own rendering of what inference sees at that step. Every count of the
stage (in/out, drops, categories, turns, fidelity) is then the expansion's: one per step record. `tree` tokenizes
the same step records and stores each record's kept steps as prefix trees (data/shards/prefix_tree.py, per-token
`tree_spans`), at most the pack capacity long each (a cut between steps); the counts stay the expansion's, and the
report's `stepwise` section says how many tokens the trees store and save.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from common.config import ConfigError, to_dict
from common.fsutil import tokenizer_hash
from data.shards.chat_templates import chat_template_hash
from data.chat_template import RenderBound, TemplateInfo, analyze_template, load_chat_tokenizer
from data.config import DataConfig, output_config
from data.executor import ByteRange, Executor, LocalExecutor, count_lines, spread_ranges
from data.media import Expanded, expand
from data.fidelity import STAT_KEYS, FidelityOptions, Rendered, asked_chars, render_merged, template_renders_reasoning
from data.progress import progress
from data.records import RecordError, has_media, message_category, record_uids, validate_canonical
from data.report import DROPPED_AT_LIMIT, check_arithmetic, format_tokenize_summary, sorted_counts, update_report
from data.io import parse_jsonl_line, read_lines
from data.shards.dataset import (IGNORE_INDEX, MEDIA_DTYPE, MEDIA_KINDS, REQUIRED_TOKEN_FIELDS, STRUCTURE_TOKEN_FIELDS,
                                 TREE_TOKEN_FIELDS, PackedDataset, ShardCutter, ShardWriter, StoredMedia, count_media,
                                 media_count_keys)
from data.shards.processor import MediaProcessor, MediaSettings, is_processor_dir
from data.token_bound import TokenBound

OVERLONG_POLICIES = ("drop", "error", "truncate", "left", "right")
RANGE_BYTES = 1 << 20  # merged.jsonl bytes per worker task (a range, one part) at most (`executor.spread_ranges`)
BATCH_RECORDS = 256  # records per batch encode
PART_SHARD_BYTES = 1 << 62  # a part is one shard, whatever its size: the parts are re-cut into tokenized/'s shards


@dataclass
class TokenizedSequence:
    input_ids: np.ndarray  # int32 [n]
    labels: np.ndarray  # int32 [n]
    category_ids: np.ndarray  # int16 [n]
    turn_ids: np.ndarray  # int16 [n]
    uids: list[int]
    record_index: int
    category_id: int  # the record's own category (meta.category_id), for accounting
    category_name: str | None = None
    block_ids: np.ndarray | None = None  # int16 [n], structure mode
    path_ids: np.ndarray | None = None
    truncated: bool = False
    structure_kept_plain: bool = False
    fidelity: dict = field(default_factory=dict)  # per-record counters of data.fidelity.STAT_KEYS
    counts_before: dict = field(default_factory=dict)  # {category: [tokens, loss tokens]} before truncation
    media: list[StoredMedia] = field(default_factory=list)  # in the order of their token runs
    tree_spans: np.ndarray | None = None  # int32 [n], `stepwise: tree`
    samples: list["TokenizedSequence"] = field(default_factory=list)  # a tree's step sequences (for the counts)

    @property
    def n_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))

    def token_fields(self) -> dict[str, np.ndarray]:
        out = {"input_ids": self.input_ids, "labels": self.labels,
               "category_ids": self.category_ids, "turn_ids": self.turn_ids}
        if self.block_ids is not None:
            out["block_ids"] = self.block_ids
            out["path_ids"] = self.path_ids
        if self.tree_spans is not None:
            out["tree_spans"] = self.tree_spans
        return out


@dataclass
class TokenizeContext:
    """Everything the pure core needs; built once per process (the tokenizer load is the costly part)."""

    tokenizer: Any
    info: TemplateInfo
    max_length: int
    overlong: str = "drop"
    on_error: str = "error"  # only read in structure mode: keep a malformed record as plain text under skip
    structure: str | None = None
    enable_thinking: bool | None = None
    reasoning: str = "auto"
    reasoning_tags: tuple[str, str] = FidelityOptions.reasoning_tags
    tool_arguments: str = "parse"
    render_bound: RenderBound = RenderBound(None, "the chat template")  # time to render one record (render_timeout)
    media: MediaProcessor | None = None  # the processor of media records (loaded on the first one); None: none
    stepwise: str = "off"  # off | samples | tree (module doc)
    tree_max_length: int | None = None  # longest prefix tree (the pack capacity); None: max_length
    backend: Any = field(init=False, repr=False)
    fidelity: FidelityOptions = field(init=False, repr=False)
    renders_reasoning: bool = field(init=False, repr=False)
    # rejects an over-long record before rendering and encoding it (None: the policy truncates, or no safe bound)
    token_bound: TokenBound | None = field(init=False, repr=False)

    def __post_init__(self):
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigError(f"overlong must be one of {OVERLONG_POLICIES}, got {self.overlong!r}")
        self.backend = self.tokenizer.backend_tokenizer
        self.fidelity = FidelityOptions(reasoning=self.reasoning, reasoning_tags=tuple(self.reasoning_tags),
                                        tool_arguments=self.tool_arguments, enable_thinking=self.enable_thinking)
        self.renders_reasoning = template_renders_reasoning(self.tokenizer)
        self.token_bound = TokenBound.of(self.tokenizer) if self.overlong in ("drop", "error") else None

    @classmethod
    def from_config(cls, cfg: DataConfig) -> "TokenizeContext":
        tokenizer = load_chat_tokenizer(cfg.tokenizer_path, cfg.chat_template, cfg.render_timeout)
        bound = RenderBound.of(cfg.tokenizer_path, cfg.chat_template, cfg.render_timeout)
        return cls(tokenizer=tokenizer, info=analyze_template(tokenizer, bound), max_length=cfg.max_length,
                   overlong=cfg.effective_overlong, on_error=cfg.on_error,
                   structure=cfg.structure, enable_thinking=cfg.enable_thinking, reasoning=cfg.reasoning,
                   reasoning_tags=tuple(cfg.reasoning_tags), tool_arguments=cfg.tool_arguments, render_bound=bound,
                   media=MediaProcessor(media_settings(cfg)),
                   stepwise=cfg.stepwise, tree_max_length=cfg.pack_max_length)


# ---------------------------------------------------------------------------------------------- the pure core
def template_inputs(record: dict, ctx_enable_thinking: bool | None = None) -> tuple[list[dict], dict]:
    """The `(messages, kwargs)` of a canonical record as given, before the fidelity policies (data/fidelity.py):
    messages without the pipeline's `category_id`, `tools` when present, `enable_thinking` (the record's, else
    the config's) when set. The template's own view of a record, for tests and benchmarks."""
    messages = [{k: v for k, v in m.items() if k != "category_id"} for m in record["messages"]]
    kwargs: dict[str, Any] = {}
    if record.get("tools"):
        kwargs["tools"] = record["tools"]
    thinking = record.get("enable_thinking", ctx_enable_thinking)
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    return messages, kwargs


def _first_token_at(enc, pos: int, n_tokens: int, text_len: int) -> int:
    """Index of the first token whose start offset is >= pos (n_tokens if none)."""
    p = pos
    t = None
    while p < text_len:
        t = enc.char_to_token(p)
        if t is not None:
            break
        p += 1
    if t is None:
        return n_tokens
    while t < n_tokens and enc.token_to_chars(t)[0] < pos:
        t += 1
    return t


def _renumber_turns(turn_ids: np.ndarray) -> np.ndarray:
    """Turn ids 1..T in order of appearance (after a cut that removed leading turns)."""
    present = np.unique(turn_ids[turn_ids > 0])
    if present.size == 0 or (present[0] == 1 and present[-1] == present.size):
        return turn_ids
    lut = np.zeros(int(present[-1]) + 1, dtype=np.int16)
    lut[present] = np.arange(1, present.size + 1, dtype=np.int16)
    return lut[turn_ids]


def _raw_meta(record: Any) -> dict:
    """meta of a (possibly invalid) record, {} when there is none."""
    meta = record.get("meta") if isinstance(record, dict) else None
    return meta if isinstance(meta, dict) else {}


def _raw_category(record: Any) -> int:
    """meta.category_id of a (possibly invalid) record, 0 when there is none."""
    cat = _raw_meta(record).get("category_id")
    return cat if isinstance(cat, int) and not isinstance(cat, bool) and cat >= 0 else 0


def _raw_category_name(record: Any) -> str | None:
    """meta.category_name of a (possibly invalid) record: a dropped record still names its category."""
    name = _raw_meta(record).get("category_name")
    return name if isinstance(name, str) else None


def _with_origin(source: str, record: Any) -> str:
    """`merged.jsonl:61 (from raw.parquet:327)`: an error names the raw input record too, not only the line
    of the stage's own input (merged records name their original uids instead)."""
    meta = record.get("meta") if isinstance(record, dict) else None
    if not isinstance(meta, dict):
        return source
    if isinstance(meta.get("source"), str):
        return f"{source} (from {meta['source']})"
    if isinstance(meta.get("uids"), list):
        return f"{source} (from input records with uids {meta['uids']})"
    return source


def _check_bound(n_tokens: int, what: str, source: str, ctx: TokenizeContext) -> None:
    if n_tokens > ctx.max_length:
        raise RecordError(source, "messages", f"at least {n_tokens} tokens > max_length {ctx.max_length} ({what}, "
                          f"at most {ctx.token_bound.max_token_bytes} bytes a token; not encoded)", "overlong")


def _prepare(record: Any, source: str, ctx: TokenizeContext) -> tuple[dict, Rendered]:
    """Validate one record and render it under the fidelity policies: (normalized record, render), or
    RecordError (carrying `asked_chars`, what the record asked to train, when it validated).

    With a token bound, a record that cannot fit max_length is rejected as `overlong` from the bytes of its
    trained turns' content (which the conservation check requires in the render) before the template runs, and
    from the bytes of the render before it is encoded. A record that would also fail for another reason is then
    counted as overlong."""
    if isinstance(record, RecordError):
        raise record
    norm = validate_canonical(record, source)
    bound = ctx.token_bound
    try:
        if bound is not None:
            trained = [m["content"] for m, label in zip(norm["messages"], norm["labels"]) if label]
            _check_bound(sum(bound.piece_tokens(c) for c in trained), "from the trained content", source, ctx)
        rendered = render_merged(ctx.tokenizer, ctx.info, norm, ctx.fidelity, ctx.renders_reasoning, source)
        if bound is not None:
            _check_bound(bound.text_tokens(rendered.text), "from the rendered text", source, ctx)
        return norm, rendered
    except RecordError as exc:
        exc.asked_chars = asked_chars(norm)
        raise


def _category_counts(category_ids: np.ndarray, loss_mask: np.ndarray) -> dict[int, list[int]]:
    """{category: [tokens, loss tokens]} of one sequence."""
    cats, counts = np.unique(category_ids, return_counts=True)
    loss = np.bincount(category_ids[loss_mask], minlength=int(cats.max()) + 1)
    return {c: [n, int(loss[c])] for c, n in zip(cats.tolist(), counts.tolist())}


def _build(norm: dict, rendered: Rendered, enc, source: str, record_index: int,
           ctx: TokenizeContext, expanded: Expanded | None = None) -> TokenizedSequence:
    text, spans = rendered.text, rendered.spans
    ids = np.asarray(enc.ids, dtype=np.int32)
    n = ids.shape[0]
    if expanded is not None and enc.ids != expanded.reference_ids:
        raise RecordError(source, "messages", "the token ids differ from the processor's (processor(text=render, "
                          f"media)): {n} vs {len(expanded.reference_ids)} tokens", "processor_mismatch")
    msgs = norm["messages"]
    labels_in = norm["labels"]
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    # `loss_turns: last` is applied by the merge stage, per original record, through the labels
    trained = [j for j, i in enumerate(assistant) if labels_in[i]]
    trained_set = set(trained)

    text_len = len(text)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int32)
    turn_ids = np.zeros(n, dtype=np.int16)
    category_ids = np.empty(n, dtype=np.int16)
    turn_ends: list[int] = []  # token end of each trained turn (for cut-at-turn truncation)
    prev = 0
    k = 0
    for j, i in enumerate(assistant):
        start_char, end_char = spans[j]
        end_tok = _first_token_at(enc, end_char, n, text_len)
        category_ids[prev:end_tok] = message_category(norm, i)
        prev = end_tok
        if j in trained_set:
            start_tok = _first_token_at(enc, start_char, n, text_len)
            if end_tok > start_tok:
                k += 1
                labels[start_tok:end_tok] = ids[start_tok:end_tok]
                turn_ids[start_tok:end_tok] = k
                turn_ends.append(end_tok)
    category_ids[prev:] = message_category(norm, assistant[-1])
    media = []
    for (a, b), item in zip(expanded.media_spans, expanded.media) if expanded is not None else ():
        first, end = _first_token_at(enc, a, n, text_len), _first_token_at(enc, b, n, text_len)
        labels[first:end] = IGNORE_INDEX  # media tokens never carry a label nor a turn id
        turn_ids[first:end] = 0
        media.append(item._replace(n_tokens=end - first))
    counts_before = _category_counts(category_ids, labels != IGNORE_INDEX)
    try:  # a record dropped from here on still counts its tokens in the "before" figures
        if k == 0:
            raise RecordError(source, "labels", "no assistant token is trained", "no_trainable_token")

        where = f"{n} tokens > max_length {ctx.max_length}"
        if n > ctx.max_length and (ctx.overlong in ("drop", "error") or expanded is not None):
            raise RecordError(source, "messages", where + (" (a record with media is never truncated)"
                                                           if expanded is not None else ""), "overlong")

        block_ids = path_ids = None
        kept_plain = False
        if ctx.structure == "parallel_thinking":
            from data.shards.parallel_thinking import StructureError, token_structure

            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(n, 2)
            try:
                block_ids, path_ids = token_structure(text, offsets, [spans[j] for j in trained])
            except StructureError as exc:
                if ctx.on_error == "error":
                    raise RecordError(source, "structure", str(exc), "structure") from None
                block_ids = np.zeros(n, dtype=np.int16)
                path_ids = np.zeros(n, dtype=np.int16)
                kept_plain = True
            block_ids = np.asarray(block_ids, dtype=np.int16)
            path_ids = np.asarray(path_ids, dtype=np.int16)

        arrays = [ids, labels, category_ids, turn_ids, block_ids, path_ids]
        truncated = False
        if n > ctx.max_length:
            policy = ctx.overlong
            if policy == "truncate":
                fitting = [e for e in turn_ends if e <= ctx.max_length]
                if not fitting:
                    raise RecordError(source, "messages", f"{where} and the first trained turn ends at token "
                                      f"{turn_ends[0]}", "overlong")
                sl = slice(0, fitting[-1])
            elif policy == "left":
                sl = slice(n - ctx.max_length, n)
            else:  # right
                sl = slice(0, ctx.max_length)
            arrays = [None if a is None else a[sl].copy() for a in arrays]
            if arrays[1][0] != IGNORE_INDEX:  # a left cut inside a turn: nothing predicts a row's first token
                arrays[1][0] = IGNORE_INDEX
                arrays[3][0] = 0
            arrays[3] = _renumber_turns(arrays[3])
            truncated = True
            if ctx.structure == "parallel_thinking" and not kept_plain and policy != "truncate":
                from data.shards.parallel_thinking import StructureError, validate_structure

                try:  # a token-level cut may split a <Parallel> block
                    validate_structure(arrays[4], arrays[5])
                except StructureError as exc:
                    if ctx.on_error == "error":
                        raise RecordError(source, "structure", f"after {policy} truncation: {exc}",
                                          "structure") from None
                    arrays[4] = np.zeros_like(arrays[4])
                    arrays[5] = np.zeros_like(arrays[5])
                    kept_plain = True
            if not np.any(arrays[1] != IGNORE_INDEX):
                raise RecordError(source, "messages", f"{where}: no trained token left after {policy} truncation",
                                  "no_trainable_token")
        ids, labels, category_ids, turn_ids, block_ids, path_ids = arrays
        meta = norm["meta"]
        return TokenizedSequence(
            input_ids=ids, labels=labels, category_ids=category_ids, turn_ids=turn_ids,
            uids=record_uids(norm), record_index=record_index, category_id=_raw_category(norm),
            category_name=meta.get("category_name"), block_ids=block_ids, path_ids=path_ids,
            truncated=truncated, structure_kept_plain=kept_plain, fidelity=rendered.stats,
            counts_before=counts_before, media=media,
        )
    except RecordError as exc:
        exc.counts_before = counts_before
        raise


def stepwise_records(record: Any, source: str) -> list[Any]:
    """`stepwise` expansion of one record: per trained assistant turn k (in order), the record cut after that turn
    with only it labelled (`loss_turns: last` of the cut record). A record that does not validate, or has no
    trained turn, comes back as it is (the tokenize path rejects it with its reason); a merged record (meta.parts)
    or one with media is refused (RecordError `stepwise`)."""
    try:
        norm = validate_canonical(record, source)
    except RecordError:
        return [record]
    if norm["meta"].get("parts"):
        return [RecordError(source, "meta.parts", "a pseudo-multiturn merged record cannot be expanded stepwise "
                            "(set merge.probability: 0 with stepwise)", "stepwise")]
    if has_media(norm):
        return [RecordError(source, "messages", "records with media are not expanded stepwise yet (stepwise: off "
                            "for media data)", "stepwise")]
    messages, labels = norm["messages"], norm["labels"]
    trained = [i for i, (m, label) in enumerate(zip(messages, labels)) if m["role"] == "assistant" and label]
    if not trained:
        return [record]
    return [dict(norm, messages=messages[:i + 1], labels=[0] * i + [1]) for i in trained]


def _stepwise_tokenize(records: list[Any], ctx: TokenizeContext, sources: list[str],
                       record_indices: list[int]) -> list[Any]:
    """`tokenize_records` under `stepwise`: the step records of every record tokenized in one batch; `samples`
    returns one result per step record, `tree` each record's kept steps as prefix trees (its dropped steps as
    their RecordErrors)."""
    from data.shards.prefix_tree import build_trees

    steps, owner, step_sources, step_indices = [], [], [], []
    for i, rec in enumerate(records):
        expanded = stepwise_records(rec, sources[i])
        for k, step in enumerate(expanded, start=1):
            steps.append(step)
            owner.append(i)
            step_sources.append(sources[i] if len(expanded) == 1 else f"{sources[i]} step {k}/{len(expanded)}")
            step_indices.append(record_indices[i])
    results = _tokenize_batch(steps, ctx, step_sources, step_indices)
    if ctx.stepwise == "samples":
        return results
    out: list[Any] = []
    k = 0
    while k < len(results):
        end = k
        while end < len(results) and owner[end] == owner[k]:
            end += 1
        kept = [r for r in results[k:end] if isinstance(r, TokenizedSequence)]
        out.extend(r for r in results[k:end] if not isinstance(r, TokenizedSequence))
        trees = build_trees([r.token_fields() for r in kept], ctx.tree_max_length or ctx.max_length)
        j = 0
        for tree in trees:
            members = kept[j:j + tree.n_samples]
            j += tree.n_samples
            arrays = tree.arrays()
            first = members[0]
            out.append(TokenizedSequence(
                input_ids=arrays["input_ids"], labels=arrays["labels"], category_ids=arrays["category_ids"],
                turn_ids=arrays["turn_ids"], uids=first.uids, record_index=first.record_index,
                category_id=first.category_id, category_name=first.category_name,
                tree_spans=arrays["tree_spans"], samples=members))
        k = end
    return out


def tokenize_records(
    records: list[Any],
    ctx: TokenizeContext,
    sources: list[str] | None = None,
    record_indices: list[int] | None = None,
) -> list[TokenizedSequence | RecordError]:
    """Tokenize a batch of canonical records (dicts; a RecordError passes through) with one batch encode.

    Returns, per record in order, a TokenizedSequence or the RecordError that rejects it (reason keys:
    the validation reasons of data.records, `template_error`, `template_mismatch`, `no_trainable_token`,
    `overlong`, `structure`). Policies are the caller's: nothing here raises for a bad record. A record the
    template renders for longer than `ctx.render_bound` raises a ConfigError naming the template and the record.
    """
    n = len(records)
    sources = sources if sources is not None else [f"record {i}" for i in range(n)]
    record_indices = record_indices if record_indices is not None else list(range(n))
    if ctx.stepwise != "off":
        return _stepwise_tokenize(records, ctx, [_with_origin(src, rec) for src, rec in zip(sources, records)],
                                  record_indices)
    return _tokenize_batch(records, ctx, [_with_origin(src, rec) for src, rec in zip(sources, records)],
                           record_indices)


def _tokenize_batch(records: list[Any], ctx: TokenizeContext, sources: list[str], record_indices: list[int]
                    ) -> list[TokenizedSequence | RecordError]:
    """`tokenize_records` of records as they are (sources already naming their origin)."""
    n = len(records)
    out: list[Any] = [None] * n
    prepared = []
    for i, rec in enumerate(records):
        try:
            with ctx.render_bound.rendering(sources[i]):
                norm, rendered = _prepare(rec, sources[i], ctx)
            expanded = None
            if has_media(norm):
                expanded = _expand(norm, rendered, sources[i], ctx)
                rendered = Rendered(expanded.text, expanded.spans, rendered.stats)
            prepared.append((i, norm, rendered, expanded))
        except RecordError as exc:
            exc.category_id, exc.category_name = _raw_category(rec), _raw_category_name(rec)
            out[i] = exc
    encodings = ctx.backend.encode_batch([p[2].text for p in prepared], add_special_tokens=False)
    for (i, norm, rendered, expanded), enc in zip(prepared, encodings):
        try:
            out[i] = _build(norm, rendered, enc, sources[i], record_indices[i], ctx, expanded)
        except RecordError as exc:
            exc.category_id, exc.category_name = _raw_category(norm), _raw_category_name(norm)  # per category
            exc.asked_chars = asked_chars(norm)
            out[i] = exc
    return out


def _expand(norm: dict, rendered: Rendered, source: str, ctx: TokenizeContext) -> Expanded:
    """A record with media: its render with the processor's media token runs (data/media.py)."""
    if ctx.media is None or not is_processor_dir(ctx.media.path):
        where = ctx.media.path if ctx.media is not None else "the tokenizer"
        raise ConfigError(f"{source}: a record with media, but tokenizer_path {where} holds no processor "
                          "(preprocessor_config.json): point tokenizer_path at the model's processor directory "
                          "(or write one: python -m data.processors NAME DIR)")
    try:
        return expand(ctx.media, rendered.text, rendered.spans, norm, source)
    except RecordError as exc:
        exc.asked_chars = asked_chars(norm)
        raise


@dataclass
class TokenizeTally:
    """The stage's accounting of a run of records: mergeable, so a range is counted by the worker that tokenized
    it and the driver adds the tallies up in range order."""

    n_in: int = 0
    n_out: int = 0
    n_truncated: int = 0
    n_plain: int = 0
    n_tokens: int = 0
    n_loss: int = 0
    n_turns: int = 0
    media: dict = field(default_factory=lambda: dict.fromkeys(media_count_keys(), 0))  # count_media's counts
    n_rows: int = 0  # sequences written (a tree is one; otherwise n_out)
    n_stored: int = 0  # tokens written (a tree's trie size; otherwise n_tokens)
    n_records: int = 0  # stepwise: records expanded (the range's lines with a record)
    dropped: dict = field(default_factory=dict)
    # reason -> sources of its first DROPPED_AT_LIMIT drops: records come in input order, and tallies merge in it
    dropped_at: dict = field(default_factory=dict)
    cats: dict = field(default_factory=dict)  # category id -> counters
    names: dict = field(default_factory=dict)  # category id -> name, first seen
    stats: dict = field(default_factory=lambda: dict.fromkeys(STAT_KEYS, 0))  # fidelity counters of kept records
    lost: dict = field(default_factory=dict)  # reason -> [records, characters asked to train and not trained]

    @property
    def n_media(self) -> int:
        return sum(self.media[f"{kind}s"] for kind in MEDIA_KINDS)

    @property
    def media_bytes(self) -> int:
        return sum(self.media[f"{kind}_bytes"] for kind in MEDIA_KINDS)

    def _cat_row(self, cid: int) -> dict:
        return self.cats.setdefault(cid, {"before": 0, "after": 0, "tokens_before": 0, "loss_tokens_before": 0,
                                          "tokens": 0, "loss_tokens": 0, "dropped": {}})

    def _name(self, cid: int, name: str | None) -> None:
        if name is not None:
            self.names.setdefault(cid, name)

    def _count_before(self, counts_before: dict) -> None:
        for c, (tokens, loss) in counts_before.items():
            row = self._cat_row(c)
            row["tokens_before"] += tokens
            row["loss_tokens_before"] += loss

    def _add_sources(self, reason: str, sources: list[str]) -> None:
        kept = self.dropped_at.setdefault(reason, [])
        kept.extend(sources[:DROPPED_AT_LIMIT - len(kept)])

    def _count_lost(self, reason: str, records: int, chars: int) -> None:
        entry = self.lost.setdefault(reason, [0, 0])
        entry[0] += records
        entry[1] += chars

    def add_results(self, results: list, writer: ShardWriter, cfg: DataConfig) -> None:
        """Count a batch's `tokenize_records` results and add its kept sequences to `writer`; a bad record
        raises its RecordError when the policy says so (`on_error`, `overlong: error`)."""
        for res in results:
            if isinstance(res, RecordError):
                self.n_in += 1
                fatal = cfg.effective_overlong == "error" if res.reason == "overlong" else cfg.on_error == "error"
                if fatal:
                    raise res
                self.dropped[res.reason] = self.dropped.get(res.reason, 0) + 1
                self._add_sources(res.reason, [res.source])
                cid = getattr(res, "category_id", 0)
                row = self._cat_row(cid)
                row["before"] += 1
                row["dropped"][res.reason] = row["dropped"].get(res.reason, 0) + 1
                self._name(cid, getattr(res, "category_name", None))
                self._count_before(getattr(res, "counts_before", {}))
                self._count_lost(res.reason, 1, getattr(res, "asked_chars", 0))
                continue
            writer.add_row([res.token_fields()], record_indices=[res.record_index], uids=[res.uids],
                           media=[res.media] if writer.media else None)
            self.n_rows += 1
            self.n_stored += res.input_ids.shape[0]
            for sample in res.samples or [res]:  # a tree counts as the samples it stores
                self._count_kept(sample)

    def _count_kept(self, res: TokenizedSequence) -> None:
        """Count one kept sequence (one sample of the `stepwise` expansion)."""
        if res.media:
            count_media(self.media, np.array([item.entry(0, 0) for item in res.media], dtype=MEDIA_DTYPE))
        n = res.input_ids.shape[0]
        self.n_in += 1
        self.n_out += 1
        self.n_truncated += res.truncated
        self.n_plain += res.structure_kept_plain
        self.n_tokens += n
        loss_mask = res.labels != IGNORE_INDEX
        self.n_loss += int(np.count_nonzero(loss_mask))
        self.n_turns += int(res.turn_ids.max())
        row = self._cat_row(res.category_id)
        row["before"] += 1
        row["after"] += 1
        self._name(res.category_id, res.category_name)
        self._count_before(res.counts_before)
        after = _category_counts(res.category_ids, loss_mask) if res.truncated else res.counts_before
        for c, (tokens, loss) in after.items():
            r = self._cat_row(c)
            r["tokens"] += tokens
            r["loss_tokens"] += loss
        for key, value in res.fidelity.items():
            self.stats[key] += value
        for reason in ("reasoning_not_rendered", "reasoning_dropped"):  # kept records, pieces not trained
            if res.fidelity.get(reason):
                self._count_lost(reason, 1, res.fidelity[f"{reason}_chars"])

    def merge(self, other: "TokenizeTally") -> None:
        """Add the tally of the records that follow this one's."""
        for key in ("n_in", "n_out", "n_truncated", "n_plain", "n_tokens", "n_loss", "n_turns", "n_rows", "n_stored",
                    "n_records"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for key, value in other.media.items():
            self.media[key] += value
        for reason, n in other.dropped.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + n
        for reason, sources in other.dropped_at.items():
            self._add_sources(reason, sources)
        for c, counters in other.cats.items():
            row = self._cat_row(c)
            for key, value in counters.items():
                if key == "dropped":
                    for reason, n in value.items():
                        row["dropped"][reason] = row["dropped"].get(reason, 0) + n
                else:
                    row[key] += value
        for c, name in other.names.items():
            self._name(c, name)
        for key, value in other.stats.items():
            self.stats[key] += value
        for reason, (records, chars) in other.lost.items():
            self._count_lost(reason, records, chars)


# ---------------------------------------------------------------------------------------------- workers
_WORKER: dict = {}  # this process's TokenizeContext and config (`init_tokenize_worker`)


def init_tokenize_worker(cfg_dict: dict) -> None:
    """Worker set-up (`Executor.map`'s `setup`, once per process): this process's TokenizeContext and config, from
    a `to_dict` config. A pool's worker encodes on one thread (the workers are the parallelism); with one worker
    the tasks run in the driver's own process, whose tokenizer may use the cores."""
    from common.config import from_dict

    if multiprocessing.parent_process() is not None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    cfg = from_dict(DataConfig, cfg_dict)
    _WORKER["ctx"] = TokenizeContext.from_config(cfg)
    _WORKER["cfg"] = cfg


@dataclass(frozen=True)
class RangeTask:
    """A byte range of merged.jsonl to tokenize: its records are numbered after `records_before` records and its
    lines after `lines_before` lines (record indices and `path:line` sources of the whole file); its kept rows go
    to the dataset `part`."""
    lines: ByteRange
    records_before: int
    lines_before: int
    part: str


@dataclass
class RangeResult:
    """A tokenized range: its tally, its bytes of merged.jsonl, and its part (None: no record kept; else
    `tally.n_rows` rows of `tally.n_stored` tokens)."""
    tally: TokenizeTally
    n_bytes: int
    part: str | None


def tokenize_range(task: RangeTask) -> RangeResult:
    """Worker: tokenize a range's records, a batch encode per BATCH_RECORDS, count them and write the kept ones to
    the part. A bad record that the policy makes fatal is raised (the executor raises it in range order)."""
    ctx, cfg = _WORKER["ctx"], _WORKER["cfg"]
    path = task.lines.path
    lines = [(lineno, line) for lineno, line in enumerate(read_lines(path, task.lines.start, task.lines.end),
                                                         task.lines_before + 1) if line.strip()]
    tally = TokenizeTally()
    with ShardWriter(task.part, token_fields=token_fields(cfg), max_shard_bytes=PART_SHARD_BYTES,
                     kind="tokenized", durable=False, media=is_processor_dir(cfg.tokenizer_path)) as writer:
        for first in range(0, len(lines), BATCH_RECORDS):
            batch = lines[first:first + BATCH_RECORDS]
            sources = [f"{path}:{lineno}" for lineno, _ in batch]
            records = [parse_jsonl_line(line, src, require_object=False) for (_, line), src in zip(batch, sources)]
            indices = list(range(task.records_before + first, task.records_before + first + len(batch)))
            tally.add_results(tokenize_records(records, ctx, sources, indices), writer, cfg)
            tally.n_records += len(records)
        if not tally.n_rows:
            return RangeResult(tally, task.lines.end - task.lines.start, None)
        writer.close()
    return RangeResult(tally, task.lines.end - task.lines.start, task.part)


@dataclass(frozen=True)
class RowSegment:
    """Rows `[start, end)` of the part dataset `part`."""
    part: str
    start: int
    end: int


@dataclass(frozen=True)
class ShardTask:
    """One shard of tokenized/: its rows, segments of parts in order, written as a dataset of its own at `out`."""
    segments: tuple[RowSegment, ...]
    out: str
    token_fields: tuple[str, ...]
    max_shard_bytes: int
    media: bool  # a media store


def write_shard(task: ShardTask) -> str:
    """Worker: one shard of tokenized/, the segments' rows copied (`ShardWriter.add_rows`) into a dataset of its
    own at `task.out` (for `ShardWriter.append_dataset`)."""
    with ShardWriter(task.out, token_fields=task.token_fields, max_shard_bytes=task.max_shard_bytes,
                     kind="tokenized", media=task.media) as writer:
        for segment in task.segments:
            writer.add_rows(PackedDataset(segment.part, verify="off"), segment.start, segment.end)
        writer.close()
    return task.out


class ShardPlan:
    """tokenized/'s shards over the parts, cut by the writer's rule (`ShardCutter`) as the parts come in order,
    from their byte sizes alone: a part's row sizes are read (from the part) only when a cut falls inside it. The
    driver holds a few values per part and shard, nothing per row."""

    def __init__(self, writer: ShardWriter):
        self.writer = writer
        self.cutter = ShardCutter(writer.max_shard_bytes)
        self.shards: list[list[RowSegment]] = [[]]

    def add(self, part: str, rows: int, tokens: int, media_bytes: int = 0) -> None:
        """The next part: `rows` rows of `tokens` tokens and `media_bytes` of media in all."""
        cuts = self.cutter.cut_lazily(tokens * self.writer.dtype.itemsize + media_bytes,
                                      lambda: PackedDataset(part, verify="off").row_nbytes())
        for j, (start, end) in enumerate(zip([0, *cuts], [*cuts, rows])):
            if j:  # a run after a cut starts a shard (the first may be empty: a cut before the first row)
                self.shards.append([])
            if end > start:
                self.shards[-1].append(RowSegment(part, start, end))

    def tasks(self, scratch: Path) -> Iterator[ShardTask]:
        """A `write_shard` task per shard, in order (writing under `scratch`)."""
        for k, segments in enumerate(self.shards):
            if segments:
                yield ShardTask(tuple(segments), str(scratch / f"shard_{k:08d}"), tuple(self.writer.token_fields),
                                self.writer.max_shard_bytes, self.writer.media)


def token_fields(cfg: DataConfig) -> list[str]:
    """The token fields of tokenized/: the structure mode's too when it is on."""
    return list(REQUIRED_TOKEN_FIELDS) + (list(STRUCTURE_TOKEN_FIELDS) if cfg.structure else []) + (
        list(TREE_TOKEN_FIELDS) if cfg.stepwise == "tree" else [])


def tokenize_ranges(cfg: DataConfig, executor: Executor, parts: Path) -> Iterator[RangeResult]:
    """Each range's result in file order: the workers count the lines of byte ranges of merged.jsonl (so that
    record indices and line numbers are those of the whole file), then tokenize each range into a part under
    `parts`."""
    ranges = spread_ranges(cfg.merged_path, executor.workers, RANGE_BYTES)
    with contextlib.closing(executor.map(count_lines, ranges)) as done:
        counts = list(done)

    def tasks() -> Iterator[RangeTask]:
        records_before = lines_before = 0
        for lines, count in zip(ranges, counts):
            if count.records:
                yield RangeTask(lines, records_before, lines_before, str(parts / f"part_{lines.index:08d}"))
            records_before += count.records
            lines_before += count.lines

    with contextlib.closing(executor.map(tokenize_range, tasks(),
                                         setup=functools.partial(init_tokenize_worker, to_dict(cfg)))) as done:
        yield from done


def run(cfg: DataConfig, executor: Executor | None = None) -> dict:
    """Tokenize cfg.merged_path into cfg.tokenized_dir on `executor` (default: `cfg.workers` local processes);
    returns the stage's report section.

    The workers tokenize byte ranges of merged.jsonl, each written as a part with its tally; the driver adds the
    tallies up in range order and plans tokenized/'s shards from the parts' sizes (`ShardPlan`); the workers
    re-cut the parts into those shards, which the driver appends in order: the bytes of one writer adding every
    kept row in file order, whatever the engine and worker count.

    Bad records follow `on_error` (raise, or count under their reason); overlong ones follow
    `cfg.effective_overlong` (`error` raises whatever on_error says, the others count or truncate).
    """
    if not Path(cfg.merged_path).is_file():
        raise ConfigError(f"tokenize: input {cfg.merged_path} does not exist (run the merge stage first)")
    ctx = TokenizeContext.from_config(cfg)  # fails early on a tokenizer without template
    executor = executor or LocalExecutor(cfg.workers)
    writer = ShardWriter(cfg.tokenized_dir, token_fields=token_fields(cfg),
                         max_shard_bytes=cfg.pack.shard_size_mb << 20, kind="tokenized",
                         media=is_processor_dir(cfg.tokenizer_path))
    tally = TokenizeTally()
    plan = ShardPlan(writer)
    with writer, executor.scratch(Path(cfg.tokenized_dir).parent, "tokenize-parts") as scratch:
        with progress(total=os.path.getsize(cfg.merged_path), unit="B", unit_scale=True, desc="tokenize") as bar, \
                contextlib.closing(tokenize_ranges(cfg, executor, scratch)) as ranges:  # an error stops the workers
            for done in ranges:
                tally.merge(done.tally)
                bar.update(done.n_bytes)
                if done.part is not None:
                    plan.add(done.part, done.tally.n_rows, done.tally.n_stored, done.tally.media_bytes)
        if tally.n_out == 0:
            raise ConfigError(f"tokenize: no record of {cfg.merged_path} survived ({tally.n_in} in, dropped "
                              f"{sorted_counts(tally.dropped)})")
        cats, names = tally.cats, tally.names
        for c, row in cats.items():
            row["name"] = names.get(c, str(c))
            row["dropped"] = sorted_counts(row["dropped"])
        emptied, warnings = category_losses(cats, names, cfg.category_loss_warning)
        section = check_arithmetic({
            "in": tally.n_in,
            "out": tally.n_out,
            "dropped": sorted_counts(tally.dropped),
            "dropped_at": sorted_counts(tally.dropped_at),
            "truncated": tally.n_truncated,
            "structure_kept_plain": tally.n_plain,
            "overlong_policy": cfg.effective_overlong,
            "max_length": cfg.max_length,
            "tokens": tally.n_tokens,
            "loss_tokens": tally.n_loss,
            "trained_turns": tally.n_turns,
            **media_section(tally.media),
            "categories": {str(c): cats[c] for c in sorted(cats)},
            "category_loss_warning": cfg.category_loss_warning,
            "warnings": warnings,
            **fidelity_section(tally.stats, tally.lost, ctx),
            **({"stepwise": stepwise_section(cfg, tally)} if cfg.stepwise != "off" else {}),
        })
        print(format_tokenize_summary(section), flush=True)
        if emptied:  # before tokenized/ is replaced: the previous output stays
            raise ConfigError(f"tokenize: {'; '.join(emptied)}: nothing of {'it' if len(emptied) == 1 else 'them'} "
                              f"would be trained (max_length {cfg.max_length}, overlong: {cfg.effective_overlong}, "
                              f"on_error: {cfg.on_error}). Raise max_length, fix the records, or set the "
                              f"sample_rate to 0 in {cfg.ratio_file} to leave a category out on purpose")
        with contextlib.closing(executor.map(write_shard, plan.tasks(scratch))) as shards:
            for shard in shards:
                writer.append_dataset(shard)
        categories_meta = {c: names.get(c, str(c)) for c in sorted(cats)}
        writer.close({
            "tokenizer_path": os.path.abspath(cfg.tokenizer_path),  # the trainer exports it, from any directory
            "tokenizer_hash": tokenizer_hash(cfg.tokenizer_path),
            "chat_template": cfg.chat_template,
            "chat_template_hash": chat_template_hash(cfg.chat_template),
            "template": {"header": ctx.info.header, "end_of_turn": ctx.info.end_of_turn},
            "max_length": cfg.max_length,
            "config": output_config(cfg),
            "categories": categories_meta,
            **({"media": media_meta(cfg)} if tally.n_media else {}),
        })
    update_report(cfg.report_path, "tokenize", section)
    return section


def stepwise_section(cfg: DataConfig, tally: TokenizeTally) -> dict:
    """report.json's `stepwise`: the records expanded, the samples (steps) they gave, the sequences and tokens
    stored, and the tokens the prefix trees saved against storing every sample (`tokens`, the expansion's)."""
    return {"mode": cfg.stepwise, "records": tally.n_records, "samples": tally.n_in, "samples_kept": tally.n_out,
            "sequences": tally.n_rows, "sample_tokens": tally.n_tokens, "tokens_stored": tally.n_stored,
            "tokens_saved": tally.n_tokens - tally.n_stored}


def media_settings(cfg: DataConfig) -> MediaSettings:
    """The media settings of a data config: its processor directory and media keys."""
    return MediaSettings(os.path.abspath(cfg.tokenizer_path), **{k: getattr(cfg, k) for k in MediaSettings.keys()})


def media_meta(cfg: DataConfig) -> dict:
    """meta.json's `media`: what the trainer's media loader (data/shards/media.py) needs to turn the stored bytes into
    the processor's inputs the tokenize stage counted tokens for (the files' bytes are stored, `encoded`)."""
    return {**dataclasses.asdict(media_settings(cfg)), "storage": "encoded"}


def media_section(counts: dict) -> dict:
    """report.json's media counts of the kept records: `images` always (images, tokens, bytes), `videos` and
    `audios` where there are some (with their seconds; a video's sound track counted with the video)."""
    out = {"images": {"images": counts["images"], "image_tokens": counts["image_tokens"],
                      "image_bytes": counts["image_bytes"]}}
    if counts["videos"]:
        out["videos"] = {"videos": counts["videos"], "video_tokens": counts["video_tokens"],
                         "video_bytes": counts["video_bytes"], "video_seconds": counts["video_millis"] / 1000,
                         "with_audio": counts["videos_with_audio"]}
    if counts["audios"]:
        out["audios"] = {"audios": counts["audios"], "audio_tokens": counts["audio_tokens"],
                         "audio_bytes": counts["audio_bytes"], "audio_seconds": counts["audio_millis"] / 1000}
    return out


def category_losses(cats: dict[int, dict], names: dict[int, str], threshold: float) -> tuple[list[str], list[str]]:
    """(categories that lost every record, categories that lost more than `threshold` of them), as sentences
    naming the category and the drop reasons. A category no record names (only unreadable lines count under it)
    is not judged: it is not a category of the data."""
    emptied, warnings = [], []
    for cid in sorted(cats):
        row = cats[cid]
        lost = row["before"] - row["after"]
        if cid not in names or not lost:
            continue
        reasons = ", ".join(f"{reason} {n}" for reason, n in row["dropped"].items())
        if not row["after"]:
            emptied.append(f"category {names[cid]!r} (id {cid}) lost all its {row['before']} records ({reasons})")
        elif lost > threshold * row["before"]:
            warnings.append(f"category {names[cid]!r} (id {cid}) lost {lost} of its {row['before']} records "
                            f"({lost / row['before']:.0%}: {reasons}), more than category_loss_warning "
                            f"{threshold:g}")
    return emptied, warnings


def fidelity_section(stats: dict, lost: dict, ctx: TokenizeContext) -> dict:
    """report.json keys for what the kept records train (`reasoning`, `tool_calls`, `trained_chars`) and what
    the input asked to train but is not trained (`lost`: per reason, records and characters)."""
    def pair(key: str) -> dict:
        return {"messages": stats[key], "chars": stats[f"{key}_chars"]}

    return {
        "trained_chars": {"messages": stats["trained_messages"], "content": stats["content_chars"],
                          "reasoning": stats["reasoning_chars"] - stats["reasoning_not_rendered_chars"]
                          - stats["reasoning_dropped_chars"], "tool_calls": stats["tool_call_chars"]},
        "reasoning": {"policy": ctx.reasoning, "tags": list(ctx.reasoning_tags),
                      "template_renders_reasoning": ctx.renders_reasoning,
                      "messages": stats["reasoning_messages"], "chars": stats["reasoning_chars"],
                      "by_template": pair("reasoning_by_template"), "inlined": pair("reasoning_inlined"),
                      "not_rendered": pair("reasoning_not_rendered"), "dropped": pair("reasoning_dropped")},
        "tool_calls": {"arguments": ctx.tool_arguments, "calls": stats["tool_calls"],
                       "arguments_parsed": stats["tool_arguments_parsed"]},
        "lost": {reason: {"records": lost[reason][0], "chars": lost[reason][1]} for reason in sorted(lost)},
    }


if __name__ == "__main__":
    from data.pipeline import cli_main

    cli_main(run, "tokenize")
