"""Stage 2: per-category ratio sampling of canonical.jsonl -> sampled.jsonl (seeded, shuffled).

A category of n records with sample_rate r contributes floor(r) full copies of every record plus a seeded
sample without replacement of round_half_up((r - floor(r)) * n) records: r = 0.5 keeps half, r = 2.5 keeps
every record twice and half of them a third time, r = 0 drops the category. Copy k (k >= 1) of a record gets
`meta.copy = k`. The output order is a seeded shuffle of all selected (record, copy) pairs; records are read
back by byte offset, so memory holds only offsets and categories, never texts.

With `eval_size` set, an eval split is held out first (`eval_split`): per category, a seeded choice of records
written once each, in canonical order, to <output_dir>/eval/sampled.jsonl. The rates then apply to the records
left, so no eval record is copied into, or later merged with, the training data.
"""
from __future__ import annotations

import hashlib
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import orjson

from data.config import DataConfig
from data.fsutil import atomic_writer
from data.io import JsonlIndex, require_stage_input
from data.preprocess import MAX_SAMPLE_RATE, check_ratio_names, read_ratio_file
from data.progress import progress
from data.report import ReportError, check_arithmetic, update_report

# rng streams: (seed, 0, category_id) picks per category, (seed, 1) shuffles the output, (seed, 2, category_id)
# picks the eval split
_SHUFFLE_STREAM = 1
_EVAL_STREAM = 2
COPY_DTYPE = np.uint16  # copy numbers of the plan: below MAX_SAMPLE_RATE
assert np.iinfo(COPY_DTYPE).max >= MAX_SAMPLE_RATE


class SamplingError(ValueError):
    """The ratio file does not cover the data or holds an invalid rate."""


def fraction_count(rate: float, n: int) -> int:
    """Records drawn (without replacement) for the fractional part of `rate`; halves round up. The product is
    rounded to 9 decimals first so that decimal rates behave as written (2.55 * 10 -> 5.5, not 5.4999...)."""
    return min(n, math.floor(round((rate - math.floor(rate)) * n, 9) + 0.5))


