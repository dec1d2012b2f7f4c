"""Stage 3: loss_turns and pseudo-multiturn merging, sampled.jsonl -> merged.jsonl.

1. `loss_turns: last` (rllm's stepwise mode) keeps label 1 only on the last labelled assistant message of each
   ORIGINAL record, before any merging, so with pseudo-multiturn it still applies per original record.
2. Pseudo-multiturn: walking the records in order, each record is appended to the current group with
   probability `merge.probability` (one seeded draw per record, so chains form), unless a rule blocks it:
   - system prompt: the conversation keeps the group's first system prompt. A record whose system prompt is
     identical to it is appended without its system message (a duplicate adds nothing); a record with a
     different system prompt, or with one when the group has none, is not merged, because a second system
     prompt mid-conversation would be a new instruction the first part never saw (and is invalid canonical);
   - tools / enable_thinking / structure must be equal: a chat template renders one of each per conversation;
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

import dataclasses
import functools
import hashlib
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson

from data.chat_template import analyze_template, load_chat_tokenizer
from data.config import ConfigError, DataConfig
from data.fidelity import FidelityOptions, render_record, template_renders_reasoning
from data.fsutil import atomic_writer
from data.io import ordered_parallel_map, require_stage_input
from data.records import RecordError, validate_canonical
from data.preflight import tokenizer_identity
from data.progress import progress
from data.report import ReportError, check_arithmetic, sorted_counts, update_report

CHUNK_RECORDS = 64


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


def merge_key(record: dict) -> tuple[int, int, int, int]:
    """What the merge rules compare of a record (`MERGE_KEYS`), as 64-bit digests of canonical JSON (equal when
    the values are ==; a collision is a 2^-64 event), so that engines can ship 32 bytes instead of the record.
    The system prompt's digest is 0 when the record has none (never otherwise)."""
    sys = system_prompt(record)
    return ((_digest(sys) | 1) if sys is not None else 0, _digest(record.get("tools")),
            _digest(record.get("enable_thinking")), _digest(record.get("structure")))


def block_reason(head_key: tuple, group_tokens: int | None, key: tuple, tokens: int | None,
                 budget: int | None) -> str | None:
    """Why a record (its `merge_key` and token count) may not join the group with head `head_key` (None: it
    may); see the module docstring for the rules. A token count of None marks a record that fails on its own
    (the group's count is None when its head does)."""
    if budget is not None and (tokens is None or group_tokens is None):
        return "record_error"
    if key[0] and key[0] != head_key[0]:
        return "system_prompt"
    for name, a, b in zip(MERGE_KEYS[1:], head_key[1:], key[1:]):
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


def _tokenizer(key: tuple[str, str | None]):
    """Per-process tokenizer (inherited from the parent under fork, loaded on first use otherwise)."""
    global _TOKENIZER, _TOKENIZER_KEY
    if _TOKENIZER is None or _TOKENIZER_KEY != key:
        _TOKENIZER, _TOKENIZER_KEY = load_chat_tokenizer(*key), key
    return _TOKENIZER


@functools.lru_cache(maxsize=4)
def _template(tokenizer) -> tuple:
    """(TemplateInfo, renders reasoning) of a tokenizer's chat template, probed once per process."""
    return analyze_template(tokenizer), template_renders_reasoning(tokenizer)


def count_tokens_batch(tokenizer, records: list[dict], opts: FidelityOptions) -> list[int | None]:
    """Token count of each record rendered alone exactly as the tokenize stage renders it, or None for a record
    that stage rejects before encoding (it is then never merged)."""
    info, renders_reasoning = _template(tokenizer)
    texts: list[str | None] = []
    for rec in records:
        try:
            texts.append(render_record(tokenizer, info, validate_canonical(rec, "merge"), opts, renders_reasoning,
                                       "merge").text)
        except RecordError:
            texts.append(None)
    encoded = tokenizer.backend_tokenizer.encode_batch([t for t in texts if t is not None], add_special_tokens=False)
    lengths = iter(len(enc.ids) for enc in encoded)
    return [None if t is None else next(lengths) for t in texts]


def prepare_records(records: list[dict], needs_count: list[bool], loss_turns: str, tokenizer_key,
                    opts: FidelityOptions, keyed: bool) -> tuple[list[int], list[int | None], list[tuple | None]]:
    """Apply loss_turns (in place) and compute what the merge decision needs of each record: (labels zeroed,
    token count, `merge_key`) lists. A count is None when it was not needed, or when the record fails on its own
    (then it is never merged: `block_reason`); keys are None when nothing merges (`keyed` false)."""
    zeroed = [apply_loss_turns(rec, loss_turns) for rec in records]
    counts: list[int | None] = [None] * len(records)
    wanted = [i for i, need in enumerate(needs_count) if need]
    if wanted:
        tok = _tokenizer(tokenizer_key)
        for i, n in zip(wanted, count_tokens_batch(tok, [records[i] for i in wanted], opts)):
            counts[i] = n
    keys = [merge_key(rec) for rec in records] if keyed else [None] * len(records)
    return zeroed, counts, keys


def needs_counts(joins: list[bool], next_join: bool, budget_active: bool) -> list[bool]:
    """A record's token count is needed only when it tries to join the previous group or the next record tries
    to join it (`next_join`: the draw of the record after the last one)."""
    following = joins[1:] + [next_join]
    return [budget_active and (j or nj) for j, nj in zip(joins, following)]


