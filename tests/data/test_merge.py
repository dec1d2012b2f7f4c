"""loss_turns and pseudo-multiturn merging: rules, token budget, determinism, per-message categories."""
import collections
import copy
import itertools
from dataclasses import replace

import numpy as np
import orjson
import pytest

from data import merge
from data.config import DataConfig, MergeConfig
from data.executor import LocalExecutor
from data.fidelity import FidelityOptions
from data.io import iter_jsonl, iter_rows
from data.report import check_arithmetic, read_report
from tests.conftest import fixture_path, tokenizer_dir


def rec(uid, cat=1, turns=1, system=None, **extra):
    messages = [{"role": "system", "content": system}] if system else []
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {uid}.{t}"},
                     {"role": "assistant", "content": f"answer {uid}.{t}"}]
    labels = [int(m["role"] == "assistant") for m in messages]
    return {"messages": messages, "labels": labels,
            "meta": {"category_id": cat, "category_name": f"c{cat}", "uid": uid}, **extra}


def setup(tmp_path, records, tokenizer="qwen2_5_instruct", **kw) -> DataConfig:
    kw.setdefault("num_workers", 1)
    tok = str(tokenizer_dir(tokenizer)) if tokenizer else "unused"
    cfg = DataConfig(inputs=[], output_dir=str(tmp_path / "out"), tokenizer_path=tok, **kw)
    cfg.out.mkdir(parents=True, exist_ok=True)
    cfg.sampled_path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return cfg


# ---------------------------------------------------------------------------------------------- loss_turns
def test_loss_turns_last_vs_all_on_three_turns(tmp_path):
    three = rec(0, turns=3, system="sys")
    assert three["labels"] == [0, 0, 1, 0, 1, 0, 1]
    r = copy.deepcopy(three)
    assert merge.apply_loss_turns(r, "all") == 0 and r["labels"] == [0, 0, 1, 0, 1, 0, 1]
    assert merge.apply_loss_turns(r, "last") == 2 and r["labels"] == [0, 0, 0, 0, 0, 0, 1]
    # explicit labels: the last LABELLED assistant message keeps its label, not the last assistant message
    r = copy.deepcopy(three)
    r["labels"] = [0, 0, 1, 0, 1, 0, 0]
    merge.apply_loss_turns(r, "last")
    assert r["labels"] == [0, 0, 0, 0, 1, 0, 0]
    # probability 0: no tokenizer needed, loss_turns still applied, records otherwise unchanged
    cfg = setup(tmp_path, [three, rec(1)], tokenizer=None, loss_turns="last")
    section = merge.run(cfg)
    out = list(iter_jsonl(cfg.merged_path))
    assert [o["labels"] for o in out] == [[0, 0, 0, 0, 0, 0, 1], [0, 1]]
    assert out[1] == rec(1)
    assert section["labels_zeroed_by_loss_turns"] == 2 and section["in"] == section["out"] == 2


def test_probability_zero_copies_by_ranges_whatever_the_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(merge, "COPY_RANGE_BYTES", 100)
    records = [rec(i, turns=1 + i % 3) for i in range(30)]
    outputs = []
    for workers in (1, 3):
        cfg = setup(tmp_path / str(workers), records, tokenizer=None, loss_turns="last", num_workers=workers)
        section = merge.run(cfg)
        assert section["group_sizes"] == {"1": 30} and section["labels_zeroed_by_loss_turns"] == 30
        outputs.append(cfg.merged_path.read_bytes())
    assert outputs[0] == outputs[1] and [o["meta"]["uid"] for o in iter_jsonl(cfg.merged_path)] == list(range(30))


def test_loss_turns_last_applies_per_original_record_when_merged(tmp_path):
    cfg = setup(tmp_path, [rec(0, turns=2), rec(1, turns=3)], loss_turns="last",
                merge=MergeConfig(probability=1.0, max_tokens=10_000))
    merge.run(cfg)
    (merged,) = list(iter_jsonl(cfg.merged_path))
    assert merged["labels"] == [0, 0, 0, 1] + [0, 0, 0, 0, 0, 1]
    assert merged["meta"]["uids"] == [0, 1]


