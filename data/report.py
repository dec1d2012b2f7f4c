"""report.json: one section per stage, with record accounting that must add up exactly.

Every section has `in`, `out` and `dropped` ({reason: n}); stages that create records (sampling copies)
also have `added` ({reason: n}). The invariant checked for every stage is

    in + sum(added) == out + sum(dropped)

which for preprocess/tokenize/pack is `in == out + sum(dropped)`, for sample counts extra copies as added and
unselected records as dropped, and for merge counts records absorbed into a previous one as dropped
(`merged_into_previous`). A section with per-category rows (`categories`: {name: {before, after}}) must also
have them sum to `in` and `out`.
"""
from __future__ import annotations

import bisect
import os
from collections.abc import Callable

import orjson

from common.fsutil import atomic_write_bytes
from data.config import STAGES


class ReportError(AssertionError):
    """A stage's counts do not add up: a bug, never a user error."""


def check_arithmetic(section: dict) -> dict:
    """Raise ReportError unless the section's counts add up; returns the section."""
    for key in ("in", "out", "dropped"):
        if key not in section:
            raise ReportError(f"report section lacks {key!r}: {section}")
    dropped = sum(section["dropped"].values())
    added = sum(section.get("added", {}).values())
    if section["in"] + added != section["out"] + dropped:
        raise ReportError(
            f"counts do not add up: in {section['in']} + added {added} != out {section['out']} + dropped {dropped}"
        )
    cats = section.get("categories")
    if cats:
        before = sum(c["before"] for c in cats.values())
        after = sum(c["after"] for c in cats.values())
        if before != section["in"] or after != section["out"]:
            raise ReportError(
                f"per-category counts ({before} before, {after} after) differ from in={section['in']} "
                f"out={section['out']}"
            )
    return section


