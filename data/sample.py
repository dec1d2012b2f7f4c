"""Stage 2: per-category ratio sampling of canonical.jsonl -> sampled.jsonl (seeded, shuffled).

A category of n records with sample_rate r contributes floor(r) full copies of every record plus a seeded
sample without replacement of round_half_up((r - floor(r)) * n) records: r = 0.5 keeps half, r = 2.5 keeps
every record twice and half of them a third time, r = 0 drops the category. Copy k (k >= 1) of a record gets
`meta.copy = k`. The output order is a seeded shuffle of all selected (record, copy) pairs; records are read
back by byte offset, so memory holds only offsets and categories, never texts.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import orjson

from data.config import DataConfig
from data.io import JsonlIndex, atomic_writer, require_stage_input
from data.preprocess import MAX_SAMPLE_RATE, check_ratio_names, read_ratio_file
from data.progress import progress
from data.report import ReportError, check_arithmetic, update_report

_SHUFFLE_STREAM = 1  # rng streams: (seed, 0, category_id) picks per category, (seed, 1) shuffles the output
COPY_DTYPE = np.uint16  # copy numbers of the plan: below MAX_SAMPLE_RATE
assert np.iinfo(COPY_DTYPE).max >= MAX_SAMPLE_RATE


class SamplingError(ValueError):
    """The ratio file does not cover the data or holds an invalid rate."""


def fraction_count(rate: float, n: int) -> int:
    """Records drawn (without replacement) for the fractional part of `rate`; halves round up. The product is
    rounded to 9 decimals first so that decimal rates behave as written (2.55 * 10 -> 5.5, not 5.4999...)."""
    return min(n, math.floor(round((rate - math.floor(rate)) * n, 9) + 0.5))


def plan(categories: np.ndarray, rates: dict[int, float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Which (record index, copy) pairs to emit, in output order: record indices (int64) and copy numbers
    (uint16: rates stop at MAX_SAMPLE_RATE).

    `categories[i]` is record i's category id; `rates` maps every id present to its sample rate.
    """
    rec_parts, copy_parts = [], []
    for cid in np.unique(categories):
        cid = int(cid)
        members = np.flatnonzero(categories == cid)
        rate = rates[cid]
        full = math.floor(rate)
        for k in range(full):
            rec_parts.append(members)
            copy_parts.append(np.full(len(members), k, dtype=COPY_DTYPE))
        m = fraction_count(rate, len(members))
        if m:
            rng = np.random.default_rng([seed, 0, cid])
            picked = np.sort(rng.choice(members, size=m, replace=False))
            rec_parts.append(picked)
            copy_parts.append(np.full(m, full, dtype=COPY_DTYPE))
    if not rec_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=COPY_DTYPE)
    records, copies = np.concatenate(rec_parts), np.concatenate(copy_parts)
    del rec_parts, copy_parts  # freed before the shuffle: at the peak the records, the permutation and the
    # shuffled records (8 bytes a record each) and the copy numbers (2)
    order = np.random.default_rng([seed, _SHUFFLE_STREAM]).permutation(len(records))
    records = records[order]
    return records, copies[order]


def check_rates(ratio_cats: list[dict], present: dict[int, int], ratio_path,
                names: dict[int, str]) -> dict[int, float]:
    """Rates by category id of the data. Entries are matched by name (`names`: id -> name, from the data), as
    preprocess does: every category of the data needs an entry, every entry a category (`check_ratio_names`),
    and an entry's id must be the one preprocess gave the data (else the file changed since preprocess)."""
    by_name = {c["category_name"]: c for c in ratio_cats}
    missing = sorted(cid for cid in present if names[cid] not in by_name)
    if missing:
        named = ", ".join(f"{names[cid]!r} (id {cid})" for cid in missing)
        raise SamplingError(f"{ratio_path}: categories {missing} of the data have no entry: {named}; re-run "
                            "preprocess (it adds new categories) or add them by hand")
    try:
        check_ratio_names(ratio_cats, [names[cid] for cid in present], ratio_path)
    except ValueError as exc:
        raise SamplingError(str(exc)) from None
    rates = {}
    for cid in present:
        entry = by_name[names[cid]]
        if entry["category_id"] != cid:
            raise SamplingError(f"{ratio_path}: entry {names[cid]!r} has id {entry['category_id']}, but "
                                f"canonical.jsonl gives that category id {cid}: the ratio file changed after "
                                "preprocess; re-run from preprocess")
        rate = entry.get("sample_rate", 1.0)
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate <= MAX_SAMPLE_RATE:
            raise SamplingError(f"{ratio_path}: category {names[cid]!r} (id {cid}): sample_rate must be a number "
                                f"in 0..{MAX_SAMPLE_RATE}, got {rate!r}")
        rates[cid] = float(rate)
    return rates


