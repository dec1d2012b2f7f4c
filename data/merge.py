"""Stage 3: loss_turns and pseudo-multiturn merging, sampled.jsonl -> merged.jsonl.

1. `loss_turns: last` (rllm's stepwise mode) keeps label 1 only on the last labelled assistant message of each
   ORIGINAL record, before any merging, so with pseudo-multiturn it still applies per original record.
2. Pseudo-multiturn: walking the records in order, each record is appended to the current group with
   probability `merge.probability` (each record's own draw from (seed, its index among the records): `join_draws`;
   chains form), unless a rule blocks it:
   - system prompt: the conversation keeps the group's first system prompt. A record whose system prompt is
     identical to it is appended without its system message (a duplicate adds nothing); a record with a
     different system prompt, or with one when the group has none, is not merged, because a second system
     prompt mid-conversation would be a new instruction the first part never saw (and is invalid canonical);
   - tools / enable_thinking / structure must be equal: a chat template renders one of each per conversation;
   - a record with media (images, videos, audio) is never merged (neither joins nor is joined): it stays a
     conversation of its own, as transformers' composite forward sees it with its media (counted as blocked by
     `media`);
   - token budget (`merge.max_tokens`, default `max_length`): the summed template token counts of the
     group's records must fit. Counts are per original record (each with its own template overhead and
     system prompt, rendered as the tokenize stage renders it alone: data.fidelity.render_record), so the sum
     is an upper bound of the merged rendering;
   - a record that the tokenize stage would reject on its own (invalid, template error, lost content or tool
     calls, empty turn, ...) is never merged (`record_error`), so it cannot take its group's records with it.
   Every message of a merged record carries its own `category_id`; `meta.uids` lists the originals in order and
   `meta.parts` where each starts (`start`: index of its first message; `system`: it had the group's system
   prompt), which lets the tokenize stage render every assistant turn as in its original record alone.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from common.config import ConfigError
from data.chat_template import RenderBound, analyze_template, load_chat_tokenizer
from data.config import DataConfig
from data.fidelity import FidelityOptions, render_record, template_renders_reasoning
from data.executor import ByteRange, Executor, LocalExecutor, Part, byte_ranges, count_lines, spread_ranges
from data.io import read_lines, require_stage_input
from data.records import RecordError, has_media, validate_canonical
from data.preflight import tokenizer_identity
from data.progress import progress
from data.randomness import MERGE_JOIN, record_uniforms
from data.report import ReportError, check_arithmetic, sorted_counts, update_report


# ---------------------------------------------------------------------------------------------- pure core
def apply_loss_turns(record: dict, loss_turns: str) -> int:
    """`last`: only the last label-1 message keeps its label (in place). Returns how many labels were zeroed."""
    if loss_turns == "all":
        return 0
    if loss_turns != "last":
        raise ConfigError(f"loss_turns must be 'all' or 'last', got {loss_turns!r}")
    labels = record["labels"]
    trained = [i for i, lab in enumerate(labels) if lab]
    for i in trained[:-1]:
        labels[i] = 0
    return max(len(trained) - 1, 0)


def system_prompt(record: dict) -> str | None:
    first = record["messages"][0]
    return first["content"] if first["role"] == "system" else None


MERGE_KEYS = ("system_prompt", "tools", "enable_thinking", "structure")


def _canonical(value):
    """A JSON value whose canonical serialization is equal exactly when the values are == in Python: bools as
    ints, integral floats as ints, object keys sorted at serialization."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63:
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _digest(value) -> int:
    encoded = orjson.dumps(_canonical(value), option=orjson.OPT_SORT_KEYS)
    return int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "little")


def merge_key(record: dict) -> tuple[int, ...]:
    """What the merge rules compare of a record (`MERGE_KEYS`), as 64-bit digests of canonical JSON (equal when
    the values are ==; a collision is a 2^-64 event), so that engines can ship 40 bytes instead of the record.
    The system prompt's digest is 0 when the record has none (never otherwise); the last value is 1 for a record
    with media (never merged)."""
    sys = system_prompt(record)
    return ((_digest(sys) | 1) if sys is not None else 0, _digest(record.get("tools")),
            _digest(record.get("enable_thinking")), _digest(record.get("structure")), int(has_media(record)))