def join_draws(rng: random.Random, probability: float) -> Iterator[bool]:
    """The seeded merge draws, one per record in file order (none for the first record, and none at all when
    `probability` is 0): whether the record tries to join the previous group. Endless: callers stop."""
    yield False
    while True:
        yield probability > 0 and rng.random() < probability


def _prepare_chunk(task: tuple) -> list[tuple[dict, int, int | None, tuple | None, bool]]:
    """Worker: parse lines, then `prepare_records`. Returns (record, labels zeroed, token count, merge key,
    joins previous) per line."""
    lines, joins, needs_count, loss_turns, tokenizer_key, opts = task
    records = [orjson.loads(line) for line in lines]
    zeroed, counts, keys = prepare_records(records, needs_count, loss_turns, tokenizer_key, opts,
                                           any(needs_count))
    return list(zip(records, zeroed, counts, keys, joins))


def _tasks(path: Path, probability: float, rng: random.Random, budget_active: bool, loss_turns: str,
           tokenizer_key, opts: FidelityOptions):
    """Chunks of lines with their seeded merge draws (`join_draws`, drawn in file order, so independent of
    chunking and workers); the draw of the record after a chunk is read ahead."""
    lines: list[bytes] = []
    joins: list[bool] = []
    draws = join_draws(rng, probability)

    def task(next_join: bool) -> tuple:
        return lines, joins, needs_counts(joins, next_join, budget_active), loss_turns, tokenizer_key, opts

    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            join = next(draws)
            if len(lines) >= CHUNK_RECORDS:
                yield task(join)
                lines, joins = [], []
            lines.append(line)
            joins.append(join)
    if lines:
        yield task(False)


# ---------------------------------------------------------------------------------------------- stage
@dataclasses.dataclass
class MergeTotals:
    """What an engine's merge reports back: records in, labels zeroed by loss_turns, blocked joins by reason,
    groups by size."""
    n_in: int
    zeroed: int
    blocked: dict[str, int]
    group_sizes: dict[int, int]


def _merge_local(cfg: DataConfig, budget: int | None, tokenizer_key, opts: FidelityOptions) -> MergeTotals:
    """Local engine: chunks parsed and token-counted by `num_workers` processes, decided and written here."""
    n_in = zeroed_total = 0
    group_sizes: dict[int, int] = {}
    group: list[dict] = []
    decider = GroupDecider(budget)

    def flush(out) -> None:
        out.write(orjson.dumps(merge_records(group)) + b"\n")
        group_sizes[len(group)] = group_sizes.get(len(group), 0) + 1

    tasks = _tasks(require_stage_input(cfg.sampled_path, "sample"), cfg.merge.probability, random.Random(cfg.seed),
                   budget is not None, cfg.loss_turns, tokenizer_key, opts)
    with atomic_writer(cfg.merged_path) as out, progress(desc="merge", unit="rec") as bar:
        # nothing to count: parsing in this process is cheaper than shipping the lines
        workers = 1 if budget is None else cfg.workers
        for results in ordered_parallel_map(_prepare_chunk, tasks, workers):
            for rec, zeroed, tokens, key, join in results:
                n_in += 1
                zeroed_total += zeroed
                if decider.starts_group(join, tokens, key):
                    if group:
                        flush(out)
                    group = [rec]
                else:
                    group.append(rec)
            bar.update(len(results))
        if group:
            flush(out)
    return MergeTotals(n_in, zeroed_total, decider.blocked, group_sizes)


def run(cfg: DataConfig,
        merge_all: Callable[[DataConfig, int | None, tuple | None, FidelityOptions], MergeTotals] | None = None,
        executor=None) -> dict:
    """sampled.jsonl -> merged.jsonl; records the `merge` report section.

    `merge_all(cfg, budget, tokenizer_key, opts)` decides the groups with `GroupDecider` and writes merged.jsonl
    (default: `_merge_local`; the Ray engine passes its own)."""
    probability = cfg.merge.probability
    budget = (cfg.merge.max_tokens or cfg.max_length) if probability > 0 else None
    if budget is not None and budget <= 0:
        raise ConfigError(f"merge.max_tokens must be positive, got {budget}")
    tokenizer_key = None
    if budget is not None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tokenizer_key = (str(cfg.tokenizer_path), cfg.chat_template)
        _template(_tokenizer(tokenizer_key))  # fail early in the parent; forked workers inherit both
    totals = (merge_all or _merge_local)(cfg, budget, tokenizer_key, FidelityOptions.from_config(cfg))
    n_in, group_sizes = totals.n_in, totals.group_sizes
    n_out = sum(group_sizes.values())
    section = {
        "in": n_in, "out": n_out,
        "dropped": {"merged_into_previous": n_in - n_out} if n_in > n_out else {},
        "probability": probability, "max_tokens": budget, "seed": cfg.seed,
        "blocked": sorted_counts(totals.blocked),
        "group_sizes": {str(k): group_sizes[k] for k in sorted(group_sizes)},
        "loss_turns": cfg.loss_turns, "labels_zeroed_by_loss_turns": totals.zeroed,
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