def format_table(rows: list[dict]) -> str:
    lines = [f"{'id':>4} {'category':<24} {'rate':>7} {'before':>9} {'after':>9}"]
    for r in rows:
        lines.append(f"{r['category_id']:>4} {r['category_name'][:24]:<24} {r['sample_rate']:>7g} {r['before']:>9} "
                     f"{r['after']:>9}")
    total_before = sum(r["before"] for r in rows)
    total_after = sum(r["after"] for r in rows)
    lines.append(f"{'':>4} {'total':<24} {'':>7} {total_before:>9} {total_after:>9}")
    return "\n".join(lines)


def sampled_line(line: bytes, copy: int) -> bytes:
    """A canonical.jsonl line (without its newline) as sampled.jsonl holds copy `copy` of it."""
    if copy:
        rec = orjson.loads(line)
        rec["meta"]["copy"] = copy
        line = orjson.dumps(rec)
    return line + b"\n"


def scan(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """canonical.jsonl's line offsets (n + 1, the last one its size), each record's category id, and the
    category names by id (as the records give them)."""
    cats: list[int] = []
    names: dict[int, str] = {}

    def visit(i: int, line: bytes) -> None:
        meta = orjson.loads(line)["meta"]
        cats.append(meta["category_id"])
        names.setdefault(meta["category_id"], meta.get("category_name", str(meta["category_id"])))

    index = JsonlIndex.build(path, visit)
    return index.offsets, np.asarray(cats, dtype=np.int64), names


def write(cfg: DataConfig, offsets: np.ndarray, records: np.ndarray, copies: np.ndarray, out: BinaryIO) -> None:
    """The planned (record, copy) pairs' lines, in order, read back from canonical.jsonl by byte offset."""
    with JsonlIndex(cfg.canonical_path, offsets) as index:
        for rec_i, copy in progress(zip(records.tolist(), copies.tolist()), total=len(records), desc="sample",
                                    unit="rec"):
            out.write(sampled_line(index.read(rec_i), copy))


def run(cfg: DataConfig, scan_all: Callable | None = None, write_all: Callable | None = None) -> dict:
    """canonical.jsonl + ratio file -> sampled.jsonl; records the `sample` report section.

    `scan_all(path)` and `write_all(cfg, offsets, records, copies, out)` replace `scan` and `write` (the Ray
    engine's workers read and write the records; the plan stays here)."""
    offsets, categories, names = (scan_all or scan)(require_stage_input(cfg.canonical_path, "preprocess"))
    present = {int(c): int(n) for c, n in zip(*np.unique(categories, return_counts=True))}
    rates = check_rates(read_ratio_file(cfg.ratio_file), present, cfg.ratio_file, names)
    records, copies = plan(categories, rates, cfg.seed)
    with atomic_writer(cfg.sampled_path) as out:
        (write_all or write)(cfg, offsets, records, copies, out)

    after = {cid: 0 for cid in present}
    for cid, n in zip(*np.unique(categories[records], return_counts=True)):
        after[int(cid)] = int(n)
    rows = []
    dropped = {"rate_zero": 0, "not_sampled": 0}
    added = {"copies": 0}
    for cid in sorted(present):
        n, rate = present[cid], rates[cid]
        full, m = math.floor(rate), fraction_count(rate, n)
        if after[cid] != full * n + m:
            raise ReportError(f"category {cid}: {after[cid]} sampled, expected {full} * {n} + {m}")
        rows.append({"category_id": cid, "category_name": names[cid], "sample_rate": rate, "before": n,
                     "after": after[cid], "full_copies": full, "sampled": m})
        if rate == 0:
            dropped["rate_zero"] += n
        elif full == 0:
            dropped["not_sampled"] += n - m
        else:
            added["copies"] += (full - 1) * n + m
    section = {
        "in": len(categories), "out": len(records),
        "dropped": {k: v for k, v in dropped.items() if v},
        "added": {k: v for k, v in added.items() if v},
        "categories": {r["category_name"]: r for r in rows},
        "seed": cfg.seed, "ratio_file": str(cfg.ratio_file), "output": str(cfg.sampled_path),
    }
    check_arithmetic(section)
    print(format_table(rows), flush=True)
    update_report(cfg.report_path, "sample", section)
    return section


if __name__ == "__main__":
    from data.pipeline import cli_main

    cli_main(run, "sample")
