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

import functools
import os
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import orjson

from data.chat_template import analyze_template, load_chat_tokenizer
from data.config import ConfigError, DataConfig
from data.fidelity import FidelityOptions, render_record, template_renders_reasoning
from data.records import RecordError, validate_canonical
from data.io import atomic_writer, ordered_parallel_map, require_stage_input
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


def merge_block_reason(group: list[dict], group_tokens: int, record: dict, tokens: int | None,
                       budget: int | None) -> str | None:
    """Why `record` may not join `group` (None: it may); see the module docstring for the rules. A token count
    of None marks a record that fails on its own (the group's count is None when its head does)."""
    if budget is not None and (tokens is None or group_tokens is None):
        return "record_error"
    head = group[0]
    sys_head, sys_rec = system_prompt(head), system_prompt(record)
    if sys_rec is not None and sys_rec != sys_head:
        return "system_prompt"
    for key in ("tools", "enable_thinking", "structure"):
        if head.get(key) != record.get(key):
            return key
    if budget is not None and group_tokens + tokens > budget:
        return "token_budget"
    return None


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


def _prepare_chunk(task: tuple) -> list[tuple[dict, int, int | None, bool]]:
    """Worker: parse lines, apply loss_turns, count tokens of the records a merge decision needs.

    Returns (record, labels zeroed, token count, joins previous) per line; the count is None when it was not
    needed, or when the record fails on its own (then it is never merged: `merge_block_reason`).
    """
    lines, joins, needs_count, loss_turns, tokenizer_key, opts = task
    records = [orjson.loads(line) for line in lines]
    zeroed = [apply_loss_turns(rec, loss_turns) for rec in records]
    counts: list[int | None] = [None] * len(records)
    wanted = [i for i, need in enumerate(needs_count) if need]
    if wanted:
        tok = _tokenizer(tokenizer_key)
        for i, n in zip(wanted, count_tokens_batch(tok, [records[i] for i in wanted], opts)):
            counts[i] = n
    return list(zip(records, zeroed, counts, joins))


def _tasks(path: Path, probability: float, rng: random.Random, budget_active: bool, loss_turns: str,
           tokenizer_key, opts: FidelityOptions):
    """Chunks of lines with their seeded merge draws (one per record after the first, drawn in file order, so
    independent of chunking and workers). A record's token count is needed only when it tries to join the
    previous group or the next record tries to join it; the draw of the record after a chunk is read ahead."""
    lines: list[bytes] = []
    joins: list[bool] = []

    def task(next_join: bool) -> tuple:
        following = joins[1:] + [next_join]
        needs = [budget_active and (j or nj) for j, nj in zip(joins, following)]
        return lines, joins, needs, loss_turns, tokenizer_key, opts

    first = True
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            join = not first and probability > 0 and rng.random() < probability
            first = False
            if len(lines) >= CHUNK_RECORDS:
                yield task(join)
                lines, joins = [], []
            lines.append(line)
            joins.append(join)
    if lines:
        yield task(False)


# ---------------------------------------------------------------------------------------------- stage
def run(cfg: DataConfig, parallel_map: Callable[[Callable, Iterable], Iterator] | None = None) -> dict:
    """sampled.jsonl -> merged.jsonl; records the `merge` report section.

    `parallel_map(fn, chunks)` yields `fn(chunk)` in chunk order and counts the tokens (default:
    `ordered_parallel_map` over `num_workers` local processes; the Ray engine passes its own)."""
    probability = cfg.merge.probability
    budget = (cfg.merge.max_tokens or cfg.max_length) if probability > 0 else None
    if budget is not None and budget <= 0:
        raise ConfigError(f"merge.max_tokens must be positive, got {budget}")
    tokenizer_key = None
    if budget is not None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tokenizer_key = (str(cfg.tokenizer_path), cfg.chat_template)
        _template(_tokenizer(tokenizer_key))  # fail early in the parent; forked workers inherit both
    n_in = n_out = zeroed_total = 0
    blocked: dict[str, int] = {}
    group_sizes: dict[int, int] = {}
    group: list[dict] = []
    group_tokens = 0

    def flush(out) -> None:
        nonlocal n_out
        out.write(orjson.dumps(merge_records(group)) + b"\n")
        group_sizes[len(group)] = group_sizes.get(len(group), 0) + 1
        n_out += 1

    tasks = _tasks(require_stage_input(cfg.sampled_path, "sample"), probability, random.Random(cfg.seed), budget is not None, cfg.loss_turns,
                   tokenizer_key, FidelityOptions.from_config(cfg))
    with atomic_writer(cfg.merged_path) as out, progress(desc="merge", unit="rec") as bar:
        if budget is None:  # nothing to count: parsing in this process is cheaper than shipping the lines
            chunk_results = ordered_parallel_map(_prepare_chunk, tasks, 1)
        elif parallel_map is not None:
            chunk_results = parallel_map(_prepare_chunk, tasks)
        else:
            chunk_results = ordered_parallel_map(_prepare_chunk, tasks, cfg.workers)
        for results in chunk_results:
            for rec, zeroed, tokens, join in results:
                n_in += 1
                zeroed_total += zeroed
                if join:
                    reason = merge_block_reason(group, group_tokens, rec, tokens, budget)
                    if reason is None:
                        group.append(rec)
                        group_tokens += tokens
                        continue
                    blocked[reason] = blocked.get(reason, 0) + 1
                if group:
                    flush(out)
                group, group_tokens = [rec], tokens
            bar.update(len(results))
        if group:
            flush(out)
    section = {
        "in": n_in, "out": n_out,
        "dropped": {"merged_into_previous": n_in - n_out} if n_in > n_out else {},
        "probability": probability, "max_tokens": budget, "seed": cfg.seed,
        "blocked": sorted_counts(blocked),
        "group_sizes": {str(k): group_sizes[k] for k in sorted(group_sizes)},
        "loss_turns": cfg.loss_turns, "labels_zeroed_by_loss_turns": zeroed_total,
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
