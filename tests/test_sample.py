"""Ratio sampling: exact counts per rate, copies, seeded determinism, errors, report arithmetic."""
from collections import Counter

import numpy as np
import orjson
import pytest

from data import sample
from data.config import DataConfig
from data.io import iter_jsonl
from data.preprocess import write_ratio_file
from data.report import check_arithmetic, read_report


def test_fraction_count_rounds_half_up():
    assert [sample.fraction_count(r, 10) for r in (0, 0.04, 0.05, 0.25, 0.5, 1.0, 1.1, 2.55)] == [0, 0, 1, 3, 5, 0, 1, 6]
    assert sample.fraction_count(0.999, 3) == 3


@pytest.mark.parametrize("rate,expected", [(0.0, 0), (0.3, 3), (1.0, 10), (1.5, 15), (2.0, 20), (2.25, 23)])
def test_plan_counts_and_copies(rate, expected):
    categories = np.array([1] * 10 + [2] * 4)
    records, copies = sample.plan(categories, {1: rate, 2: 1.0}, seed=0)
    cat1 = categories[records] == 1
    assert cat1.sum() == expected and (~cat1).sum() == 4
    per_record = Counter(records[cat1].tolist())
    full = int(rate)
    assert all(full <= c <= full + 1 for c in per_record.values())  # without replacement within a copy
    assert sum(c == full + 1 for c in per_record.values()) == expected - 10 * full
    for rec in set(records[cat1].tolist()):  # each record's copies are numbered 0, 1, ...
        assert sorted(copies[records == rec].tolist()) == list(range(per_record[rec]))


def test_plan_is_seeded_and_shuffled():
    categories = np.repeat([1, 2, 3], 50)
    rates = {1: 0.5, 2: 1.0, 3: 1.7}
    a = sample.plan(categories, rates, seed=1)
    b = sample.plan(categories, rates, seed=1)
    c = sample.plan(categories, rates, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    assert not np.all(np.diff(a[0]) >= 0)  # not in input order
    # the picks of one category do not depend on another category's rate
    d = sample.plan(categories, {**rates, 2: 0.0}, seed=1)
    assert sorted(a[0][categories[a[0]] == 1].tolist()) == sorted(d[0][categories[d[0]] == 1].tolist())


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
