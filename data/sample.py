"""Stage 2: per-category ratio sampling of canonical.jsonl -> sampled.jsonl (seeded, shuffled).

A category of n records with sample_rate r contributes floor(r) full copies of every record plus
round_half_up((r - floor(r)) * n) records once more (`fraction_count`): r = 0.5 keeps half, r = 2.5 keeps every
record twice and half of them a third time, r = 0 drops the category. Copy k (k >= 1) of a record gets
`meta.copy = k`. With `eval_size` set, an eval split is held out first: per category, `eval_quotas` records
written once each, in canonical order, to <output_dir>/eval/sampled.jsonl; the rates then apply to the records
left, so no eval record is copied into, or later merged with, the training data.

Every choice is a record's own draw (`data.randomness.record_keys` of the seed and the record's index, its
position among canonical.jsonl's records): a category's eval records are those with the smallest
SAMPLE_EVAL keys, its fractional part the training records with the smallest SAMPLE_FRACTION keys, and
sampled.jsonl holds the selected (record, copy) pairs sorted by their SAMPLE_ORDER keys. For a given seed,
stream and copy the key is a bijection of the index, so the counts are exact. Nothing depends on how the
file is cut, the worker count or the engine.

The program, over byte ranges of canonical.jsonl (`RANGE_BYTES`), the driver holding numbers per range, per
category and per bucket, never per record:
1. `scan_range`: each range's records' category ids and places (kept as a small array in the scratch directory:
   the later passes parse no JSON), its records and bytes per category, the category names.
2. `select_smallest`, for the eval split then the fractional part: the key of each category's m-th smallest
   candidate, from a histogram of the keys' top bits (`key_histogram`) and then the keys of the bucket holding
   the m-th (`keys_in_bucket`).
3. `plan_range`: each range's selected pairs (order key, place, copy), sorted by key, so grouped by output bucket
   (`order_bucket`: ~`BUCKET_BYTES` of sampled.jsonl each); its eval records' lines as a part.
4. `write_bucket`: one task per bucket sorts its pairs from every range's plan by key and writes their lines,
   read from canonical.jsonl by place; the buckets are concatenated in order (and the eval parts in range
   order).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from data.config import DataConfig
from data.executor import ByteRange, Executor, LocalExecutor, Part, byte_ranges
from data.io import read_lines, require_stage_input
from data.ratios import MAX_SAMPLE_RATE, check_ratio_names, ratio_file_digest, read_ratio_file
from data.progress import progress
from data.randomness import SAMPLE_EVAL, SAMPLE_FRACTION, SAMPLE_ORDER, record_keys
from data.report import ReportError, check_arithmetic, update_report

RANGE_BYTES = 4 << 20  # canonical.jsonl bytes per range (a worker holds a range's lines at once)
BUCKET_BYTES = 64 << 20  # sampled.jsonl bytes per sort bucket, about (a worker sorts a bucket in memory)
MAX_HISTOGRAM_BITS = 16  # a category's key histogram has at most 2^16 buckets
EVERY_KEY = 2 ** 64 - 1  # the threshold that selects every candidate
WRITE_BATCH = 1 << 16  # lines a worker joins before writing them


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


# ---------------------------------------------------------------------------------------------- tasks, results
# A record as `scan_range` keeps it for the later passes: its category id and where its line is in canonical.jsonl
# (bytes [start, end), the newline left out)
RECORD = np.dtype([("category", np.int64), ("start", np.int64), ("end", np.int64)])
# A selected (record, copy) pair as `plan_range` lists it for `write_bucket`: its order key, line and copy
PAIR = np.dtype([("key", np.uint64), ("start", np.int64), ("end", np.int64), ("copy", np.int64)])


@dataclasses.dataclass(frozen=True)
class RangeTask:
    """A byte range of canonical.jsonl. `records_path`: where `scan_range` keeps its records (`RECORD`) for the
    later passes; `first_record`, `records`: the index of its first record and its records (after the scan)."""
    range: ByteRange
    records_path: str
    first_record: int = 0
    records: int = 0


@dataclasses.dataclass(frozen=True)
class RangeScan:
    """What `scan_range` found in a range: its records, their count and bytes per category id, category names."""
    records: int
    counts: dict[int, int]
    sizes: dict[int, int]
    names: dict[int, str]


@dataclasses.dataclass(frozen=True)
class Rule:
    """What decides every record, the same for every range. A record is held out for eval when its SAMPLE_EVAL
    key is at most its category's `held_out` threshold; a record not held out gets its category's `full_copies`,
    and one copy more when its SAMPLE_FRACTION key is at most its category's `fraction` threshold (a category
    without a threshold: none)."""
    seed: int
    full_copies: dict[int, int]
    held_out: dict[int, int] = dataclasses.field(default_factory=dict)
    fraction: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KeyTask:
    """A range's share of a `select_smallest` pass: its candidates are its records of the categories of `bits`
    that `rule` does not hold out, each in bucket `key >> (64 - bits[category])` of its `stream` key. `bucket`:
    the bucket per category whose keys `keys_in_bucket` returns."""
    range: RangeTask
    rule: Rule
    stream: int
    bits: dict[int, int]
    bucket: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KeyHistogram:
    """A range's candidates per category id: the buckets holding some (increasing) and how many each holds."""
    buckets: dict[int, np.ndarray]
    counts: dict[int, np.ndarray]