# ---------------------------------------------------------------------------------------------- pure rules
def test_merge_records_categories_and_duplicate_system_prompt():
    a, b, c = rec(0, cat=1, system="S"), rec(1, cat=2, system="S"), rec(2, cat=3)
    b["messages"][2]["category_id"] = 7  # a message's own category wins
    merged = merge.merge_records([a, b, c])
    assert [m["role"] for m in merged["messages"]] == ["system", "user", "assistant", "user", "assistant",
                                                      "user", "assistant"]
    assert [m["category_id"] for m in merged["messages"]] == [1, 1, 1, 2, 7, 3, 3]
    assert merged["labels"] == [0, 0, 1, 0, 1, 0, 1]
    assert merged["meta"] == {"category_id": 1, "category_name": "c1", "uids": [0, 1, 2],
                              "parts": [{"start": 0, "system": True}, {"start": 3, "system": True},
                                        {"start": 5, "system": False}]}
    assert merge.merge_records([a]) is a


def block_reason(group, group_tokens, record, tokens, budget):
    return merge.block_reason(merge.merge_key(group[0]), group_tokens, merge.merge_key(record), tokens, budget)


def test_merge_block_reasons():
    group = [rec(0, system="S")]
    assert block_reason(group, 10, rec(1), 5, 100) is None
    assert block_reason(group, 10, rec(1, system="S"), 5, 100) is None
    assert block_reason(group, 10, rec(1, system="other"), 5, 100) == "system_prompt"
    assert block_reason([rec(0)], 10, rec(1, system="S"), 5, 100) == "system_prompt"
    assert block_reason(group, 10, rec(1, tools=[{"type": "function"}]), 5, 100) == "tools"
    assert block_reason(group, 10, rec(1, enable_thinking=True), 5, 100) == "enable_thinking"
    assert block_reason(group, 60, rec(1), 40, 100) is None
    assert block_reason(group, 61, rec(1), 40, 100) == "token_budget"
    assert block_reason(group, None, rec(1), 40, 100) == "record_error"
    assert block_reason(group, 10, rec(1), None, 100) == "record_error"


@pytest.mark.parametrize("a, b, equal", [
    ([{"x": 1, "y": True}], [{"y": 1, "x": 1.0}], True),  # == in Python: key order, bool/int/float
    ([{"x": 1}], [{"x": 1.5}], False), ([{"x": 1}], [{"x": "1"}], False), ([1, 2], [2, 1], False),
    (None, [], False), ({"a": [0.0]}, {"a": [-0]}, True)])
def test_merge_keys_are_equal_exactly_when_the_values_are(a, b, equal):
    """The merge rules compare records through `merge_key` digests; they must agree with Python's ==."""
    assert (a == b) is equal
    assert (merge.merge_key(rec(0, tools=a)) == merge.merge_key(rec(0, tools=b))) is equal
    assert merge.merge_key(rec(0))[0] == 0 and merge.merge_key(rec(0, system="S"))[0] != 0


# ---------------------------------------------------------------------------------------------- stage
def _fixture_records(name, n):
    from data.config import InputSpec
    from data.preprocess import convert_row, detect_format

    path = fixture_path("data", name)
    out = []
    for source, raw in itertools.islice(iter_rows(str(path)), n):
        fmt, spec = detect_format(raw, InputSpec(path=[str(path)]), source)
        out.append(convert_row(raw, spec, fmt, source)[0])
    return out


