"""Nothing lost, nothing silently wrong, round 3 (data side): stale inputs of partial runs, up-sampled copies
packed together, inputs lost to a wrong format, inputs the outputs would overwrite, out-of-memory parsing, long
ratio paths, looping chat templates, temporaries of the older naming."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import orjson
import pytest

from data import pipeline
from data.config import DataConfig, InputSpec
from data.report import read_report
from tests.conftest import ROOT


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


QA = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}


def _cfg(tmp_path, inputs, **kw) -> DataConfig:
    kw.setdefault("num_workers", 1)
    kw.setdefault("tokenizer_path", str(ROOT / "data/example/tokenizer"))
    return DataConfig(inputs=inputs, output_dir=str(tmp_path / "out"), **kw)


# ---------------------------------------------------------------------------------------------- item 18
def test_a_long_ratio_path_keeps_its_temporaries_within_name_max(tmp_path, capsys):
    """A 245-character file name is legal (NAME_MAX 255); its temporary's suffix must not push it over."""
    ratio = tmp_path / ("r" * 240 + ".json")
    assert len(ratio.name) == 245 <= os.pathconf(tmp_path, "PC_NAME_MAX")
    cfg = _cfg(tmp_path, [InputSpec(path=[_jsonl(tmp_path / "a.jsonl", [QA] * 3)], category_name="chat")],
               ratio_path=str(ratio), stages=["preprocess", "sample"])
    pipeline.run_pipeline(cfg)
    assert orjson.loads(ratio.read_bytes())["categories"][0]["size"] == 3
    assert read_report(cfg.report_path)["sample"]["out"] == 3
    # a writer of it killed mid-write leaves a temporary that the next run recognises and removes
    killed = subprocess.Popen([sys.executable, "-c", f"""
import os
from common.fsutil import atomic_writer
with atomic_writer({str(ratio)!r}) as f:
    f.write(b"partial")
    f.flush()
    os.kill(os.getpid(), 9)
"""], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert killed.wait() == -9
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(left.name) <= 255 and f".tmp-{killed.pid}-" in left.name
    capsys.readouterr()
    pipeline.run_pipeline(dataclasses.replace(cfg, stages=["sample"]))
    assert capsys.readouterr().out.startswith(f"[cleanup] removed 1 temporaries of killed runs (0.0 MB): {left}")
    assert not left.exists()


# ---------------------------------------------------------------------------------------------- item 20
def test_a_temporary_of_the_older_pid_only_naming_with_a_live_pid_is_kept_and_said_so(tmp_path, capsys):
    """A temporary named by pid alone (older versions) whose pid runs cannot be told from a live writer's: it is
    kept, and the cleanup line says so, naming it (it was kept silently)."""
    cfg = _cfg(tmp_path, [InputSpec(path=[_jsonl(tmp_path / "a.jsonl", [QA] * 2)], category_name="chat")],
               ratio_path=str(tmp_path / "ratios.json"), stages=["preprocess"])
    out = tmp_path / "out"
    out.mkdir()
    legacy_live = out / f".canonical.jsonl.tmp-{os.getpid()}-abcd1234"
    legacy_live.write_bytes(b"x" * 10)
    legacy_dead = out / f".sampled.jsonl.tmp-{_dead_pid()}-abcd1234"
    legacy_dead.write_bytes(b"y")
    pipeline.run_pipeline(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"[cleanup] removed 1 temporaries of killed runs (0.0 MB): {legacy_dead}"
    assert lines[1] == (f"[cleanup] kept 1 temporary named by pid alone (the naming of older versions) whose pid "
                        f"is running, so it cannot be told from a live writer's; delete it if no run of an older "
                        f"version is writing there: {legacy_live} (pid {os.getpid()})")
    assert legacy_live.exists() and not legacy_dead.exists()


def _config_file(tmp_path, inputs, **kw) -> str:
    raw = {"inputs": inputs, "output_dir": str(tmp_path / "out"), "num_workers": 1,
           "tokenizer_path": str(ROOT / "data/example/tokenizer"), **kw}
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps(raw))
    return str(path)


# ---------------------------------------------------------------------------------------------- item 5
@pytest.mark.parametrize("name, stage", [("canonical.jsonl", "preprocess"), ("merged.jsonl", "merge"),
                                         ("tokenized/raw.jsonl", "tokenize"), ("report.json", "every stage")])
def test_an_input_that_a_stage_would_write_over_is_refused(tmp_path, capsys, name, stage):
    """Inputs named like an output inside output_dir were overwritten (exit 0, the source data gone)."""
    source = tmp_path / "out" / name
    source.parent.mkdir(parents=True)
    _jsonl(source, [QA] * 3)
    before = source.read_bytes()
    config = _config_file(tmp_path, [{"path": str(source), "category_name": "chat"}])
    for stages in ("preprocess,sample,merge", "tokenize"):  # whichever stages run: the next full run would
        with pytest.raises(SystemExit) as exit_info:
            pipeline.main([config, "--stages", stages])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"error: inputs[0].path: {source} is an output of {stage} (output_dir "
                              f"{tmp_path / 'out'}): a run would write over this input")
        assert "move the input out of the output directory, or set another output_dir" in err
    assert source.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted({name.split("/")[0]})