def block_reason(head_key: tuple, group_tokens: int | None, key: tuple, tokens: int | None,
                 budget: int | None) -> str | None:
    """Why a record (its `merge_key` and token count) may not join the group with head `head_key` (None: it
    may); see the module docstring for the rules. A token count of None marks a record that fails on its own
    (the group's count is None when its head does)."""
    if key[-1] or head_key[-1]:
        return "media"
    if budget is not None and (tokens is None or group_tokens is None):
        return "record_error"
    if key[0] and key[0] != head_key[0]:
        return "system_prompt"
    for name, a, b in zip(MERGE_KEYS[1:], head_key[1:-1], key[1:-1]):
        if a != b:
            return name
    if budget is not None and group_tokens + tokens > budget:
        return "token_budget"
    return None


class GroupDecider:
    """The merge decision, record by record in file order, of every engine: `starts_group(join draw, token count,
    merge_key)` says whether the record starts a new group (else it joins the current one); `blocked` counts
    why joins were refused."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.blocked: dict[str, int] = {}
        self.head_key: tuple | None = None
        self.group_tokens: int | None = 0

    def starts_group(self, join: bool, tokens: int | None, key: tuple | None) -> bool:
        if join:
            reason = block_reason(self.head_key, self.group_tokens, key, tokens, self.budget)
            if reason is None:
                self.group_tokens += tokens
                return False
            self.blocked[reason] = self.blocked.get(reason, 0) + 1
        self.head_key, self.group_tokens = key, tokens
        return True


def merge_records(group: list[dict]) -> dict:
    """Concatenate a group into one record; a single record is returned unchanged."""
    if len(group) == 1:
        return group[0]
    head = group[0]
    messages, labels, uids, copies, parts = [], [], [], [], []
    for k, rec in enumerate(group):
        cat = rec["meta"].get("category_id", 0)
        own_system = system_prompt(rec) is not None
        parts.append({"start": len(messages), "system": own_system})
        start = 1 if k > 0 and own_system else 0  # equal to the head's (merge rule)
        for msg, lab in zip(rec["messages"][start:], rec["labels"][start:]):
            if msg.get("category_id") is None:
                msg = {**msg, "category_id": cat}
            messages.append(msg)
            labels.append(lab)
        uids.append(rec["meta"].get("uid"))
        copies.append(rec["meta"].get("copy", 0))
    meta = {"category_id": head["meta"].get("category_id", 0),
            "category_name": head["meta"].get("category_name"), "uids": uids, "parts": parts}
    if any(copies):
        meta["copies"] = copies
    out = {"messages": messages, "labels": labels, "meta": meta}
    for key in ("tools", "enable_thinking", "structure"):
        if key in head:
            out[key] = head[key]
    return out


# ---------------------------------------------------------------------------------------------- token counts
_TOKENIZER = None
_TOKENIZER_KEY = None


TokenizerKey = tuple[str, str | None, float | None]  # tokenizer_path, chat_template, render_timeout


def _tokenizer(key: TokenizerKey):
    """Per-process tokenizer (inherited from the parent under fork, loaded on first use otherwise)."""
    global _TOKENIZER, _TOKENIZER_KEY
    if _TOKENIZER is None or _TOKENIZER_KEY != key:
        _TOKENIZER, _TOKENIZER_KEY = load_chat_tokenizer(*key), key
    return _TOKENIZER


@functools.lru_cache(maxsize=4)
def _template(tokenizer, bound: RenderBound) -> tuple:
    """(TemplateInfo, renders reasoning) of a tokenizer's chat template, probed once per process."""
    return analyze_template(tokenizer, bound), template_renders_reasoning(tokenizer)