@dataclasses.dataclass(frozen=True)
class BucketKeys:
    """A range's candidates' keys in their category's `KeyTask.bucket`, per category id."""
    keys: dict[int, np.ndarray]


@dataclasses.dataclass(frozen=True)
class PlanTask:
    """List a range's selected (record, copy) pairs (`PAIR`), sorted by order key, in `plan` (`range_plan`); write
    its held-out records to `eval_part` (None: no eval split)."""
    range: RangeTask
    rule: Rule
    buckets: int
    plan: str
    eval_part: str | None


@dataclasses.dataclass(frozen=True)
class RangePlan:
    """`bucket_starts[b]`: the first of the range's pairs in output bucket b (the last entry: the pairs).
    `sampled`, `held_out`: the pairs and the held-out records per category id; `eval_part`: the held-out
    records' lines (None without an eval split)."""
    bucket_starts: np.ndarray
    sampled: dict[int, int]
    held_out: dict[int, int]
    eval_part: Part | None


@dataclasses.dataclass(frozen=True)
class BucketTask:
    """Write output bucket `bucket` to `part`: its pairs from every range's plan (`range_plan(plans, r)`, where
    `starts`, the .npy of every range's `RangePlan.bucket_starts`, says), sorted by key, their lines read from
    `canonical`."""
    bucket: int
    canonical: str
    plans: str
    starts: str
    part: str


@dataclasses.dataclass(frozen=True)
class BucketWritten:
    part: Part
    lines: int


# ---------------------------------------------------------------------------------------------- workers
def range_plan(plans: str | Path, index: int) -> str:
    """The plan of range `index` (`PAIR`s) in the scratch directory `plans`."""
    return str(Path(plans) / f"plan_{index:08d}.bin")