def eval_quotas(sizes: dict[int, int], eval_size: int | float) -> dict[int, int]:
    """Records held out for eval per category (`sizes`: records per category id). A fraction takes that share of
    each category (halves round up); a count is shared out in proportion to the sizes (largest remainders, ties
    to the lower id). Every category keeps at least one record for training."""
    if isinstance(eval_size, float):
        quotas = {cid: fraction_count(eval_size, n) for cid, n in sizes.items()}
    else:
        total = sum(sizes.values())
        if eval_size >= total:
            raise SamplingError(f"eval_size={eval_size} records, but the categories with a sample_rate above 0 hold "
                                f"only {total}: give a smaller count or a fraction")
        quotas = {cid: eval_size * n // total for cid, n in sizes.items()}
        by_remainder = sorted(sizes, key=lambda cid: (-(eval_size * sizes[cid] % total), cid))
        for cid in by_remainder[:eval_size - sum(quotas.values())]:
            quotas[cid] += 1
    return {cid: min(m, sizes[cid] - 1) for cid, m in quotas.items()}


def eval_split(categories: np.ndarray, rates: dict[int, float], eval_size: int | float, seed: int) -> np.ndarray:
    """The record indices held out for eval, in increasing order: `eval_quotas` of the categories with a rate
    above 0 (a category left out of training is left out of eval too), each a seeded choice of its records."""
    sizes = {int(cid): int(n) for cid, n in zip(*np.unique(categories, return_counts=True)) if rates[int(cid)] > 0}
    picked = [np.random.default_rng([seed, _EVAL_STREAM, cid]).choice(np.flatnonzero(categories == cid), size=m,
                                                                        replace=False)
              for cid, m in eval_quotas(sizes, eval_size).items() if m]
    if not picked:
        raise SamplingError(f"eval_size={eval_size} holds out no record (categories of {sorted(sizes.values())} "
                            "records): give a larger fraction or a count")
    return np.sort(np.concatenate(picked))


def plan(categories: np.ndarray, rates: dict[int, float], seed: int, held_out: np.ndarray | None = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """Which (record index, copy) pairs to emit, in output order: record indices (int64) and copy numbers
    (uint16: rates stop at MAX_SAMPLE_RATE).

    `categories[i]` is record i's category id; `rates` maps every id present to its sample rate; the records of
    `held_out` (indices, the eval split) are left out.
    """
    in_training = np.ones(len(categories), dtype=bool)
    if held_out is not None:
        in_training[held_out] = False
    rec_parts, copy_parts = [], []
    for cid in np.unique(categories):
        cid = int(cid)
        members = np.flatnonzero((categories == cid) & in_training)
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
    """The per-category table sample prints (an `eval` column with an eval split)."""
    with_eval = "eval" in rows[0] if rows else False
    lines = [f"{'id':>4} {'category':<24} {'rate':>7} {'before':>9}" + (f" {'eval':>9}" if with_eval else "")
             + f" {'after':>9}"]
    for r in rows:
        lines.append(f"{r['category_id']:>4} {r['category_name'][:24]:<24} {r['sample_rate']:>7g} {r['before']:>9}"
                     + (f" {r['eval']:>9}" if with_eval else "") + f" {r['after']:>9}")
    totals = [sum(r[k] for r in rows) for k in ("before", "eval", "after") if k != "eval" or with_eval]
    lines.append(f"{'':>4} {'total':<24} {'':>7}" + "".join(f" {t:>9}" for t in totals))
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


def ratio_file_digest(path) -> str | None:
    """sha256 of the ratio file as sampling read it (None when there is none): later stages run on their own can
    tell that it was edited since (data.pipeline.stale_input_warnings)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def run(cfg: DataConfig, scan_all: Callable | None = None, write_all: Callable | None = None, executor=None) -> dict:
    """canonical.jsonl + ratio file -> sampled.jsonl (and with `eval_size` the eval split's
    eval/sampled.jsonl); records the `sample` report section (and the eval split's in eval/report.json).

    `scan_all(path)` and `write_all(cfg, offsets, records, copies, out)` replace `scan` and `write` (the Ray
    engine's workers read and write the records; the plan stays here)."""
    offsets, categories, names = (scan_all or scan)(require_stage_input(cfg.canonical_path, "preprocess"))
    present = {int(c): int(n) for c, n in zip(*np.unique(categories, return_counts=True))}
    rates = check_rates(read_ratio_file(cfg.ratio_file), present, cfg.ratio_file, names)
    held_out = None if cfg.eval_size is None else eval_split(categories, rates, cfg.eval_size, cfg.seed)
    records, copies = plan(categories, rates, cfg.seed, held_out)
    with atomic_writer(cfg.sampled_path) as out:
        (write_all or write)(cfg, offsets, records, copies, out)
    if held_out is None:
        remove_earlier_eval_split(cfg)
    else:
        with atomic_writer(cfg.eval_config().sampled_path) as out:
            (write_all or write)(cfg, offsets, held_out, np.zeros(len(held_out), dtype=COPY_DTYPE), out)

    def counts_by_category(indices: np.ndarray) -> dict[int, int]:
        counts = {cid: 0 for cid in present}
        counts.update({int(c): int(n) for c, n in zip(*np.unique(categories[indices], return_counts=True))})
        return counts

    after = counts_by_category(records)
    held = counts_by_category(held_out if held_out is not None else np.zeros(0, dtype=np.int64))
    rows = []
    dropped = {"rate_zero": 0, "not_sampled": 0, "held_out_for_eval": sum(held.values())}
    added = {"copies": 0}
    for cid in sorted(present):
        n, rate = present[cid] - held[cid], rates[cid]
        full, m = math.floor(rate), fraction_count(rate, n)
        if after[cid] != full * n + m:
            raise ReportError(f"category {cid}: {after[cid]} sampled, expected {full} * {n} + {m}")
        rows.append({"category_id": cid, "category_name": names[cid], "sample_rate": rate, "before": present[cid],
                     **({"eval": held[cid]} if held_out is not None else {}),
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
        "seed": cfg.seed, "ratio_file": str(cfg.ratio_file), "ratio_file_sha256": ratio_file_digest(cfg.ratio_file),
        "output": str(cfg.sampled_path),
    }
    if held_out is not None:
        section["eval"] = record_eval_split(cfg, held, names)
    check_arithmetic(section)
    print(format_table(rows), flush=True)
    update_report(cfg.report_path, "sample", section)
    return section


def record_eval_split(cfg: DataConfig, held: dict[int, int], names: dict[int, str]) -> dict:
    """The eval split's `sample` section in eval/report.json (its later stages report there too); returns what
    the training data's section says of it."""
    eval_cfg = cfg.eval_config()
    total = sum(held.values())
    update_report(eval_cfg.report_path, "sample", check_arithmetic({
        "in": total, "out": total, "dropped": {},
        "categories": {names[cid]: {"category_id": cid, "before": n, "after": n} for cid, n in sorted(held.items())},
        "eval_size": cfg.eval_size, "seed": cfg.seed, "source": str(cfg.canonical_path),
        "output": str(eval_cfg.sampled_path),
    }))
    return {"eval_size": cfg.eval_size, "records": total, "output": str(eval_cfg.sampled_path),
            "report": str(eval_cfg.report_path)}


def remove_earlier_eval_split(cfg: DataConfig) -> None:
    """Without `eval_size`, an eval split an earlier run wrote (recognised by its report.json) would be stale, and
    the trainer would still evaluate on it: remove it."""
    eval_dir = cfg.eval_dir
    if (eval_dir / "report.json").is_file():
        shutil.rmtree(eval_dir)
        print(f"[sample] eval_size is null: removed the eval split of an earlier run ({eval_dir})", flush=True)


if __name__ == "__main__":
    from data.pipeline import cli_main

    cli_main(run, "sample")