def count_tokens_batch(tokenizer, records: list[dict], opts: FidelityOptions, sources: list[str] | None = None,
                       bound: RenderBound = RenderBound(None, "the chat template")) -> list[int | None]:
    """Token count of each record rendered alone exactly as the tokenize stage renders it, or None for a record
    that stage rejects before encoding (it is then never merged). A record (`sources`: where each is) that the
    template renders for longer than `bound` is a ConfigError naming both."""
    info, renders_reasoning = _template(tokenizer, bound)
    texts: list[str | None] = []
    for rec, source in zip(records, sources or [f"record {k}" for k in range(len(records))]):
        try:
            with bound.rendering(source):
                texts.append(render_record(tokenizer, info, validate_canonical(rec, source), opts, renders_reasoning,
                                           source).text)
        except RecordError:
            texts.append(None)
    encoded = tokenizer.backend_tokenizer.encode_batch([t for t in texts if t is not None], add_special_tokens=False)
    lengths = iter(len(enc.ids) for enc in encoded)
    return [None if t is None else next(lengths) for t in texts]


def prepare_records(records: list[dict], needed: list[bool], loss_turns: str, tokenizer_key: TokenizerKey,
                    opts: FidelityOptions, sources: list[str]) -> tuple[list[int], list[int | None], list[tuple | None]]:
    """Apply loss_turns (in place) and compute what the merge decision needs of each record (`sources`: where each
    is): (labels zeroed, token count, `merge_key`) lists. Count and key are None where not `needed`
    (`needs_counts`); a count is None too when the record fails on its own (then it is never merged:
    `block_reason`)."""
    zeroed = [apply_loss_turns(rec, loss_turns) for rec in records]
    counts: list[int | None] = [None] * len(records)
    wanted = [i for i, need in enumerate(needed) if need]
    if wanted:
        tok = _tokenizer(tokenizer_key)
        bound = RenderBound.of(*tokenizer_key)
        for i, n in zip(wanted, count_tokens_batch(tok, [records[i] for i in wanted], opts,
                                                   [sources[i] for i in wanted], bound)):
            counts[i] = n
    keys = [merge_key(rec) if need else None for rec, need in zip(records, needed)]
    return zeroed, counts, keys


def needs_counts(joins: list[bool], next_join: bool) -> list[bool]:
    """A record's token count and merge key are needed only when it tries to join the previous group or the next
    record tries to join it (`next_join`: the draw of the record after the last one); a record that does neither
    is a group of its own whatever they are."""
    return [j or nj for j, nj in zip(joins, joins[1:] + [next_join])]


def join_draws(seed: int, probability: float, first: int, count: int) -> np.ndarray:
    """Whether each of records `first .. first + count - 1` (indices among sampled.jsonl's non-blank lines) tries
    to join the group before it: its own draw from (seed, index) is below `probability`. Record 0 never does."""
    joins = record_uniforms(seed, MERGE_JOIN, np.arange(first, first + count, dtype=np.uint64)) < probability
    if first == 0 and count:
        joins[0] = False
    return joins


# ---------------------------------------------------------------------------------------------- worker tasks
MERGE_RANGE_BYTES = 1 << 20  # sampled.jsonl bytes per worker task at most (`executor.spread_ranges`)
COPY_RANGE_BYTES = 16 << 20  # the same with probability 0 (a plain copy: fewer, larger parts)


@dataclasses.dataclass(frozen=True)
class MergeSettings:
    """What the workers need of the config."""
    seed: int
    probability: float
    budget: int | None
    loss_turns: str
    tokenizer_key: TokenizerKey | None
    opts: FidelityOptions


@dataclasses.dataclass(frozen=True)
class CopyTask:
    """probability 0: copy a range's records to `part` with loss_turns applied."""
    range: ByteRange
    part: str
    loss_turns: str


@dataclasses.dataclass(frozen=True)
class CopiedPart:
    part: Part
    records: int
    zeroed: int