@pytest.mark.parametrize("tokenizer,data", [
    ("qwen2_5_instruct", ["llamafactory_glaive_toolcall_en_demo.json", "llamafactory_reason_tool_use_demo_50.jsonl"]),
    ("qwen3", ["llamafactory_reason_tool_use_demo_50.jsonl", "skyt1_math500_longcot.messages.jsonl"]),
    ("llama3_1_instruct", ["fastchat_dummy_conversation.json", "gsm8k_test.jsonl"]),
    ("phi3_mini_instruct", ["fastchat_dummy_conversation.json", "gsm8k_test.jsonl"]),
])
def test_batched_token_counts_equal_apply_chat_template(tokenizer, data):
    tok = merge._tokenizer((str(tokenizer_dir(tokenizer)), None))  # the per-process cache run() uses
    records = [r for name in data for r in _fixture_records(name, 6)]
    expected = [len(tok.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=True)["input_ids"])
                for r in records]
    as_given = FidelityOptions(reasoning="template", tool_arguments="keep")  # the template's own behaviour
    assert merge.count_tokens_batch(tok, records, as_given) == expected
    if tokenizer == "qwen3":  # enable_thinking reaches the template
        off = merge.count_tokens_batch(tok, records[:1], replace(as_given, enable_thinking=False))[0]
        assert off == len(tok.apply_chat_template(records[0]["messages"], tools=records[0].get("tools"),
                                                  tokenize=True, enable_thinking=False)["input_ids"])


def test_gpt2_without_chat_template_is_a_clear_error(tmp_path):
    cfg = setup(tmp_path, [rec(0), rec(1)], tokenizer="gpt2", merge=MergeConfig(probability=1.0))
    with pytest.raises(ValueError, match="has no chat template; set chat_template"):
        merge.run(cfg)


def test_token_budget_blocks_merges(tmp_path):
    records = [rec(i) for i in range(6)]
    tok = merge._tokenizer((str(tokenizer_dir("qwen2_5_instruct")), None))
    counts = merge.count_tokens_batch(tok, records, FidelityOptions())
    n = counts[0]
    assert counts == [n] * 6
    cfg = setup(tmp_path, records, merge=MergeConfig(probability=1.0, max_tokens=2 * n + 1))
    section = merge.run(cfg)
    out = list(iter_jsonl(cfg.merged_path))
    assert [o["meta"]["uids"] for o in out] == [[0, 1], [2, 3], [4, 5]]
    assert section["blocked"] == {"token_budget": 2} and section["group_sizes"] == {"2": 3}
    assert section["dropped"] == {"merged_into_previous": 3}
    check_arithmetic(section)
    assert read_report(cfg.report_path)["merge"] == section
    # default budget: max_length
    cfg = setup(tmp_path, records, merge=MergeConfig(probability=1.0), max_length=3 * n)
    assert merge.run(cfg)["group_sizes"] == {"3": 2}


def _mixed_records():
    out = []
    for i in range(40):
        system = ["S", None, "T"][i % 3] if i % 5 else None
        out.append(rec(i, cat=1 + i % 4, turns=1 + i % 3, system=system))
    return out


def test_merging_is_seeded_and_identical_for_any_worker_count_and_range_size(tmp_path, monkeypatch):
    outputs, sections = [], []
    for workers, seed, range_bytes in ((1, 5, 1 << 20), (2, 5, 400), (3, 5, 1), (1, 6, 1 << 20)):
        monkeypatch.setattr(merge, "MERGE_RANGE_BYTES", range_bytes)
        cfg = setup(tmp_path / f"{workers}_{seed}_{range_bytes}", _mixed_records(), num_workers=workers, seed=seed,
                    merge=MergeConfig(probability=0.6, max_tokens=120))
        section = merge.run(cfg)
        check_arithmetic(section)
        outputs.append(cfg.merged_path.read_bytes())
        sections.append({k: v for k, v in section.items() if k != "output"})
    assert outputs[0] == outputs[1] == outputs[2] and sections[0] == sections[1] == sections[2]
    assert outputs[0] != outputs[3]
    merged = [orjson.loads(line) for line in outputs[0].splitlines()]
    assert sum(len(m["meta"].get("uids", [0])) for m in merged) == 40
    groups = [m for m in merged if "uids" in m["meta"]]
    assert groups, "probability 0.6 must merge some records"
    originals = {r["meta"]["uid"]: r for r in _mixed_records()}
    for g in groups:
        head = originals[g["meta"]["uids"][0]]
        # each message carries its original record's category; system prompt only first
        expected_cats, expected_roles = [], []
        for k, uid in enumerate(g["meta"]["uids"]):
            o = originals[uid]
            msgs = o["messages"][1:] if k and o["messages"][0]["role"] == "system" else o["messages"]
            if k:
                assert merge.system_prompt(o) in (None, merge.system_prompt(head))
            expected_cats += [o["meta"]["category_id"]] * len(msgs)
            expected_roles += [m["role"] for m in msgs]
        assert [m["category_id"] for m in g["messages"]] == expected_cats
        assert [m["role"] for m in g["messages"]] == expected_roles


