"""Ratio sampling: exact counts per rate, copies, seeded determinism, errors, report arithmetic."""
import dataclasses
import tracemalloc
from collections import Counter

import numpy as np
import orjson
import pytest

from data import sample
from data.config import DataConfig
from data.io import iter_jsonl
from data.ratios import write_ratio_file
from data.randomness import SAMPLE_EVAL, SAMPLE_FRACTION, SAMPLE_ORDER, record_keys
from data.report import check_arithmetic, read_report


def test_fraction_count_rounds_half_up():
    assert [sample.fraction_count(r, 10) for r in (0, 0.04, 0.05, 0.25, 0.5, 1.0, 1.1, 2.55)] == [0, 0, 1, 3, 5, 0, 1, 6]
    assert sample.fraction_count(0.999, 3) == 3


def brute_force(cfg: DataConfig, rates: dict[str, float], eval_size=None) -> tuple[bytes, bytes]:
    """sampled.jsonl and eval/sampled.jsonl by the documented rule, record by record: per category, the eval
    records are the m with the smallest SAMPLE_EVAL keys, the fractional part the training records with the
    smallest SAMPLE_FRACTION keys; the output is every (record, copy) pair sorted by SAMPLE_ORDER key."""
    lines = [line for line in cfg.canonical_path.read_bytes().splitlines() if line.strip()]
    categories = np.array([orjson.loads(line)["meta"]["category_id"] for line in lines])
    names = {orjson.loads(line)["meta"]["category_id"]: orjson.loads(line)["meta"]["category_name"] for line in lines}
    index = np.arange(len(lines))

    def smallest(stream, members, m):
        return members[np.argsort(record_keys(cfg.seed, stream, members))[:m]]

    held = np.zeros(0, dtype=np.int64)
    if eval_size is not None:
        sizes = {int(c): int((categories == c).sum()) for c in np.unique(categories) if rates[names[int(c)]] > 0}
        held = np.concatenate([smallest(SAMPLE_EVAL, index[categories == c], m)
                               for c, m in sample.eval_quotas(sizes, eval_size).items()])
    training = np.ones(len(lines), dtype=bool)
    training[held] = False
    pairs = []
    for c in np.unique(categories).tolist():
        members = index[(categories == c) & training]
        rate = rates[names[c]]
        full = int(rate)
        pairs += [(i, k) for i in members.tolist() for k in range(full)]
        pairs += [(i, full) for i in smallest(SAMPLE_FRACTION, members, sample.fraction_count(rate, len(members)))]
    pairs.sort(key=lambda p: (int(record_keys(cfg.seed, SAMPLE_ORDER, p[0], p[1])), p[0], p[1]))
    return (b"".join(sample.sampled_line(lines[i], k) for i, k in pairs),
            b"".join(lines[i] + b"\n" for i in sorted(held.tolist())))


RATES = {"a": 0.37, "b": 2.5, "c": 0.0, "d": 1.0, "e": 0.999}
SIZES = {"a": 300, "b": 41, "c": 17, "d": 60, "e": 3}


@pytest.mark.parametrize("eval_size", [None, 0.1, 25])
def test_output_is_the_documented_rule_whatever_the_ranges_buckets_and_workers(tmp_path, monkeypatch, eval_size):
    """Exact counts per category, the fractional and eval records those with the smallest keys, the order the
    key sort: equal to the rule computed record by record, with one range or ranges of ~200 bytes, one output
    bucket or many, 1 or 3 workers."""
    cfg = dataclasses.replace(_setup(tmp_path, RATES, SIZES), eval_size=eval_size)
    expected, expected_eval = brute_force(cfg, RATES, eval_size)
    outputs = set()
    for range_bytes, bucket_bytes, workers in ((1 << 30, 1 << 30, 1), (200, 2000, 1), (200, 2000, 3),
                                               (1000, 300, 2)):
        monkeypatch.setattr(sample, "RANGE_BYTES", range_bytes)
        monkeypatch.setattr(sample, "BUCKET_BYTES", bucket_bytes)
        section = sample.run(dataclasses.replace(cfg, num_workers=workers))
        eval_out = cfg.eval_config().sampled_path.read_bytes() if eval_size is not None else b""
        outputs.add((cfg.sampled_path.read_bytes(), eval_out))
        check_arithmetic(section)
    assert outputs == {(expected, expected_eval)}
    recs = list(iter_jsonl(cfg.sampled_path))
    held = Counter(r["meta"]["category_name"] for r in iter_jsonl(cfg.eval_config().sampled_path)) \
        if eval_size is not None else Counter()
    for name, n in SIZES.items():
        rate, n_train = RATES[name], n - held[name]
        assert section["categories"][name]["after"] == int(rate) * n_train + sample.fraction_count(rate, n_train)
        assert sum(r["meta"]["category_name"] == name for r in recs) == section["categories"][name]["after"]
    if eval_size is not None:
        eligible = {k + 1: n for k, (name, n) in enumerate(SIZES.items()) if RATES[name] > 0}
        quotas = sample.eval_quotas(eligible, eval_size)
        assert {name: held[name] for name in SIZES} == {name: quotas.get(k + 1, 0) for k, name in enumerate(SIZES)}
    assert [p.name for p in cfg.out.glob(".*")] == [], "parts or temp files left behind"