def copy_records(task: CopyTask) -> CopiedPart:
    """Worker: every record of the range as a group of its own (loss_turns applied), written as a part."""
    zeroed = n = 0
    with open(task.part, "wb") as out:  # a scratch part (not synced: merged.jsonl, built from it, is)
        for line in read_lines(task.range.path, task.range.start, task.range.end):
            if line.strip():
                rec = orjson.loads(line)
                zeroed += apply_loss_turns(rec, task.loss_turns)
                out.write(orjson.dumps(rec) + b"\n")
                n += 1
    return CopiedPart(Part.written(task.part), n, zeroed)


@dataclasses.dataclass(frozen=True)
class DecideTask:
    """Decide and write the groups of a range: `first_record` is the index of its first record, `lines_before` the
    lines of the file before it, `last` says no record follows it; `part`: where the groups the range decides alone
    go."""
    range: ByteRange
    first_record: int
    lines_before: int
    last: bool
    part: str
    settings: MergeSettings


@dataclasses.dataclass(frozen=True)
class OpenGroup:
    """The group open at a range's end as the range's own records decide it: its head's `merge_key`, its summed
    token count (None when its head fails on its own), its records in the range and the byte offset of its first."""
    head_key: tuple
    tokens: int | None
    records: int
    offset: int


@dataclasses.dataclass(frozen=True)
class RangeDecisions:
    """What the driver needs of a range. Its prefix (its records before the first that does not try to join: every
    one of them tries) is decided by the driver against the group carried over from earlier ranges, from their
    token counts and merge keys. Every later record depends on the range alone: the worker decided those and
    wrote the groups that end in the range (`part`, None when there are none: `group_sizes`, and the `blocked`
    joins among them); `open_group` is the state they leave (None when the whole range is prefix)."""
    records: int
    zeroed: int
    prefix_tokens: list[int | None]
    prefix_keys: list[tuple]
    open_group: OpenGroup | None
    part: Part | None
    blocked: dict[str, int]
    group_sizes: dict[int, int]


def decide_groups(task: DecideTask) -> RangeDecisions:
    """Worker: draws, loss_turns, token counts (only those the decision needs) and merge keys of a range's records
    (`prepare_records`), then `GroupDecider` from its first record that does not try to join on; the groups it
    decides that end in the range are written as a part (atomically: a retried task rewrites it)."""
    s, r = task.settings, task.range
    lines = read_lines(r.path, r.start, r.end)
    offsets = list(itertools.accumulate((len(line) for line in lines), initial=r.start))
    at = [offsets[i] for i, line in enumerate(lines) if line.strip()]  # each record's byte offset
    records = [orjson.loads(line) for line in lines if line.strip()]
    sources = [f"{r.path}:{task.lines_before + i + 1}" for i, line in enumerate(lines) if line.strip()]
    n = len(records)
    joins = join_draws(s.seed, s.probability, task.first_record, n + 1).tolist()  # and the next record's draw
    next_join = joins.pop() and not task.last
    zeroed, counts, keys = prepare_records(records, needs_counts(joins, next_join), s.loss_turns, s.tokenizer_key,
                                           s.opts, sources)
    own = joins.index(False) if False in joins else n  # the prefix's end
    decider = GroupDecider(s.budget)
    starts = [i for i in range(own, n) if decider.starts_group(joins[i], counts[i], keys[i])]
    part = None
    if len(starts) > 1:  # groups that end in the range (the last one is still open)
        with open(task.part, "wb") as out:  # a scratch part
            for start, end in zip(starts, starts[1:]):
                out.write(orjson.dumps(merge_records(records[start:end])) + b"\n")
        part = Part.written(task.part)
    return RangeDecisions(
        records=n, zeroed=sum(zeroed), prefix_tokens=counts[:own], prefix_keys=keys[:own],
        open_group=(OpenGroup(decider.head_key, decider.group_tokens, n - starts[-1], at[starts[-1]])
                    if starts else None),
        part=part, blocked=decider.blocked, group_sizes=dict(collections.Counter(np.diff(starts).tolist())))


@dataclasses.dataclass(frozen=True)
class SpanTask:
    """Groups of `sizes` records each, read on from byte `offset` of `path` (blank lines skipped), to write as
    `part`: the groups the driver linked between two ranges' own parts."""
    path: str
    offset: int
    sizes: tuple[int, ...]
    part: str
    loss_turns: str