def test_a_glob_that_matches_an_earlier_runs_output_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    _jsonl(out / "mine.jsonl", [QA] * 2)
    _jsonl(out / "sampled.jsonl", [QA])  # an earlier run's output, matched by the glob
    config = _config_file(tmp_path, [{"path": str(out / "*.jsonl"), "category_name": "chat"}])
    with pytest.raises(SystemExit):
        pipeline.main([config, "--stages", "preprocess"])
    assert f"error: inputs[0].path: {out / 'sampled.jsonl'} is an output of sample" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- item 14
@pytest.mark.parametrize("failure", ["orjson", "python"])
def test_a_record_too_large_for_memory_is_an_error_that_says_memory(tmp_path, monkeypatch, capsys, failure):
    """A valid record whose line does not fit in memory was reported (or under skip dropped) as malformed JSON.
    Simulated without allocating: the parser fails on one line as orjson does under a memory limit."""
    path = tmp_path / "big.jsonl"
    big = {**QA, "messages": [{"role": "user", "content": "HUGE"}, QA["messages"][1]]}
    _jsonl(path, [QA, big, QA])
    real_loads = orjson.loads

    def loads(data):
        if b"HUGE" in bytes(data if not isinstance(data, str) else data.encode()):
            if failure == "orjson":
                raise orjson.JSONDecodeError("Not enough memory to allocate buffer for parsing", "", 0)
            raise MemoryError()
        return real_loads(data)

    monkeypatch.setattr(orjson, "loads", loads)
    config = _config_file(tmp_path, [{"path": str(path), "format": "messages", "category_name": "chat"}],
                          on_error="skip")
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([config, "--stages", "preprocess"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    size = len(path.read_bytes().splitlines(True)[1])
    assert err.startswith(f"error: {path}:2: not enough memory to parse this line ({size} bytes")
    assert "malformed" not in err and "nothing was dropped" in err
    assert ("parses a document inside one buffer of about 12 times its size" if failure == "orjson" else
            "raise the memory limit") in err
    assert not (tmp_path / "out" / "canonical.jsonl").exists()
    assert "preprocess" not in read_report(tmp_path / "out" / "report.json")


def test_parse_jsonl_line_raises_memory_errors_and_returns_malformed_json():
    from data.io import LineMemoryError, parse_jsonl_line
    from data.records import RecordError

    assert isinstance(parse_jsonl_line(b'{"a": ', "f.jsonl:3"), RecordError)
    assert parse_jsonl_line(b'{"a": 1}\n', "f.jsonl:3") == {"a": 1}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(orjson, "loads", lambda data: (_ for _ in ()).throw(MemoryError()))
        with pytest.raises(LineMemoryError, match=r"^f\.jsonl:3: not enough memory to parse this line \(9 bytes"):
            parse_jsonl_line(b'{"a": 1}\n', "f.jsonl:3")


# ---------------------------------------------------------------------------------------------- item 0c
def _qa_rows(n, bad=()):
    """GSM8K-style rows (question/answer); rows in `bad` lack the answer."""
    return [{"question": f"q {i}"} if i in bad else {"question": f"q {i}", "answer": f"a {i}"} for i in range(n)]


def test_an_input_that_loses_every_row_under_skip_is_an_error_naming_it(tmp_path, capsys):
    """A wrongly declared format under on_error: skip dropped 100% of the input (150/150 missing_field) with
    `warnings: []`."""
    good = _jsonl(tmp_path / "good.jsonl", [QA] * 3)
    wrong = _jsonl(tmp_path / "gsm8k.jsonl", _qa_rows(150))
    config = _config_file(tmp_path, [{"path": good, "category_name": "chat"},
                                     {"path": wrong, "format": "prompt_response", "category_name": "math"}],
                          on_error="skip")
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([config, "--stages", "preprocess"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: preprocess: inputs[1] ({wrong}, format prompt_response) lost all its 150 rows "
                   f"(missing_field 150; the first: {wrong}:1: prompt: missing field 'prompt'; row has ['answer', "
                   "'question']): nothing of it would be trained. Check its format and keys (prompt_key 'prompt', "
                   "response_key 'response'), or remove it from inputs")
    assert not (tmp_path / "out" / "canonical.jsonl").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_that_loses_most_of_its_rows_is_a_warning(tmp_path, capsys, workers):
    good = _jsonl(tmp_path / "good.jsonl", [QA] * 3)
    mostly = _jsonl(tmp_path / "qa.jsonl", _qa_rows(10, bad={1, 2, 4, 5, 6, 7}))
    fine = _jsonl(tmp_path / "fine.jsonl", _qa_rows(10, bad={3}))
    config = _config_file(tmp_path, [{"path": good, "category_name": "chat"},
                                     {"path": mostly, "format": "prompt_response", "prompt_key": "question",
                                      "response_key": "answer", "category_name": "math"},
                                     {"path": fine, "category_name": "math"}],
                          on_error="skip", num_workers=workers)
    pipeline.main([config, "--stages", "preprocess"])
    warning = (f"inputs[1] ({mostly}, format prompt_response) lost 6 of its 10 rows (60%: missing_field 6; the first: "
               f"{mostly}:2: answer: missing field 'answer'; row has ['question']), more than input_loss_warning 0.5")
    section = read_report(tmp_path / "out" / "report.json")["preprocess"]
    assert section["warnings"] == [warning]
    assert [(st["dropped"], st["dropped_by_reason"]) for st in section["inputs"]] == [
        (0, {}), (6, {"missing_field": 6}), (1, {"missing_field": 1})]
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"WARNING: preprocess: {warning}"
    pipeline.main([config, "--stages", "preprocess", "input_loss_warning=0.6"])
    assert read_report(tmp_path / "out" / "report.json")["preprocess"]["warnings"] == []


# ---------------------------------------------------------------------------------------------- item 19
LOOP = ("{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}")  # 10^10


def _looping_template(tmp_path, when: str) -> str:
    """The example ChatML template, looping 10^10 times for a message that holds `when` ('' : every message)."""
    text = (ROOT / "data/example/chatml.jinja").read_text()
    marker = "{%- for message in messages -%}"
    loop = LOOP if not when else f"{{%- if '{when}' in (message.content or '') -%}}{LOOP}{{%- endif -%}}"
    path = tmp_path / "loop.jinja"
    path.write_text(text.replace(marker, marker + loop, 1))
    return str(path)


def _run_bounded(args, timeout=120):
    """The pipeline in a child process: before the bound, a looping template hung it (the timeout fails the test)."""
    return subprocess.run([sys.executable, "-m", "data.pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.serial  # render_timeout 0.5 s: the other records must render within it
@pytest.mark.parametrize("stage, workers", [("tokenize", 1), ("tokenize", 2), ("merge", 1)])
def test_a_template_that_loops_on_one_record_is_an_error_naming_template_and_record(tmp_path, stage, workers):
    template = _looping_template(tmp_path, "SPIN")
    out = tmp_path / "out"
    out.mkdir()
    spin = {**QA, "messages": [{"role": "user", "content": "SPIN please"}, QA["messages"][1]]}
    rows = [{**r, "meta": {"category_id": 1, "category_name": "chat", "uid": k, "source": f"raw.jsonl:{k + 1}"}}
            for k, r in enumerate([QA, QA, spin, QA])]
    name = "merged.jsonl" if stage == "tokenize" else "sampled.jsonl"
    _jsonl(out / name, rows)
    config = _config_file(tmp_path, [], chat_template=template, render_timeout=0.5, num_workers=workers,
                          max_length=512, merge={"probability": 0.9})
    result = _run_bounded([config, "--stages", stage])
    assert result.returncode == 2, result.stderr
    source = f"{out / name}:3" + (" (from raw.jsonl:3)" if stage == "tokenize" else "")
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: chat_template: {template} (tokenizer {ROOT / 'data/example/tokenizer'}): rendering {source} took "
        "more than render_timeout 0.5 s (the template may loop): fix the template, or raise render_timeout "
        "(null: no bound)")


def test_a_template_that_loops_on_every_conversation_is_refused_before_any_stage(tmp_path):
    template = _looping_template(tmp_path, "")
    config = _config_file(tmp_path, [], chat_template=template, render_timeout=0.5)
    result = _run_bounded([config, "--stages", "tokenize"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: chat_template: {template} (tokenizer {ROOT / 'data/example/tokenizer'}): rendering a "
        "user/assistant exchange (a probe) took more than render_timeout 0.5 s (the template may loop): fix the "
        "template, or raise render_timeout (null: no bound)")


@pytest.mark.serial  # times the bound's cost per record
def test_time_bound_costs_little_and_leaves_nothing_behind():
    import time

    from data.timebound import TimeBoundExceeded, time_bound

    with pytest.raises(TimeBoundExceeded):
        with time_bound(0.05):
            while True:
                pass
    start = time.perf_counter()
    for _ in range(10_000):
        with time_bound(10):
            pass
    assert (time.perf_counter() - start) / 10_000 < 50e-6  # per record, far below a render (~100 us)
    time.sleep(0.3)  # the watchdog looks again: nothing fires outside a bound
    with time_bound(None):
        pass


# ---------------------------------------------------------------------------------------------- item 0
def _two_categories(tmp_path) -> str:
    math = _jsonl(tmp_path / "math.jsonl", _qa_rows(40))
    chat = _jsonl(tmp_path / "chat.jsonl", [QA] * 20)
    return _config_file(tmp_path, [{"path": math, "category_name": "math"}, {"path": chat, "category_name": "chat"}],
                        max_length=256, seed=3)


def _sh(args, cwd):
    """A command as a user types it (`sh data_process.sh ...` from `cwd`)."""
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)


def _packed_categories(out) -> dict[str, int]:
    """Packed sequences per category name (one record each: merge.probability is 0)."""
    from data.shards.dataset import PackedDataset

    names = {rec["meta"]["uid"]: rec["meta"]["category_name"]
             for rec in map(orjson.loads, (out / "canonical.jsonl").read_bytes().splitlines())}
    ds = PackedDataset(out / "packed")
    counts: dict[str, int] = {}
    for row in range(len(ds)):
        for uids in ds.row_uids(row):
            counts[names[int(uids[0])]] = counts.get(names[int(uids[0])], 0) + 1
    return counts


def test_an_edited_ratio_file_takes_effect_by_running_the_command_the_warning_prints(tmp_path):
    """math 1.0 -> 0.1 was silently ignored by the command the stale-ratio warning recommended (sample,tokenize,pack:
    tokenize read the old merged.jsonl). The warning now prints a complete command; running it as printed, the new
    rate is what is packed."""
    import shlex

    config = _two_categories(tmp_path)
    out = tmp_path / "out"
    first = _sh(["sh", str(ROOT / "data_process.sh"), config], tmp_path)
    assert first.returncode == 0, first.stderr
    assert _packed_categories(out) == {"math": 40, "chat": 20}
    ratios = orjson.loads((out / "ratios.json").read_bytes())
    for entry in ratios["categories"]:
        entry["sample_rate"] = 0.1 if entry["category_name"] == "math" else 1.0
    (out / "ratios.json").write_bytes(orjson.dumps(ratios))

    later = _sh(["sh", str(ROOT / "data_process.sh"), config, "--stages", "tokenize,pack"], tmp_path)
    assert later.returncode == 0, later.stderr
    (warning,) = {line for line in later.stderr.splitlines() if line.startswith("WARNING: inputs:")}
    command = warning.split("re-run from it: ", 1)[1]
    assert command == f"sh {ROOT / 'data_process.sh'} {config} --stages sample,merge,tokenize,pack"
    rerun = _sh(shlex.split(command), tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert "WARNING" not in rerun.stderr
    assert _packed_categories(out) == {"math": 4, "chat": 20}


def test_a_stage_refuses_an_input_older_than_its_upstreams_last_run(tmp_path, monkeypatch, capsys):
    """`--stages sample,tokenize,pack` skipped merge (tokenize read the stale merged.jsonl, rc 0), and so did
    `--stages sample` then `--stages tokenize,pack`: both are refused, naming the stale file and a complete
    command; nothing is written."""
    monkeypatch.chdir(tmp_path)  # outside the repository: the command names data_process.sh by its absolute path
    config = _two_categories(tmp_path)
    out = tmp_path / "out"
    pipeline.main([config])
    capsys.readouterr()
    sampled = (out / "sampled.jsonl").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([config, "--stages", "sample,tokenize,pack", "seed=4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: tokenize reads {out / 'merged.jsonl'}, which would be older than this run's sample stage (merge is "
        f"not in --stages): run the stages in between too: sh {ROOT / 'data_process.sh'} {config} --stages "
        "sample,merge,tokenize,pack seed=4")
    assert (out / "sampled.jsonl").read_bytes() == sampled  # refused before any stage ran

    pipeline.main([config, "--stages", "sample", "seed=4"])
    assert list(read_report(out / "report.json")["stale"]) == ["merge", "tokenize", "pack"]
    capsys.readouterr()
    for stages in ("tokenize,pack", "pack"):
        with pytest.raises(SystemExit):
            pipeline.main([config, "--stages", stages, "seed=4"])
        first = stages.split(",")[0]
        upstream = {"tokenize": "merge", "pack": "tokenize"}[first]
        path = out / ("merged.jsonl" if first == "tokenize" else "tokenized")
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"error: {first} reads {path}, which {upstream} wrote before the last run of an earlier stage "
            f"(report.json lists {upstream} under `stale`): run the stages in between too: sh "
            f"{ROOT / 'data_process.sh'} {config} --stages merge,tokenize,pack seed=4")
    pipeline.main([config, "--stages", "merge,tokenize,pack", "seed=4"])
    report = read_report(out / "report.json")
    assert "stale" not in report and report["pack"]["in"] == report["sample"]["out"]


# ---------------------------------------------------------------------------------------------- item 0b
def _row_records(ds) -> list[list[tuple[int, ...]]]:
    """Each packed row's sequences, each as its tuple of source uids."""
    return [[tuple(u.tolist()) for u in ds.row_uids(i)] for i in range(len(ds))]


def _count_repeats(rows) -> tuple[int, int]:
    """(rows repeating another row's records in any order, all but one of each; rows holding a uid twice)."""
    from collections import Counter

    same = Counter(tuple(sorted(row)) for row in rows)
    twice = sum(1 for row in rows if len([u for seq in row for u in seq]) != len({u for seq in row for u in seq}))
    return sum(n - 1 for n in same.values()), twice


@pytest.mark.parametrize("probability", [0.0, 0.3])
def test_up_sampled_copies_never_share_a_row_and_repeated_rows_are_counted(tmp_path, monkeypatch, probability):
    """sample_rate 3: exact fill, picking by length, packed the copies of a record beside each other (a third of
    the rows held a record twice). Copies are now planned in different layers: no row holds a record twice, and
    stats.json counts duplicate rows and rows with a record twice as an independent count over packed/ does."""
    from data.config import load_config
    from data.shards.dataset import PackedDataset

    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    cfg = load_config("configs/data/example.json", [f"output_dir={out}", f"ratio_path={tmp_path / 'ratios.json'}",
                                                     "num_workers=1", f"merge.probability={probability}"])
    cfg.stages = ["preprocess"]
    pipeline.run_pipeline(cfg)
    ratios = orjson.loads((tmp_path / "ratios.json").read_bytes())
    for entry in ratios["categories"]:
        entry["sample_rate"] = 3
    (tmp_path / "ratios.json").write_bytes(orjson.dumps(ratios))
    cfg.stages = ["sample", "merge", "tokenize", "pack"]
    pipeline.run_pipeline(cfg)

    rows = _row_records(PackedDataset(out / "packed"))
    duplicates, twice = _count_repeats(rows)
    stats = orjson.loads((out / "packed" / "stats.json").read_bytes())
    section = read_report(out / "report.json")["pack"]
    assert twice == 0
    assert (stats["duplicate_rows"], stats["rows_with_a_record_twice"]) == (duplicates, twice)
    assert (section["duplicate_rows"], section["rows_with_a_record_twice"]) == (duplicates, twice)
    assert stats["rows"] <= stats["lower_bound_rows"] + 3  # a partly filled row per copy layer at most
    records = read_report(out / "report.json")["preprocess"]["out"]
    assert sorted(u for row in rows for seq in row for u in seq) == sorted(list(range(records)) * 3)  # all packed


def _tokenized(out_dir, sequences):
    """A tokenized dataset of (length, uids) sequences, one per row."""
    import numpy as np

    from data.shards.dataset import ShardWriter
    from tests.shards.test_format import make_sequence

    rng = np.random.default_rng(0)
    writer = ShardWriter(out_dir, max_shard_bytes=4_000, kind="tokenized")
    for i, (length, uids) in enumerate(sequences):
        writer.add_row([make_sequence(rng, length)], record_indices=[i], uids=[uids])
    writer.close({"tokenizer_path": "/tok", "tokenizer_hash": "abc", "max_length": 256,
                  "categories": {0: "untracked", 1: "math"}})


def test_duplicate_rows_and_rows_with_a_record_twice_are_counted_exactly(tmp_path, capsys):
    """Records that fill a row alone, three copies each, repeat their row (2 duplicates each); a merged sequence
    that holds one record twice is a row with a record twice; sequences without uids are never duplicates."""
    from data import pack
    from data.shards.dataset import PackedDataset
    from tests.data.test_pack_roundtrip import config

    _tokenized(tmp_path / "tokenized", [(200, [i]) for i in range(5)] * 3 + [(100, [7, 7]), (100, []), (100, [])])
    section = pack.run(config(tmp_path))
    stats = orjson.loads((tmp_path / "packed" / "stats.json").read_bytes())
    assert (stats["rows"], stats["duplicate_rows"], stats["rows_with_a_record_twice"]) == (17, 10, 1)
    assert (section["duplicate_rows"], section["rows_with_a_record_twice"]) == (10, 1)
    out = capsys.readouterr().out
    assert f"{'duplicate rows':<28}{10:>16,}" in out and f"{'rows with a record twice':<28}{1:>16,}" in out
    assert _count_repeats([r for r in _row_records(PackedDataset(tmp_path / "packed")) if any(r)]) == (10, 1)


@pytest.mark.parametrize("partition", [None, 128])
def test_the_planner_puts_the_copies_of_a_record_in_different_rows(partition):
    """Equal lengths (copies) are what exact fill puts together: without the records' uids the plan holds records
    twice; with them it never does, places every sequence once and stays at the lower bound but for a row or two
    per copy layer."""
    import numpy as np

    from data import pack

    rng = np.random.default_rng(5)
    records = rng.integers(20, 400, 300)
    order = rng.permutation(900)  # sampled.jsonl's shuffled order of 3 copies of each record
    uids = np.tile(np.arange(300), 3)[order]
    lengths = records[uids]
    blind = pack.plan_by_partitions(lengths, 1024, seed=1, partition=partition).tolist()
    assert _count_repeats([[(int(uids[j]),) for j in row] for row in blind])[1] > 0
    rows = pack.plan_by_partitions(lengths, 1024, seed=1, partition=partition, n_uids=np.ones(900, np.int64),
                                   uids=uids).tolist()
    assert sorted(j for row in rows for j in row) == list(range(900))
    assert all(lengths[row].sum() <= 1024 for row in rows)
    assert _count_repeats([[(int(uids[j]),) for j in row] for row in rows])[1] == 0
    assert len(rows) <= -(-int(lengths.sum()) // 1024) + 3 * (1 if partition is None else 2)
    assert rows == pack.plan_by_partitions(lengths, 1024, seed=1, partition=partition, n_uids=np.ones(900, np.int64),
                                           uids=uids).tolist()


def test_copy_layers_separate_every_pair_of_sequences_that_share_a_record():
    import numpy as np

    from data.pack import copy_layers

    sequences = [[5], [5], [5, 6], [7], [6, 7, 8], [], [7, 5], [9], [9, 9], [6], [5]]
    n_uids = np.array([len(seq) for seq in sequences])
    uids = np.array([u for seq in sequences for u in seq])
    layers = copy_layers(n_uids, uids)
    starts = np.cumsum(n_uids) - n_uids
    sets = [set(uids[a:a + n].tolist()) for a, n in zip(starts, n_uids)]
    for i in range(len(sets)):
        for j in range(i):
            if sets[i] & sets[j]:
                assert layers[i] != layers[j], (i, j)
    assert copy_layers(np.array([1, 1, 2]), np.array([1, 2, 3, 4])).tolist() == [0, 0, 0]  # no copies: one layer


def test_packed_copies_are_byte_identical_for_any_worker_count(tmp_path, monkeypatch):
    import numpy as np

    from data import pack
    from tests.data.test_pack_roundtrip import config

    monkeypatch.setattr(pack, "PARTITION_SEQUENCES", 16)  # several partitions and a global pass
    rng = np.random.default_rng(2)
    records = [(int(n), [i]) for i, n in enumerate(rng.integers(10, 120, 40))]
    merged = [(int(rng.integers(30, 200)), rng.choice(40, 2, replace=False).tolist()) for _ in range(10)]
    sequences = [records[i] for i in rng.permutation(np.tile(np.arange(40), 3))] + merged
    _tokenized(tmp_path / "tokenized", sequences)
    outputs = []
    for workers in (1, 2):
        cfg = config(tmp_path)
        cfg.num_workers = workers
        pack.run(cfg)
        outputs.append({p.name: p.read_bytes() for p in cfg.packed_dir.iterdir()})
    assert outputs[0] == outputs[1]
    from data.shards.dataset import PackedDataset

    assert _count_repeats(_row_records(PackedDataset(tmp_path / "packed")))[1] == 0