def test_choices_are_seeded_per_record(tmp_path):
    """Another seed gives other choices; a category's choices do not depend on the other categories, their
    rates or the records around: the keys are the record's own."""
    def picked(cfg):
        recs = list(iter_jsonl(cfg.sampled_path))
        return [(r["meta"]["uid"], r["meta"].get("copy", 0)) for r in recs], \
            sorted(r["meta"]["uid"] for r in recs if r["meta"]["category_name"] == "a")

    cfg = _setup(tmp_path, {"a": 0.5, "b": 1.7}, {"a": 40, "b": 40})
    sample.run(cfg)
    order, a_picks = picked(cfg)
    assert len(a_picks) == 20 and order != sorted(order)  # shuffled
    sample.run(dataclasses.replace(cfg, seed=4))
    assert picked(cfg)[1] != a_picks
    write_ratio_file(cfg.ratio_file, [{"category_id": 1, "category_name": "a", "size": 40, "sample_rate": 0.5},
                                      {"category_id": 2, "category_name": "b", "size": 40, "sample_rate": 0.0}])
    sample.run(cfg)
    assert picked(cfg)[1] == a_picks


def test_driver_memory_is_flat_in_the_record_count(tmp_path):
    """The driver keeps numbers per range, category and bucket, none per record: its peak traced memory grows
    by far less than a byte a record from N to 4N records (the workers, other processes, are not traced)."""
    peaks = []
    for n in (5_000, 20_000):
        cfg = dataclasses.replace(_setup(tmp_path / str(n), {"a": 0.5, "b": 2.5}, {"a": n // 2, "b": n // 2}),
                                  eval_size=0.1, num_workers=2)
        tracemalloc.start()
        sample.run(cfg)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] - peaks[0] < 15_000, peaks


def _setup(tmp_path, rates: dict[str, float], sizes: dict[str, int]) -> DataConfig:
    cfg = DataConfig(inputs=[], output_dir=str(tmp_path / "out"), tokenizer_path="unused", seed=3)
    cfg.out.mkdir(parents=True)
    ids = {name: i + 1 for i, name in enumerate(sizes)}
    uid = 0
    with open(cfg.canonical_path, "wb") as f:
        for name, n in sizes.items():
            for _ in range(n):
                rec = {"messages": [{"role": "user", "content": f"q{uid}"}, {"role": "assistant", "content": "a"}],
                       "labels": [0, 1], "meta": {"category_id": ids[name], "category_name": name, "uid": uid}}
                f.write(orjson.dumps(rec) + b"\n")
                uid += 1
    write_ratio_file(cfg.ratio_file, [{"category_id": ids[n], "category_name": n, "size": sizes.get(n, 0),
                                       "sample_rate": r} for n, r in rates.items()])
    return cfg


def test_run_writes_sampled_records_with_copies_and_report(tmp_path, capsys):
    cfg = _setup(tmp_path, {"a": 0.5, "b": 2.5, "c": 0.0}, {"a": 8, "b": 4, "c": 3})
    section = sample.run(cfg)
    recs = list(iter_jsonl(cfg.sampled_path))
    by_cat = Counter(r["meta"]["category_name"] for r in recs)
    assert by_cat == {"a": 4, "b": 10}
    b_copies = Counter((r["meta"]["uid"], r["meta"].get("copy", 0)) for r in recs if r["meta"]["category_name"] == "b")
    assert all(n == 1 for n in b_copies.values())  # no (uid, copy) twice
    assert sorted(Counter(u for u, _ in b_copies).values()) == [2, 2, 3, 3]
    # copies keep the record (uid, text), only meta.copy is added
    canon = {r["meta"]["uid"]: r for r in iter_jsonl(cfg.canonical_path)}
    for r in recs:
        copy = r["meta"].pop("copy", 0)
        assert r == canon[r["meta"]["uid"]] and copy in (0, 1, 2)
    assert section["in"] == 15 and section["out"] == 14
    assert section["dropped"] == {"rate_zero": 3, "not_sampled": 4} and section["added"] == {"copies": 6}
    assert section["categories"]["b"] == {"category_id": 2, "category_name": "b", "sample_rate": 2.5, "before": 4,
                                          "after": 10, "full_copies": 2, "sampled": 2}
    check_arithmetic(section)
    assert read_report(cfg.report_path)["sample"] == section
    table = capsys.readouterr().out
    assert "before" in table and "   2 b" in table and "total" in table
    first = cfg.sampled_path.read_bytes()
    sample.run(cfg)
    assert cfg.sampled_path.read_bytes() == first


def test_bad_rates_are_errors(tmp_path):
    cfg = _setup(tmp_path, {"a": -0.5}, {"a": 2})
    with pytest.raises(ValueError, match=r"\('a'\): sample_rate must be a number in 0..1000 \(copies of each "
                       r"record\), got -0.5"):
        sample.run(cfg)
    for rate in (-0.5, float("nan"), float("inf"), 1e15):
        with pytest.raises(sample.SamplingError, match=r"category 'a' \(id 1\): sample_rate must be a number in "
                           r"0..1000, got "):
            sample.check_rates([{"category_id": 1, "category_name": "a", "sample_rate": rate}], {1: 2}, "r.json",
                               {1: "a"})


def test_ratio_entries_are_matched_by_name(tmp_path):
    cfg = _setup(tmp_path, {"a": 1.0, "b": 0.5}, {"a": 2, "b": 2})
    cats = [{"category_id": 2, "category_name": "a", "sample_rate": 1.0},
            {"category_id": 1, "category_name": "b", "sample_rate": 0.5}]
    write_ratio_file(cfg.ratio_file, cats)  # ids swapped by hand: matching by id would give `a` the rate 0.5
    with pytest.raises(sample.SamplingError, match=r"entry 'a' has id 2, but canonical.jsonl gives that category id "
                       r"1: the ratio file changed after preprocess; re-run from preprocess"):
        sample.run(cfg)
    write_ratio_file(cfg.ratio_file, [{"category_id": 1, "category_name": "a", "sample_rate": 1.0},
                                      {"category_id": 2, "category_name": "b", "sample_rate": 1.0},
                                      {"category_id": 3, "category_name": "c", "sample_rate": 2.0}])
    with pytest.raises(sample.SamplingError, match=r"entry 'c' \(id 3, sample_rate 2.0\) matches no category"):
        sample.run(cfg)


def test_category_missing_from_ratio_file_is_an_error(tmp_path):
    cfg = _setup(tmp_path, {"a": 1.0}, {"a": 2, "b": 1})
    with pytest.raises(sample.SamplingError, match=r"categories \[2\] of the data have no entry: 'b' \(id 2\)"):
        sample.run(cfg)


def test_empty_canonical_and_a_last_line_without_newline(tmp_path):
    """canonical.jsonl's last line without its newline gives the bytes it gives with one; an empty file samples
    nothing."""
    cfg = _setup(tmp_path, {"a": 1.5}, {"a": 9})
    sample.run(cfg)
    expected = cfg.sampled_path.read_bytes()
    cfg.canonical_path.write_bytes(cfg.canonical_path.read_bytes().rstrip(b"\n"))
    sample.run(cfg)
    assert cfg.sampled_path.read_bytes() == expected and expected.count(b"\n") == 14
    write_ratio_file(cfg.ratio_file, [])
    cfg.canonical_path.write_bytes(b"")
    assert sample.run(cfg)["out"] == 0 and cfg.sampled_path.read_bytes() == b""