def write_span(task: SpanTask) -> Part:
    """Worker: the merged records (`merge_records`, loss_turns applied) of a span's groups, written as a part (a
    retried task rewrites it)."""
    with open(task.path, "rb") as f, open(task.part, "wb") as out:
        f.seek(task.offset)
        lines = (line for line in f if line.strip())
        for size in task.sizes:
            group = [orjson.loads(next(lines)) for _ in range(size)]
            for rec in group:
                apply_loss_turns(rec, task.loss_turns)
            out.write(orjson.dumps(merge_records(group)) + b"\n")
    return Part.written(task.part)


# ---------------------------------------------------------------------------------------------- driver
@dataclasses.dataclass
class Span:
    """The groups from a range's open group up to the next range's own groups, as the driver links them: the
    record count of each (the last still growing while `GroupLinker` walks on); `own_part`: that range's part
    (`RangeDecisions.part`), which comes just before the span in merged.jsonl."""
    offset: int
    own_part: Part | None
    sizes: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GroupLinker:
    """The driver's walk over the ranges' decisions in order: each prefix resolved against the group carried over
    (`GroupDecider` on prefix records only), the groups that reach across ranges collected as spans, the group
    sizes and blocked joins added up."""
    decider: GroupDecider
    spans: list[Span] = dataclasses.field(default_factory=list)
    group_sizes: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def link(self, decided: RangeDecisions) -> None:
        for tokens, key in zip(decided.prefix_tokens, decided.prefix_keys):
            if self.decider.starts_group(True, tokens, key):
                self.spans[-1].sizes.append(0)
            self.spans[-1].sizes[-1] += 1
        own = decided.open_group
        if own is not None:
            self.decider.head_key, self.decider.group_tokens = own.head_key, own.tokens
            self.spans.append(Span(own.offset, decided.part, [own.records]))
            self.group_sizes.update(decided.group_sizes)
            for reason, n in decided.blocked.items():
                self.decider.blocked[reason] = self.decider.blocked.get(reason, 0) + n

    def all_group_sizes(self) -> dict[int, int]:
        return dict(self.group_sizes + collections.Counter(n for span in self.spans for n in span.sizes))


def copy_all(executor: Executor, ranges: list[ByteRange], loss_turns: str, scratch: Path, out: Path
             ) -> tuple[int, int]:
    """probability 0: every record a group of its own, copied by the workers range by range with loss_turns
    applied (no tokenizer, no decision). Returns (records, labels zeroed)."""
    records = zeroed = 0

    def parts() -> Iterator[Part]:
        nonlocal records, zeroed
        tasks = [CopyTask(r, str(scratch / f"part_{r.index:08d}.jsonl"), loss_turns) for r in ranges]
        with progress(desc="merge", unit="rec") as bar:
            for copied in executor.map(copy_records, tasks):
                records += copied.records
                zeroed += copied.zeroed
                bar.update(copied.records)
                yield copied.part

    executor.concatenate(out, parts())
    return records, zeroed


def decide_and_write(executor: Executor, ranges: list[ByteRange], settings: MergeSettings, scratch: Path, out: Path
                     ) -> tuple[int, int, dict[str, int], dict[int, int]]:
    """The groups decided and written range by range, linked across ranges on the driver, the groups that reach
    across ranges written by the workers too; every part concatenated into `out` in order. Returns (records, labels
    zeroed, blocked joins by reason, groups by size)."""
    counted = list(executor.map(count_lines, ranges))
    counts = [c.records for c in counted]
    firsts = list(itertools.accumulate(counts, initial=0))
    lines_before = itertools.accumulate((c.lines for c in counted), initial=0)
    n_in = firsts[-1]
    tasks = [DecideTask(r, first, lines, first + n == n_in, str(scratch / f"own_{r.index:08d}.jsonl"), settings)
             for r, first, lines, n in zip(ranges, firsts, lines_before, counts)]
    linker = GroupLinker(GroupDecider(settings.budget))
    zeroed = 0
    with progress(total=n_in, desc="merge", unit="rec") as bar:
        for decided in executor.map(decide_groups, tasks):
            linker.link(decided)
            zeroed += decided.zeroed
            bar.update(decided.records)
    spans = [SpanTask(str(ranges[0].path), span.offset, tuple(span.sizes), str(scratch / f"span_{k:08d}.jsonl"),
                      settings.loss_turns) for k, span in enumerate(linker.spans)]

    def parts() -> Iterator[Part]:
        for span, written in zip(linker.spans, executor.map(write_span, spans)):
            if span.own_part is not None:
                yield span.own_part
            yield written

    executor.concatenate(out, parts())
    return n_in, zeroed, linker.decider.blocked, linker.all_group_sizes()