def test_run_matches_a_reference_that_counts_every_record(tmp_path, monkeypatch):
    """Only records at a drawn merge boundary are counted; the groups equal those of a plain reference."""
    records = _mixed_records()
    tok = merge._tokenizer((str(tokenizer_dir("qwen2_5_instruct")), None))
    counts = merge.count_tokens_batch(tok, records, FidelityOptions())
    p, budget, seed = 0.4, 150, 11
    joins = merge.join_draws(seed, p, 0, len(records))
    groups, sizes = [], []
    for i, r in enumerate(records):
        if joins[i] and block_reason(groups[-1], sizes[-1], r, counts[i], budget) is None:
            groups[-1].append(r)
            sizes[-1] += counts[i]
        else:
            groups.append([r])
            sizes.append(counts[i])
    expected = [[r["meta"]["uid"] for r in g] for g in groups]

    counted = []
    real = merge.count_tokens_batch
    monkeypatch.setattr(merge, "count_tokens_batch",
                        lambda t, recs, o, *rest: counted.extend(recs) or real(t, recs, o, *rest))
    cfg = setup(tmp_path, records, seed=seed, merge=MergeConfig(probability=p, max_tokens=budget))
    merge.run(cfg)
    got = [o["meta"].get("uids", [o["meta"].get("uid")]) for o in iter_jsonl(cfg.merged_path)]
    assert got == expected
    assert any(len(g) > 1 for g in got) and len(counted) < len(records)


# ---------------------------------------------------------------------------------------------- range-local decisions
def _synthetic_records(rng, n):
    """Records whose token count (`n`, None: fails on its own) and merge key (`k`) the test sets directly."""
    out = []
    for i in range(n):
        tokens = None if rng.random() < 0.05 else rng.randint(1, 120)
        key = rng.choice([0, 0, 0, 0, 0, 0, 0, 1, 2])  # mostly equal: chains form, and keys block some
        out.append({**rec(i), "n": tokens, "k": key})
    return out


def _fake_prepare_records(records, needed, loss_turns, tokenizer_key, opts, sources):
    """`merge.prepare_records` with the records' own counts and keys; those not asked for are None, so a decision
    that used one would differ from the reference (a record error, or a key that compares unequal)."""
    zeroed = [merge.apply_loss_turns(r, loss_turns) for r in records]
    return (zeroed, [r["n"] if need else None for r, need in zip(records, needed)],
            [(r["k"], 0, 0, 0) if need else None for r, need in zip(records, needed)])


def _sequential_groups(records, seed, probability, budget):
    """Brute force: `GroupDecider` over every record in order, with every count, and the same per-record draws."""
    joins = merge.join_draws(seed, probability, 0, len(records))
    decider, groups = merge.GroupDecider(budget), []
    for join, r in zip(joins.tolist(), records):
        if decider.starts_group(join, r["n"], (r["k"], 0, 0, 0)):
            groups.append([])
        groups[-1].append(r["meta"]["uid"])
    return groups, decider.blocked


