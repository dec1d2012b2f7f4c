"""The eval split (`eval_size`): per category, seeded, taken before sampling copies and merging, packed into
<output_dir>/eval/packed with the training data's tokenizer, every record accounted for, any worker count."""
from __future__ import annotations

import numpy as np
import orjson
import pytest

from common.config import ConfigError
from data import pipeline, sample
from data.config import load_config
from data.report import check_arithmetic, read_report
from data.shards.dataset import PackedDataset
from tests.conftest import ROOT


def _example_config(tmp_path, **extra) -> str:
    """The embedded example (410 records, four categories), its own ratio file, output under tmp_path."""
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    for spec in raw["inputs"]:
        spec["path"] = str(ROOT / spec["path"])
    raw.update(output_dir=str(tmp_path / "out"), tokenizer_path=str(ROOT / raw["tokenizer_path"]),
               ratio_path=str(tmp_path / "ratios.json"), num_workers=1)
    raw.update(extra)
    path = tmp_path / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(raw))
    return str(path)


def _tree(path):
    """The outputs under `path` (provenance.json, which holds modification times, is not an output)."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != "provenance.json"}


def test_eval_quotas_fraction_per_category_count_shared_out_by_size():
    assert sample.eval_quotas({1: 100, 2: 10, 3: 5}, 0.1) == {1: 10, 2: 1, 3: 1}  # 0.5 rounds up
    quotas = sample.eval_quotas({1: 300, 2: 100, 3: 7}, 40)
    assert sum(quotas.values()) == 40 and quotas == {1: 29, 2: 10, 3: 1}  # 29.48, 9.83, 0.69
    assert sample.eval_quotas({1: 1, 2: 3}, 0.9) == {1: 0, 2: 2}  # every category keeps a training record
    with pytest.raises(sample.SamplingError, match="hold only 13"):
        sample.eval_quotas({1: 10, 2: 3}, 13)


def test_eval_size_is_validated(tmp_path):
    for bad, message in (("eval_size=0", "eval_size=0: a count of records must be >= 1"),
                         ("eval_size=-3", "eval_size=-3: a count of records must be >= 1"),
                         ("eval_size=1.5", r"eval_size=1.5: a fraction \(a number with a decimal point\) must be in "
                                           r"\(0, 1\)")):
        with pytest.raises(ConfigError, match=message):
            load_config(_example_config(tmp_path), [bad]).validate()
    assert load_config(_example_config(tmp_path), ["eval_size=0.25"]).eval_size == 0.25
    assert load_config(_example_config(tmp_path), ["eval_size=40"]).eval_size == 40


def test_eval_size_integer_is_a_count_float_a_fraction(tmp_path):
    """`1` holds out one record; `1.0` is the fraction 1.0 (every record: nothing left to train), refused naming
    the key and the value, from an override or from the config file alike; no float becomes a count."""
    one = load_config(_example_config(tmp_path), ["eval_size=1"])
    assert one.eval_size == 1 and isinstance(one.eval_size, int)
    one.validate()
    for config, overrides in ((_example_config(tmp_path), ["eval_size=1.0"]),
                              (_example_config(tmp_path, eval_size=1.0), [])):
        cfg = load_config(config, overrides)
        assert cfg.eval_size == 1.0 and isinstance(cfg.eval_size, float)
        with pytest.raises(ConfigError, match=r"eval_size=1.0: a fraction .* must be in \(0, 1\): 1.0 would hold out "
                                              r"every record and leave nothing to train; .*eval_size: 1"):
            cfg.validate()
    two = load_config(_example_config(tmp_path, eval_size=2.0), [])
    assert isinstance(two.eval_size, float)


def test_eval_split_is_held_out_before_sampling_and_merging_and_packed_beside(tmp_path, capsys):
    config = _example_config(tmp_path, eval_size=0.1, merge={"probability": 0.5})
    pipeline.main([config])
    lines = capsys.readouterr().out.splitlines()
    out = tmp_path / "out"
    assert lines[-2:] == [f"eval split: {out / 'eval' / 'packed'}", f"packed: {out / 'packed'}"]
    assert any(line.startswith("[pack eval] in=") for line in lines)

    report, eval_report = read_report(out / "report.json"), read_report(out / "eval" / "report.json")
    held = report["sample"]["dropped"]["held_out_for_eval"]
    assert report["sample"]["eval"]["records"] == held == eval_report["sample"]["out"] == 41  # 10% of each category
    assert {name: row["eval"] for name, row in report["sample"]["categories"].items()} == \
        {name: row["after"] for name, row in eval_report["sample"]["categories"].items()}
    for section in [*report.values(), *eval_report.values()]:
        check_arithmetic(section)
    assert list(eval_report) == ["sample", "merge", "tokenize", "pack"]
    assert eval_report["merge"]["dropped"] == {}  # eval records are never merged, not even with each other
    assert report["preprocess"]["out"] == report["sample"]["out"] + held  # every sample rate of the example is 1

    train, evaluation = PackedDataset(out / "packed"), PackedDataset(out / "eval" / "packed")
    assert evaluation.meta["tokenizer_hash"] == train.meta["tokenizer_hash"]
    assert evaluation.kind == "packed" and (out / "eval" / "packed" / "stats.json").is_file()
    eval_uids = set(evaluation.all_uids.tolist())
    assert len(eval_uids) == held and not eval_uids & set(train.all_uids.tolist())  # no record in both

    # byte-identical whatever the worker count (the split is decided on the driver, seeded)
    one_worker = _tree(out / "eval")
    pipeline.main([config, "num_workers=2"])
    assert _tree(out / "eval") == one_worker

    # turning the split off removes the earlier one: the trainer would evaluate on stale data
    pipeline.main([config, "eval_size=null", "--stages", "sample"])
    assert not (out / "eval").exists()


def test_a_count_takes_that_many_records_and_another_seed_other_ones(tmp_path):
    config = _example_config(tmp_path, eval_size=40)
    pipeline.main([config, "--stages", "preprocess,sample"])
    first = (tmp_path / "out" / "eval" / "sampled.jsonl").read_bytes().splitlines()
    assert len(first) == 40
    pipeline.main([config, "--stages", "sample", "seed=7"])
    second = (tmp_path / "out" / "eval" / "sampled.jsonl").read_bytes().splitlines()
    assert len(second) == 40 and first != second
    uids = [orjson.loads(line)["meta"]["uid"] for line in second]
    assert uids == sorted(uids)  # canonical order
    sampled = {orjson.loads(line)["meta"]["uid"] for line in (tmp_path / "out" / "sampled.jsonl").read_bytes().splitlines()}
    assert not sampled & set(uids) and len(sampled) + 40 == 410


def test_eval_split_leaves_out_categories_with_rate_zero(tmp_path):
    config = _example_config(tmp_path, eval_size=0.2)
    pipeline.main([config, "--stages", "preprocess"])
    ratios = orjson.loads((tmp_path / "ratios.json").read_bytes())
    for entry in ratios["categories"]:
        entry["sample_rate"] = 0 if entry["category_name"] == "chat" else 2
    (tmp_path / "ratios.json").write_bytes(orjson.dumps(ratios))
    pipeline.main([config, "--stages", "sample"])
    section = read_report(tmp_path / "out" / "report.json")["sample"]
    assert section["categories"]["chat"]["eval"] == 0
    math_row = section["categories"]["math"]
    assert math_row["after"] == 2 * (math_row["before"] - math_row["eval"])  # copies only of training records
    check_arithmetic(section)
    categories = np.array([orjson.loads(line)["meta"]["category_name"] == "chat" for line in
                           (tmp_path / "out" / "eval" / "sampled.jsonl").read_bytes().splitlines()])
    assert not categories.any()