def run(cfg: DataConfig, executor: Executor | None = None) -> dict:
    """sampled.jsonl -> merged.jsonl on `executor` (default: the local engine); records the `merge` report section.

    The workers read sampled.jsonl by byte ranges. With a probability, each decides its range's groups from
    per-record draws (`join_draws`), writes those that end in the range, and returns only what the decision
    across ranges needs (`RangeDecisions`); the driver links the ranges (`GroupLinker`: the same `GroupDecider`
    rule, on the few records at each range's start that try to join a group of earlier ranges), and the workers
    write the groups that reach across ranges (`write_span`); the parts are appended in order. The result does
    not depend on the ranges, the worker count or the engine."""
    executor = executor or LocalExecutor(cfg.workers)
    probability = cfg.merge.probability
    budget = (cfg.merge.max_tokens or cfg.max_length) if probability > 0 else None
    if budget is not None and budget <= 0:
        raise ConfigError(f"merge.max_tokens must be positive, got {budget}")
    tokenizer_key = None
    if budget is not None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tokenizer_key = (str(cfg.tokenizer_path), cfg.chat_template, cfg.render_timeout)
        # fail early in the parent; forked workers inherit both
        _template(_tokenizer(tokenizer_key), RenderBound.of(*tokenizer_key))
    path = require_stage_input(cfg.sampled_path, "sample")
    with executor.scratch(cfg.merged_path.parent, "merge-parts") as scratch:
        if budget is None:
            n_in, zeroed = copy_all(executor, byte_ranges(path, COPY_RANGE_BYTES), cfg.loss_turns, scratch,
                                    cfg.merged_path)
            blocked, group_sizes = {}, ({1: n_in} if n_in else {})
        else:
            settings = MergeSettings(cfg.seed, probability, budget, cfg.loss_turns, tokenizer_key,
                                     FidelityOptions.from_config(cfg))
            ranges = spread_ranges(path, executor.workers, MERGE_RANGE_BYTES)
            n_in, zeroed, blocked, group_sizes = decide_and_write(executor, ranges, settings, scratch, cfg.merged_path)
    n_out = sum(group_sizes.values())
    section = {
        "in": n_in, "out": n_out,
        "dropped": {"merged_into_previous": n_in - n_out} if n_in > n_out else {},
        "probability": probability, "max_tokens": budget, "seed": cfg.seed,
        "blocked": sorted_counts(blocked),
        "group_sizes": {str(k): group_sizes[k] for k in sorted(group_sizes)},
        "loss_turns": cfg.loss_turns, "labels_zeroed_by_loss_turns": zeroed,
        "output": str(cfg.merged_path),
    }
    if tokenizer_key is not None:  # token counts decided the groups: tokenize must use the same tokenizer
        section.update(tokenizer_path=str(cfg.tokenizer_path), **tokenizer_identity(cfg))
    if sum(k * v for k, v in group_sizes.items()) != n_in:
        raise ReportError(f"merge groups cover {sum(k * v for k, v in group_sizes.items())} of {n_in} records")
    check_arithmetic(section)
    update_report(cfg.report_path, "merge", section)
    return section


if __name__ == "__main__":
    from data.pipeline import cli_main

    cli_main(run, "merge")