def category_lookup(table: dict[int, int], categories: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """For each category id of `categories`: whether `table` has it, and its value there (0 where not)."""
    ids = np.array(sorted(table), dtype=np.int64)
    values = np.array([table[cid] for cid in ids.tolist()] + [0], dtype=dtype)
    if not len(ids):
        return np.zeros(len(categories), dtype=bool), np.zeros(len(categories), dtype=dtype)
    pos = np.searchsorted(ids, categories)
    known = ids[np.minimum(pos, len(ids) - 1)] == categories
    return known, values[np.where(known, pos, len(ids))]


def selected(seed: int, stream: int, thresholds: dict[int, int], categories: np.ndarray, index: np.ndarray
             ) -> np.ndarray:
    """Whether each record (its category id and index) has a `stream` key at most its category's threshold."""
    known, limits = category_lookup(thresholds, categories, np.uint64)
    return known & (record_keys(seed, stream, index) <= limits)


def scan_range(task: RangeTask) -> RangeScan:
    """Worker: a range's records (its non-blank lines: category id and place) saved to `task.records_path`; their
    counts, bytes and names per category."""
    lines = read_lines(task.range.path, task.range.start, task.range.end)
    lengths = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
    kept = np.fromiter((not line.isspace() for line in lines), dtype=bool, count=len(lines))
    metas = [orjson.loads(line)["meta"] for line, keep in zip(lines, kept.tolist()) if keep]
    records = np.zeros(len(metas), dtype=RECORD)
    records["category"] = [meta["category_id"] for meta in metas]
    records["start"] = (task.range.start + np.cumsum(lengths) - lengths)[kept]
    records["end"] = records["start"] + lengths[kept] - 1  # the newline left out ...
    if lines and not lines[-1].endswith(b"\n") and kept[-1]:
        records["end"][-1] += 1  # ... but the file's last line may have none
    np.save(task.records_path, records)
    ids, firsts, position = np.unique(records["category"], return_index=True, return_inverse=True)
    sizes = np.bincount(position, weights=records["end"] - records["start"] + 1, minlength=len(ids))
    names = {cid: metas[i].get("category_name", str(cid)) for cid, i in zip(ids.tolist(), firsts.tolist())}
    return RangeScan(len(metas), dict(zip(ids.tolist(), np.bincount(position, minlength=len(ids)).tolist())),
                     dict(zip(ids.tolist(), sizes.astype(np.int64).tolist())), names)


def candidate_keys(task: KeyTask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The category ids, `task.stream` keys and histogram buckets of a range's candidates."""
    categories = np.load(task.range.records_path)["category"]
    index = np.arange(task.range.first_record, task.range.first_record + len(categories))
    candidate, bits = category_lookup(task.bits, categories, np.uint64)
    candidate &= ~selected(task.rule.seed, SAMPLE_EVAL, task.rule.held_out, categories, index)
    keys = record_keys(task.rule.seed, task.stream, index[candidate])
    return categories[candidate], keys, (keys >> (np.uint64(64) - bits[candidate])).astype(np.int64)


def key_histogram(task: KeyTask) -> KeyHistogram:
    """Worker: how many of a range's candidates each histogram bucket of their category holds (sparse)."""
    categories, _, buckets = candidate_keys(task)
    pairs, counts = np.unique(categories << MAX_HISTOGRAM_BITS | buckets, return_counts=True)
    ids, firsts = np.unique(pairs >> MAX_HISTOGRAM_BITS, return_index=True)
    ends = [*firsts[1:].tolist(), len(pairs)]
    pairs &= (1 << MAX_HISTOGRAM_BITS) - 1
    return KeyHistogram({cid: pairs[a:b] for cid, a, b in zip(ids.tolist(), firsts.tolist(), ends)},
                        {cid: counts[a:b] for cid, a, b in zip(ids.tolist(), firsts.tolist(), ends)})


def keys_in_bucket(task: KeyTask) -> BucketKeys:
    """Worker: the keys of a range's candidates that fall in their category's `task.bucket`."""
    categories, keys, buckets = candidate_keys(task)
    _, wanted = category_lookup(task.bucket, categories, np.int64)
    hit = buckets == wanted
    categories, keys = categories[hit], keys[hit]
    return BucketKeys({cid: keys[categories == cid] for cid in np.unique(categories).tolist()})


def order_bucket(keys: np.ndarray, buckets: int) -> np.ndarray:
    """The output bucket of each order key: floor(key / 2^64 * buckets) from its top 32 bits, so buckets are
    increasing intervals of keys."""
    return ((keys >> np.uint64(32)) * np.uint64(buckets) >> np.uint64(32)).astype(np.int64)


def plan_range(task: PlanTask) -> RangePlan:
    """Worker: a range's selected (record, copy) pairs sorted by their SAMPLE_ORDER keys (ties, two equal 64-bit
    keys, by record then copy) to `task.plan`; its held-out records' lines, in order, to `task.eval_part`."""
    rule, records = task.rule, np.load(task.range.records_path)
    categories = records["category"]
    index = np.arange(task.range.first_record, task.range.first_record + len(records))
    held = selected(rule.seed, SAMPLE_EVAL, rule.held_out, categories, index)
    _, full = category_lookup(rule.full_copies, categories, np.int64)
    copies = np.where(held, 0, full + selected(rule.seed, SAMPLE_FRACTION, rule.fraction, categories, index))
    chosen = np.repeat(np.arange(len(records)), copies)  # the pairs, by record then copy
    pairs = np.zeros(len(chosen), dtype=PAIR)
    pairs["copy"] = np.arange(len(chosen)) - np.repeat(np.cumsum(copies) - copies, copies)
    pairs["key"] = record_keys(rule.seed, SAMPLE_ORDER, index[chosen], pairs["copy"])
    pairs["start"], pairs["end"] = records["start"][chosen], records["end"][chosen]
    pairs = pairs[np.argsort(pairs["key"], kind="stable")]
    pairs.tofile(task.plan)  # scratch: no atomic write needed (a retried task rewrites it)
    if task.eval_part is not None:
        with mapped(task.range.range.path) as canonical, open(task.eval_part, "wb") as out:
            out.write(b"".join([sampled_line(canonical[start:end], 0)
                                for start, end in zip(records["start"][held].tolist(), records["end"][held].tolist())]))

    def per_category(weights: np.ndarray) -> dict[int, int]:
        ids, position = np.unique(categories, return_inverse=True)
        counts = np.bincount(position, weights=weights, minlength=len(ids)).astype(np.int64)
        return {cid: n for cid, n in zip(ids.tolist(), counts.tolist()) if n}

    return RangePlan(np.searchsorted(order_bucket(pairs["key"], task.buckets), np.arange(task.buckets + 1)),
                     per_category(copies), per_category(held),
                     None if task.eval_part is None else Part.written(task.eval_part))


@contextlib.contextmanager
def mapped(path: str) -> Iterator[mmap.mmap | bytes]:
    """A file memory-mapped for reading (lines are read by slicing); b"" for an empty one, which mmap refuses."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            yield view


def write_bucket(task: BucketTask) -> BucketWritten:
    """Worker: output bucket `task.bucket`'s pairs from every range's plan, sorted by key (stable: ties stay in
    range order), their lines (`sampled_line`) to `task.part`."""
    pairs = [np.zeros(0, dtype=PAIR)]
    for r, (first, end) in enumerate(np.load(task.starts, mmap_mode="r")[:, task.bucket:task.bucket + 2].tolist()):
        if end > first:
            pairs.append(np.fromfile(range_plan(task.plans, r), dtype=PAIR, count=end - first,
                                     offset=PAIR.itemsize * first))
    pairs = np.concatenate(pairs)
    pairs = pairs[np.argsort(pairs["key"], kind="stable")]
    with mapped(task.canonical) as canonical, open(task.part, "wb") as out:
        for a in range(0, len(pairs), WRITE_BATCH):
            batch = pairs[a:a + WRITE_BATCH]
            out.write(b"".join([sampled_line(canonical[start:end], copy) for start, end, copy in
                                zip(batch["start"].tolist(), batch["end"].tolist(), batch["copy"].tolist())]))
    return BucketWritten(Part.written(task.part), len(pairs))


# ---------------------------------------------------------------------------------------------- driver
def scan(executor: Executor, path: Path, scratch: Path
         ) -> tuple[list[RangeTask], dict[int, int], dict[int, int], dict[int, str]]:
    """canonical.jsonl's ranges (with their first record and records), its records and bytes per category id
    (increasing ids), and the category names (the first record of each gives it)."""
    tasks = [RangeTask(r, str(scratch / f"records_{r.index:08d}.npy")) for r in byte_ranges(path, RANGE_BYTES)]
    ranges, counts, sizes, names, first = [], Counter(), Counter(), {}, 0
    with progress(total=path.stat().st_size, desc="sample: scan", unit="B", unit_scale=True) as bar:
        for task, found in zip(tasks, executor.map(scan_range, tasks)):
            ranges.append(dataclasses.replace(task, first_record=first, records=found.records))
            first += found.records
            counts.update(found.counts)
            sizes.update(found.sizes)
            for cid, name in found.names.items():
                names.setdefault(cid, name)
            bar.update(task.range.end - task.range.start)
    return ranges, dict(sorted(counts.items())), dict(sizes), names


def histogram_bits(n: int) -> int:
    """Bits of a histogram over n keys: about sqrt(n) buckets (at most 2^MAX_HISTOGRAM_BITS), so that both
    the histogram and the bucket holding the m-th key are small."""
    return max(1, min(MAX_HISTOGRAM_BITS, (n.bit_length() + 1) // 2))


def select_smallest(executor: Executor, ranges: list[RangeTask], rule: Rule, stream: int, quotas: dict[int, int],
                    candidates: dict[int, int]) -> dict[int, int]:
    """Per category id, the threshold that selects its `quotas[cid]` candidates (of `candidates[cid]`: the
    records `rule` does not hold out) with the smallest `stream` keys: the m-th smallest key (none for m = 0).
    Two passes: each range's key histogram (summed here), then the keys of the bucket holding the m-th."""
    thresholds = {cid: EVERY_KEY for cid, m in quotas.items() if m and m == candidates[cid]}
    wanted = {cid: m for cid, m in quotas.items() if 0 < m < candidates[cid]}
    if not wanted:
        return thresholds
    bits = {cid: histogram_bits(candidates[cid]) for cid in wanted}
    histograms = {cid: np.zeros(1 << b, dtype=np.int64) for cid, b in bits.items()}
    for found in executor.map(key_histogram, (KeyTask(r, rule, stream, bits) for r in ranges)):
        for cid, buckets in found.buckets.items():
            histograms[cid][buckets] += found.counts[cid]
    bucket, rank = {}, {}
    for cid, m in wanted.items():
        before = np.cumsum(histograms[cid])
        bucket[cid] = b = int(np.searchsorted(before, m))  # the first bucket with m keys up to it
        rank[cid] = m - (int(before[b - 1]) if b else 0)
    keys: dict[int, list[np.ndarray]] = {cid: [] for cid in wanted}
    for found in executor.map(keys_in_bucket, (KeyTask(r, rule, stream, bits, bucket) for r in ranges)):
        for cid, found_keys in found.keys.items():
            keys[cid].append(found_keys)
    for cid in wanted:
        thresholds[cid] = int(np.sort(np.concatenate(keys[cid]))[rank[cid] - 1])
    return thresholds


def write_sampled(cfg: DataConfig, executor: Executor, ranges: list[RangeTask], rule: Rule, buckets: int,
                  scratch: Path) -> tuple[Counter, Counter]:
    """sampled.jsonl (and with an eval split eval/sampled.jsonl) from `rule`: the ranges' plans, then one task per
    output bucket, whose parts are appended in order. Returns the lines written per category id, to each."""
    starts_path = scratch / "bucket_starts.npy"  # every range's bucket starts: on disk, not in the driver
    starts = np.lib.format.open_memmap(starts_path, mode="w+", dtype=np.int64, shape=(len(ranges), buckets + 1))
    with_eval = cfg.eval_size is not None
    tasks = [PlanTask(r, rule, buckets, range_plan(scratch, k), str(scratch / f"eval_{k:08d}.jsonl") if with_eval
                      else None) for k, r in enumerate(ranges)]
    sampled, held, eval_parts = Counter(), Counter(), []
    for k, planned in enumerate(executor.map(plan_range, tasks)):
        starts[k] = planned.bucket_starts
        sampled.update(planned.sampled)
        held.update(planned.held_out)
        if planned.eval_part is not None:
            eval_parts.append(planned.eval_part)
    starts.flush()
    del starts
    bucket_tasks = [BucketTask(b, str(cfg.canonical_path), str(scratch), str(starts_path),
                               str(scratch / f"bucket_{b:08d}.jsonl")) for b in range(buckets)]
    with progress(total=sum(sampled.values()), desc="sample", unit="rec") as bar:
        executor.concatenate(cfg.sampled_path, (bar.update(done.lines) or done.part
                                                for done in executor.map(write_bucket, bucket_tasks)))
    if with_eval:
        executor.concatenate(cfg.eval_config().sampled_path, eval_parts)
    return sampled, held


def run(cfg: DataConfig, executor: Executor | None = None) -> dict:
    """canonical.jsonl + ratio file -> sampled.jsonl (and with `eval_size` the eval split's
    eval/sampled.jsonl); records the `sample` report section (and the eval split's in eval/report.json)."""
    executor = executor or LocalExecutor(cfg.workers)
    path = require_stage_input(cfg.canonical_path, "preprocess")
    with executor.scratch(cfg.sampled_path.parent, "sample-parts") as scratch:
        ranges, present, sizes, names = scan(executor, path, scratch)
        rates = check_rates(read_ratio_file(cfg.ratio_file), present, cfg.ratio_file, names)
        rule = Rule(cfg.seed, {cid: math.floor(rate) for cid, rate in rates.items() if rate >= 1})
        quotas: dict[int, int] = {}
        if cfg.eval_size is not None:
            eligible = {cid: n for cid, n in present.items() if rates[cid] > 0}  # rate 0: left out of eval too
            quotas = eval_quotas(eligible, cfg.eval_size)
            if not any(quotas.values()):
                raise SamplingError(f"eval_size={cfg.eval_size} holds out no record (categories of "
                                    f"{sorted(eligible.values())} records): give a larger fraction or a count")
            rule = dataclasses.replace(rule, held_out=select_smallest(executor, ranges, rule, SAMPLE_EVAL, quotas,
                                                                      eligible))
        training = {cid: n - quotas.get(cid, 0) for cid, n in present.items()}
        fractions = {cid: fraction_count(rates[cid], n) for cid, n in training.items()}
        rule = dataclasses.replace(rule, fraction=select_smallest(executor, ranges, rule, SAMPLE_FRACTION, fractions,
                                                                  training))
        expected_bytes = sum(sizes[cid] / present[cid] * (math.floor(rates[cid]) * n + fractions[cid])
                             for cid, n in training.items())
        buckets = max(1, math.ceil(expected_bytes / BUCKET_BYTES))
        after, held = write_sampled(cfg, executor, ranges, rule, buckets, scratch)
    if cfg.eval_size is None:
        remove_earlier_eval_split(cfg)
    held = {cid: held.get(cid, 0) for cid in present}
    rows = []
    dropped = {"rate_zero": 0, "not_sampled": 0, "held_out_for_eval": sum(held.values())}
    added = {"copies": 0}
    for cid in present:
        n, rate = training[cid], rates[cid]
        full, m = math.floor(rate), fractions[cid]
        if held[cid] != quotas.get(cid, 0):
            raise ReportError(f"category {cid}: {held[cid]} held out for eval, expected {quotas.get(cid, 0)}")
        if after[cid] != full * n + m:
            raise ReportError(f"category {cid}: {after[cid]} sampled, expected {full} * {n} + {m}")
        rows.append({"category_id": cid, "category_name": names[cid], "sample_rate": rate, "before": present[cid],
                     **({"eval": held[cid]} if cfg.eval_size is not None else {}),
                     "after": after[cid], "full_copies": full, "sampled": m})
        if rate == 0:
            dropped["rate_zero"] += n
        elif full == 0:
            dropped["not_sampled"] += n - m
        else:
            added["copies"] += (full - 1) * n + m
    section = {
        "in": sum(present.values()), "out": sum(after.values()),
        "dropped": {k: v for k, v in dropped.items() if v},
        "added": {k: v for k, v in added.items() if v},
        "categories": {r["category_name"]: r for r in rows},
        "seed": cfg.seed, "ratio_file": str(cfg.ratio_file), "ratio_file_sha256": ratio_file_digest(cfg.ratio_file),
        "output": str(cfg.sampled_path),
    }
    if cfg.eval_size is not None:
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