@pytest.mark.parametrize("seed", [0, 7, 12345])
@pytest.mark.parametrize("probability", [0.2, 0.5, 0.9, 1.0])
def test_range_local_decisions_equal_the_sequential_walk(tmp_path, monkeypatch, seed, probability):
    """The groups decided range by range and linked on the driver are those of one `GroupDecider` over all records
    (same draws, same rule, blocked counts included), whatever the range size (one record a range: every group
    straddles; whole ranges of records that all try to join) and the worker count."""
    import random

    rng = random.Random(seed)
    records = _synthetic_records(rng, 300)
    budget = 150
    expected, blocked = _sequential_groups(records, seed, probability, budget)
    assert any(len(g) > 1 for g in expected) and blocked.get("token_budget")
    assert probability == 0.2 or blocked.get("record_error")
    assert probability == 1.0 or blocked.get("system_prompt")
    monkeypatch.setattr(merge, "prepare_records", _fake_prepare_records)
    all_prefix = []
    real_link = merge.GroupLinker.link
    monkeypatch.setattr(merge.GroupLinker, "link", lambda self, decided: all_prefix.append(
        decided.records > 1 and decided.open_group is None) or real_link(self, decided))
    lines = [orjson.dumps(r) + b"\n" for r in records]
    lines[40:40] = [b"\n", b"  \n"]  # blank lines: not records, and a range of only them
    outputs = set()
    for workers, range_bytes in ((1, 1), (2, 500), (3, 1), (1, 1 << 20)):
        monkeypatch.setattr(merge, "MERGE_RANGE_BYTES", range_bytes)
        cfg = setup(tmp_path / f"{workers}_{range_bytes}", [], num_workers=workers, seed=seed,
                    merge=MergeConfig(probability=probability, max_tokens=budget))
        cfg.sampled_path.write_bytes(b"".join(lines))
        section = merge.run(cfg)
        got = [m["meta"].get("uids", [m["meta"].get("uid")]) for m in iter_jsonl(cfg.merged_path)]
        assert got == expected, (workers, range_bytes)
        assert section["blocked"] == dict(sorted(blocked.items()))
        assert section["group_sizes"] == {str(k): v for k, v in sorted(
            collections.Counter(len(g) for g in expected).items())}
        outputs.add(cfg.merged_path.read_bytes())
    assert len(outputs) == 1
    assert probability < 0.9 or any(all_prefix), "no range was all prefix"


def test_join_draws_are_per_record():
    """A record's draw depends on (seed, its index) only: drawn alone or with any neighbours, the same."""
    whole = merge.join_draws(3, 0.4, 0, 1000)
    assert not whole[0] and 300 < whole.sum() < 500
    for first, count in ((0, 1), (1, 10), (517, 300), (999, 1)):
        np.testing.assert_array_equal(merge.join_draws(3, 0.4, first, count), whole[first:first + count])
    assert (merge.join_draws(4, 0.4, 0, 1000) != whole).any()


class _SpyExecutor(LocalExecutor):
    """One process; `in_worker` says whether a worker function is running (else the driver is)."""
    in_worker = False

    def map(self, fn, tasks, size="ranges", setup=None):
        def worker(task):
            _SpyExecutor.in_worker = True
            try:
                return fn(task)
            finally:
                _SpyExecutor.in_worker = False
        return super().map(worker, tasks, size, setup)


def test_the_driver_does_no_per_record_work(tmp_path, monkeypatch):
    """The driver decides only the records at a range's start that try to join a group of earlier ranges; it
    parses, counts and builds no record."""
    import random

    records = _synthetic_records(random.Random(3), 3000)
    monkeypatch.setattr(merge, "prepare_records", _fake_prepare_records)
    monkeypatch.setattr(merge, "MERGE_RANGE_BYTES", 20_000)  # ~150 records a range
    calls = collections.Counter()
    real_starts_group, real_merge_records = merge.GroupDecider.starts_group, merge.merge_records

    def starts_group(self, *args):
        calls["driver decisions" if not _SpyExecutor.in_worker else "worker decisions"] += 1
        return real_starts_group(self, *args)

    def merge_records(group):
        calls["driver merges" if not _SpyExecutor.in_worker else "worker merges"] += 1
        return real_merge_records(group)

    monkeypatch.setattr(merge.GroupDecider, "starts_group", starts_group)
    monkeypatch.setattr(merge, "merge_records", merge_records)
    cfg = setup(tmp_path, records, seed=1, merge=MergeConfig(probability=0.2, max_tokens=300))
    section = merge.run(cfg, executor=_SpyExecutor(1))
    n_ranges = len(merge.byte_ranges(cfg.sampled_path, merge.MERGE_RANGE_BYTES))
    assert n_ranges > 10 and section["out"] < 2800
    assert calls["worker decisions"] > 2900 and calls["worker merges"] == section["out"]
    assert calls["driver decisions"] < 2 * n_ranges and not calls["driver merges"]