def read_report(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as f:
            return orjson.loads(f.read())
    except FileNotFoundError:
        return {}


def _write_report(path: str | os.PathLike, report: dict) -> None:
    atomic_write_bytes(path, orjson.dumps(report, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS) + b"\n")


def update_report(path: str | os.PathLike, stage: str, section: dict) -> dict:
    """Replace the `stage` section of report.json (read-modify-write, written atomically); returns the report.

    Sections of the stages after `stage` (pipeline order) move under `stale`: their outputs, still on disk, come
    from an earlier run that this stage's new output invalidates. Re-running such a stage takes its section back
    out of `stale`; a successful stage also clears the `failed` record of an earlier stage failure. So report.json
    always says what every output on disk is, whichever stage stops a run."""
    report = read_report(path)
    stale = report.pop("stale", {})
    report.pop("failed", None)
    if stage in STAGES:
        for later in STAGES[STAGES.index(stage) + 1:]:
            if later in report:
                stale[later] = report.pop(later)
    stale.pop(stage, None)
    report[stage] = section
    if stale:
        report["stale"] = {k: stale[k] for k in STAGES if k in stale}
    _write_report(path, report)
    return report


def record_failure(path: str | os.PathLike, stage: str, error: str) -> None:
    """Note in report.json that `stage` failed (its output, if any, is the earlier run's: see `stale`). Best
    effort: on a full disk this write may fail too, and report.json then stays as it was (still consistent)."""
    report = read_report(path)
    report["failed"] = {"stage": stage, "error": error}
    try:
        _write_report(path, report)
    except OSError:
        pass


DROPPED_AT_LIMIT = 100  # sources listed per drop reason in a section's `dropped_at`


class DroppedAt:
    """The sources (`path:line`) of dropped records per reason for a section's `dropped_at`: the first
    `DROPPED_AT_LIMIT` of each reason by `order(source)` (ties by the source), whatever order they are found in
    (the Ray engine finds them in another order than the local one). Holds at most the limit per reason, and a
    source past it costs one comparison: millions of bad lines keep memory flat."""

    def __init__(self, order: Callable[[str], tuple]):
        self.order = order
        self.kept: dict[str, list[tuple[tuple, str]]] = {}

    def add(self, reason: str, source: str) -> None:
        kept = self.kept.setdefault(reason, [])
        entry = (self.order(source), source)
        if len(kept) >= DROPPED_AT_LIMIT and entry >= kept[-1]:
            return
        bisect.insort(kept, entry)
        del kept[DROPPED_AT_LIMIT:]

    def section(self) -> dict[str, list[str]]:
        """{reason: [source, ...]}, reasons sorted as `sorted_counts` sorts them."""
        return {reason: [source for _, source in self.kept[reason]] for reason in sorted(self.kept)}


def sorted_counts(counts: dict) -> dict:
    """Reason counts with a stable key order, so report.json bytes do not depend on encounter order."""
    return {k: counts[k] for k in sorted(counts)}


def format_stepwise(stepwise: dict) -> str:
    """The tokenize summary's line of `stepwise` (report.json's section): the samples the records gave and, as
    prefix trees, the tokens stored against storing every sample."""
    head = (f"stepwise ({stepwise['mode']}): {stepwise['records']:,} records -> {stepwise['samples']:,} samples "
            f"({stepwise['samples_kept']:,} kept)")
    if stepwise["mode"] != "tree":
        return f"{head}, {stepwise['sample_tokens']:,} tokens stored"
    stored, as_samples = stepwise["tokens_stored"], stepwise["sample_tokens"]
    share = f" ({stepwise['tokens_saved'] / as_samples:.1%})" if as_samples else ""
    return (f"{head} in {stepwise['sequences']:,} prefix trees: {stored:,} tokens stored, {as_samples:,} as samples "
            f"would store; {stepwise['tokens_saved']:,} saved{share}")


def format_tokenize_summary(section: dict) -> str:
    """The table printed by the tokenize stage: per category records, tokens and loss tokens before and after
    the stage, then what is trained of reasoning and tool calls and what is lost (by reason)."""
    rows = [("category", "records in", "out", "tokens in", "out", "loss tokens in", "out")]
    for row in section["categories"].values():
        rows.append((row["name"], row["before"], row["after"], row["tokens_before"], row["tokens"],
                     row["loss_tokens_before"], row["loss_tokens"]))
    cells = [[f"{v:,}" if isinstance(v, int) else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    reasoning, tools = section["reasoning"], section["tool_calls"]
    lines.append(f"reasoning ({reasoning['policy']}): {reasoning['messages']:,} trained messages, "
                 f"{reasoning['chars']:,} chars; by template {reasoning['by_template']['messages']:,}, "
                 f"inlined {reasoning['inlined']['messages']:,}, "
                 f"not rendered {reasoning['not_rendered']['messages']:,}, "
                 f"dropped {reasoning['dropped']['messages']:,}")
    lines.append(f"tool calls ({tools['arguments']}): {tools['calls']:,} trained, "
                 f"{tools['arguments_parsed']:,} JSON-string arguments parsed")
    images = section.get("images") or {}
    if images.get("images"):
        lines.append(f"images: {images['images']:,} ({images['image_tokens']:,} image tokens, never labelled; "
                     f"{images['image_bytes']:,} bytes stored)")
    for kind in ("video", "audio"):
        counts = section.get(f"{kind}s") or {}
        if counts.get(f"{kind}s"):
            lines.append(f"{kind}s: {counts[f'{kind}s']:,} ({counts[f'{kind}_seconds']:,.1f} s, "
                         f"{counts[f'{kind}_tokens']:,} {kind} tokens, never labelled; {counts[f'{kind}_bytes']:,} "
                         "bytes stored" + (f"; {counts['with_audio']:,} with their sound track" if counts.get(
                             "with_audio") else "") + ")")
    stepwise = section.get("stepwise")
    if stepwise:
        lines.append(format_stepwise(stepwise))
    lost = section["lost"]
    lines.append("not trained: " + (", ".join(f"{reason} {v['records']:,} records / {v['chars']:,} chars"
                                              for reason, v in lost.items()) or "nothing"))
    return "\n".join(lines)
