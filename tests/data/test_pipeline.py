"""The driver: stage order, --stages and overrides, the last output line, errors, data_process.sh end to end."""
import dataclasses
import os
import socket
import subprocess
import sys
import types

import orjson
import pytest

from common.lock import LOCK_NAME
from data import pipeline
from data.config import DataConfig, InputSpec, MergeConfig
from data.report import check_arithmetic, read_report
from tests._data_helpers import (CHAT_QA, copy_run, data_config_file, dead_pid, minimal_config_file,
                                 preprocess_config_file, qa_rows, write_jsonl)
from tests.conftest import ROOT, fixture_path, tokenizer_dir


def write_config(tmp_path, **extra):
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_bytes(b"".join(fixture_path("data", "gsm8k_test.jsonl").read_bytes().splitlines(True)[:30]))
    cfg = {
        "inputs": [{"path": str(gsm8k), "category_name": "math"},
                   {"path": str(fixture_path("data", "fastchat_dummy_conversation.json")), "category_name": "chat"}],
        "output_dir": str(tmp_path / "out"),
        "tokenizer_path": str(tokenizer_dir("qwen2_5_instruct")),
        "num_workers": 1,
        **extra,
    }
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps(cfg))
    return path


def fake_stage(name, calls):
    module = types.ModuleType(f"data.{name}")

    def run(cfg, executor=None):
        calls.append((name, cfg.max_length))
        return {"in": 1, "out": 1, "dropped": {}}

    module.run = run
    return module


def test_driver_runs_requested_stages_in_order_and_ends_with_packed_dir(tmp_path, monkeypatch, capsys):
    config = write_config(tmp_path)
    calls = []
    for name in ("sample", "merge", "tokenize", "pack"):
        monkeypatch.setitem(sys.modules, f"data.{name}", fake_stage(name, calls))
    pipeline.main([str(config), "--stages", "pack,sample,merge,preprocess,tokenize", "max_length=4096",
                   "ratio_path=" + str(tmp_path / "r.json")])
    lines = capsys.readouterr().out.strip().splitlines()
    stage_lines = [line for line in lines if line.startswith("[")]
    assert [line.split("]")[0] for line in stage_lines[:5]] == ["[preprocess", "[sample", "[merge", "[tokenize", "[pack"]
    assert lines[0].startswith("[preprocess] in=530 out=530")
    assert lines[1] == (f"  ratio file: {tmp_path / 'r.json'} (a sample_rate per category: edit it, then re-run "
                        f"from sample: sh data_process.sh {config} --stages sample,merge,tokenize,pack "
                        f"max_length=4096 ratio_path={tmp_path / 'r.json'})")
    assert lines[2].startswith("[sample] ") and lines[3] == f"  rates from the ratio file {tmp_path / 'r.json'}"
    assert lines[-1] == f"packed: {tmp_path / 'out' / 'packed'}"
    assert calls == [("sample", 4096), ("merge", 4096), ("tokenize", 4096), ("pack", 4096)]
    assert (tmp_path / "r.json").exists() and not (tmp_path / "out" / "sampled.jsonl").exists()


def test_unknown_stage_and_bad_override_exit_with_a_clear_message(tmp_path, capsys):
    config = write_config(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([str(config), "--stages", "preprocess,shuffle"])
    assert exit_info.value.code == 2
    assert "unknown stage(s) ['shuffle']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pipeline.main(["--config", str(config), "merge.probabilty=0.5"])
    assert ("override 'merge.probabilty=0.5': unknown key 'merge.probabilty'; did you mean 'merge.probability'?"
            in capsys.readouterr().err)


def test_bad_record_error_names_file_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"messages": [{"role": "user", "content": "x"}]}\n')
    config = tmp_path / "c.json"
    config.write_bytes(orjson.dumps({"inputs": [{"path": str(bad)}], "output_dir": str(tmp_path / "o"),
                                     "tokenizer_path": "unused", "stages": ["preprocess"]}))
    with pytest.raises(SystemExit):
        pipeline.main([str(config)])
    assert f"error: {bad}:1: labels: no assistant message is trained" in capsys.readouterr().err


def test_stage_cli_runs_only_its_stage(tmp_path, capsys):
    from data import preprocess, sample

    config = write_config(tmp_path)
    pipeline.cli_main(preprocess.run, "preprocess", ["--config", str(config)])
    pipeline.cli_main(sample.run, "sample", ["--config", str(config), "seed=7"])
    out = capsys.readouterr().out
    assert "[preprocess] in=530 out=530" in out and "[sample] in=530 out=530" in out
    assert read_report(tmp_path / "out" / "report.json")["sample"]["seed"] == 7


def test_data_process_sh_end_to_end(tmp_path):
    config = write_config(tmp_path, merge={"probability": 0.0}, loss_turns="last")
    result = subprocess.run(["sh", str(ROOT / "data_process.sh"), str(config), "--stages", "preprocess,sample,merge"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("[merge] in=530") and not any(ln.startswith("packed:") for ln in lines)  # not packed
    report = read_report(tmp_path / "out" / "report.json")
    assert list(report) == ["preprocess", "sample", "merge"]
    for section in report.values():
        check_arithmetic(section)
    assert report["merge"]["in"] == report["sample"]["out"] == report["preprocess"]["out"] == 530
    merged = [orjson.loads(x) for x in (tmp_path / "out" / "merged.jsonl").read_bytes().splitlines()]
    assert all(sum(r["labels"]) == 1 for r in merged)  # loss_turns=last on multi-turn chats


def test_stage_without_its_input_names_the_missing_stage(tmp_path, capsys):
    from data import sample

    config = write_config(tmp_path)
    with pytest.raises(SystemExit):
        pipeline.cli_main(sample.run, "sample", ["--config", str(config)])
    assert "canonical.jsonl does not exist; run the preprocess stage first" in capsys.readouterr().err


@pytest.mark.parametrize("override, message", [("seed=-1", "seed must be >= 0, got -1"),
                                               ("pack.shard_size_mb=0", "pack.shard_size_mb must be positive")])
def test_negative_seed_and_empty_shard_size_are_config_errors(tmp_path, capsys, override, message):
    config = write_config(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([str(config), "--stages", "preprocess", override])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_stage_section_moves_the_sections_of_later_stages_to_stale(tmp_path):
    from data.report import update_report

    path = tmp_path / "report.json"
    for stage in ("preprocess", "sample", "merge", "tokenize", "pack"):
        update_report(path, stage, {"in": 1, "out": 1, "dropped": {}, "run": 1})
    update_report(path, "sample", {"in": 2, "out": 2, "dropped": {}, "run": 2})
    report = read_report(path)
    assert list(report) == ["preprocess", "sample", "stale"]
    assert report["preprocess"]["run"] == 1 and report["sample"]["run"] == 2
    assert list(report["stale"]) == ["merge", "tokenize", "pack"]
    assert all(section["run"] == 1 for section in report["stale"].values())
    for stage in ("merge", "tokenize", "pack"):
        update_report(path, stage, {"in": 2, "out": 2, "dropped": {}, "run": 2})
    assert list(read_report(path)) == ["preprocess", "sample", "merge", "tokenize", "pack"]


def test_tokenize_module_cli_takes_a_positional_config_and_exits_2(tmp_path):
    config = write_config(tmp_path)
    result = subprocess.run([sys.executable, "-m", "data.tokenize", str(config), "max_length=4096"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: tokenize: input ")
    assert "run the merge stage first" in result.stderr


# ---------------------------------------------------------------------------------------------- temporaries of killed runs
def _named_stage(name, calls):
    """A stage module whose run records its name in `calls`."""
    module = types.ModuleType(f"data.{name}")

    def run(cfg, executor=None):
        calls.append(name)
        return {"in": 0, "out": 0, "dropped": {}}

    module.run = run
    return module


def test_killed_writers_leave_temporaries_that_the_next_run_removes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    killed = subprocess.Popen([sys.executable, "-c", f"""
import os, numpy as np
from data.shards.dataset import ShardWriter
from common.fsutil import atomic_writer
w = ShardWriter({str(out / 'tokenized')!r}, kind="tokenized")
w.add_row([{{k: np.ones(1000, np.int32) for k in ("input_ids", "labels", "category_ids", "turn_ids")}}])
with atomic_writer({str(out / 'canonical.jsonl')!r}) as f, atomic_writer({str(tmp_path / 'ratios.json')!r}) as g:
    f.write(b"x" * 5000)
    g.write(b"{{}}")
    f.flush()
    os.kill(os.getpid(), 9)
"""], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert killed.wait() == -9
    left = sorted(p.name for p in out.iterdir()) + sorted(p.name for p in tmp_path.glob(".ratios.json.*"))
    assert [n.split(".tmp-")[0] for n in left] == [".canonical.jsonl", ".tokenized", ".ratios.json"]
    assert all(n.split(".tmp-")[1].startswith(f"{killed.pid}-") for n in left)
    # a live writer's temporary, and the previous output a kill between replace_dir's renames set aside, stay
    live = out / f".packed.tmp-{os.getpid()}-abcd1234"
    live.mkdir()
    aside = out / f".merged.jsonl.old-{dead_pid()}-abcd1234"
    aside.write_bytes(b"previous")
    done_aside = out / f".sampled.jsonl.old-{dead_pid()}-abcd1234"  # its swap finished: stale
    done_aside.write_bytes(b"old")
    (out / "sampled.jsonl").write_bytes(b"new")

    calls = []
    monkeypatch.setitem(sys.modules, "data.pack", _named_stage("pack", calls))
    pipeline.main([str(minimal_config_file(tmp_path)), "--stages", "pack"])
    first, kept = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("[cleanup] removed 4 temporaries of killed runs (")
    assert kept.startswith("[cleanup] kept 1 temporary named by pid alone") and kept.endswith(f"{live} (pid {os.getpid()})")
    for name in left[:2]:
        assert str(out / name) in first
    assert sorted(p.name for p in out.iterdir()) == sorted([live.name, aside.name, "sampled.jsonl",
                                                            "provenance.json"])
    assert not list(tmp_path.glob(".ratios.json.*"))
    assert calls == ["pack"]
    pipeline.main([str(minimal_config_file(tmp_path)), "--stages", "pack"])  # nothing left to remove
    assert capsys.readouterr().out.splitlines()[0].startswith("[cleanup] kept 1 temporary named by pid alone")
    live.rmdir()
    pipeline.main([str(minimal_config_file(tmp_path)), "--stages", "pack"])  # nothing left: no cleanup line
    assert not capsys.readouterr().out.startswith("[cleanup]")


def test_a_killed_writers_temporary_is_stale_when_its_pid_was_reused(tmp_path, monkeypatch, capsys):
    """Staleness does not rest on the pid alone: a temporary named with a live pid (reused since its writer was
    killed) but another process start is removed, and said so; this process's own temporaries stay."""
    from common.fsutil import temp_sibling

    out = tmp_path / "out"
    out.mkdir()
    mine = temp_sibling(out / "packed")
    mine.mkdir()
    pid_reused = out / f".tokenized.tmp-{os.getpid()}-s00000000-abcd1234"  # this pid, another process's start
    pid_reused.mkdir()
    monkeypatch.setitem(sys.modules, "data.pack", _named_stage("pack", []))
    pipeline.main([str(minimal_config_file(tmp_path)), "--stages", "pack"])
    assert capsys.readouterr().out.splitlines()[0].startswith(
        f"[cleanup] removed 1 temporaries of killed runs (0.0 MB): {pid_reused}")
    assert sorted(p.name for p in out.iterdir()) == [mine.name, "provenance.json"]  # the fake pack's record


def _cfg(tmp_path, inputs, **kw) -> DataConfig:
    kw.setdefault("num_workers", 1)
    kw.setdefault("tokenizer_path", str(ROOT / "data/example/tokenizer"))
    return DataConfig(inputs=inputs, output_dir=str(tmp_path / "out"), **kw)


def test_a_long_ratio_path_keeps_its_temporaries_within_name_max(tmp_path, capsys):
    """A 245-character file name is legal (NAME_MAX 255); its temporary's suffix must not push it over."""
    ratio = tmp_path / ("r" * 240 + ".json")
    assert len(ratio.name) == 245 <= os.pathconf(tmp_path, "PC_NAME_MAX")
    cfg = _cfg(tmp_path, [InputSpec(path=[write_jsonl(tmp_path / "a.jsonl", [CHAT_QA] * 3)], category_name="chat")],
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


def test_a_temporary_of_the_older_pid_only_naming_with_a_live_pid_is_kept_and_said_so(tmp_path, capsys):
    """A temporary named by pid alone (older versions) whose pid runs cannot be told from a live writer's: it is
    kept, and the cleanup line says so, naming it (it was kept silently)."""
    cfg = _cfg(tmp_path, [InputSpec(path=[write_jsonl(tmp_path / "a.jsonl", [CHAT_QA] * 2)], category_name="chat")],
               ratio_path=str(tmp_path / "ratios.json"), stages=["preprocess"])
    out = tmp_path / "out"
    out.mkdir()
    legacy_live = out / f".canonical.jsonl.tmp-{os.getpid()}-abcd1234"
    legacy_live.write_bytes(b"x" * 10)
    legacy_dead = out / f".sampled.jsonl.tmp-{dead_pid()}-abcd1234"
    legacy_dead.write_bytes(b"y")
    pipeline.run_pipeline(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"[cleanup] removed 1 temporaries of killed runs (0.0 MB): {legacy_dead}"
    assert lines[1] == (f"[cleanup] kept 1 temporary named by pid alone (the naming of older versions) whose pid "
                        f"is running, so it cannot be told from a live writer's; delete it if no run of an older "
                        f"version is writing there: {legacy_live} (pid {os.getpid()})")
    assert legacy_live.exists() and not legacy_dead.exists()


# ---------------------------------------------------------------------------------------------- inputs older than their upstream's last run
def _two_categories(tmp_path) -> str:
    math = write_jsonl(tmp_path / "math.jsonl", qa_rows(40))
    chat = write_jsonl(tmp_path / "chat.jsonl", [CHAT_QA] * 20)
    return data_config_file(tmp_path, [{"path": math, "category_name": "math"}, {"path": chat, "category_name": "chat"}],
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


QA = {"question": "q", "answer": "a"}


def _cfg_without_tokenizer(tmp_path, inputs, **kw) -> DataConfig:
    return DataConfig(inputs=inputs, output_dir=str(tmp_path / "out"), tokenizer_path="unused", num_workers=1, **kw)


def test_later_stages_warn_when_the_ratio_file_changed_after_sampling(tmp_path, capsys):
    """Editing the ratio file, then running merge (or tokenize, pack) without sample would pack the old sample:
    a warning at the start and again at the end names the file and the stages to re-run."""
    cfg = _cfg_without_tokenizer(tmp_path, [InputSpec(path=[write_jsonl(tmp_path / "c.jsonl", [QA] * 4)], category_name="chat")],
               stages=["preprocess", "sample"])
    pipeline.run_pipeline(cfg)
    assert pipeline.stale_input_warnings(dataclasses.replace(cfg, stages=["merge"])) == []
    ratios = orjson.loads(cfg.ratio_file.read_bytes())
    ratios["categories"][0]["sample_rate"] = 0.5
    cfg.ratio_file.write_bytes(orjson.dumps(ratios))
    (warning,) = pipeline.stale_input_warnings(dataclasses.replace(cfg, stages=["merge", "tokenize"]))
    assert f"the ratio file {cfg.ratio_file} changed after the sample stage ran" in warning
    assert "--stages sample,merge,tokenize" in warning
    assert pipeline.stale_input_warnings(dataclasses.replace(cfg, stages=["sample", "merge"])) == []
    sections = pipeline.run_pipeline(dataclasses.replace(cfg, stages=["merge"], merge=MergeConfig(probability=0.0)))
    assert sections["inputs"]["warnings"] == [warning.replace("merge, tokenize", "merge").replace(
        "sample,merge,tokenize", "sample,merge")]
    pipeline.print_warnings(sections)
    assert "WARNING: inputs: the ratio file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- full disks
def test_disk_full_leaves_a_consistent_report_and_one_line(example_run, tmp_path, monkeypatch, capsys):
    import errno

    from data.shards import dataset as shards
    from data.report import read_report

    monkeypatch.chdir(ROOT)  # the command the error suggests names data_process.sh from here
    config, out = copy_run(example_run, tmp_path)
    before = read_report(out / "report.json")
    metas = {d: (out / d / "meta.json").read_bytes() for d in ("tokenized", "packed")}
    capsys.readouterr()

    def full(self, batch):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(shards._ShardBuffer, "_write", full)
        with pytest.raises(SystemExit) as exit_info:
            pipeline.main([str(config), "--stages", "merge,tokenize,pack"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: tokenize: no space left on device writing under {out} (") and \
        err[-1].endswith(f"re-run: sh data_process.sh {config} --stages tokenize,pack")
    assert not any(line.startswith(("Traceback", "OSError")) for line in err)
    report = read_report(out / "report.json")
    assert [k for k in report if k in pipeline.STAGES] == ["preprocess", "sample", "merge"]
    assert report["stale"] == {"tokenize": before["tokenize"], "pack": before["pack"]}  # what is still on disk
    assert report["failed"]["stage"] == "tokenize" and "no space left" in report["failed"]["error"]
    for d, meta in metas.items():
        assert (out / d / "meta.json").read_bytes() == meta
        assert report["stale"]["tokenize" if d == "tokenized" else "pack"]["out"] == \
            orjson.loads(meta)["counts"]["sequences"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # the aborted writer left nothing

    pipeline.main([str(config), "--stages", "tokenize,pack"])
    report = read_report(out / "report.json")
    assert "stale" not in report and "failed" not in report
    assert [k for k in report] == list(pipeline.STAGES)


def test_data_process_sh_ends_a_full_disk_with_one_line(example_run, tmp_path):
    """The shell entry point: a sitecustomize makes every shard write fail with ENOSPC in the child process."""
    config, out = copy_run(example_run, tmp_path)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import errno\nfrom data.shards import dataset as shards\n\n"
        "def full(self, batch):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n\n"
        "shards._ShardBuffer._write = full\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{hook}", PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    result = subprocess.run(["sh", str(ROOT / "data_process.sh"), str(config), "--stages", "pack"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    err = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert err[-1].startswith("error: pack: no space left on device writing under ") and err[-1].endswith("--stages pack")


# ---------------------------------------------------------------------------------------------- overrides
def test_max_length_override_drives_the_packed_row_capacity(example_run, tmp_path):
    """The README's `sh data_process.sh configs/data/example.json --stages merge,tokenize,pack max_length=4096`
    (merge is in it: with merge.probability > 0 its token budget is max_length)."""
    config, out = copy_run(example_run, tmp_path)
    assert orjson.loads((out / "packed" / "meta.json").read_bytes())["max_length"] == 2048
    pipeline.main([str(config), "--stages", "merge,tokenize,pack", "max_length=4096"])
    for d in ("tokenized", "packed"):
        assert orjson.loads((out / d / "meta.json").read_bytes())["max_length"] == 4096
    stats = orjson.loads((out / "packed" / "stats.json").read_bytes())
    assert stats["max_length"] == 4096 and stats["row_tokens"]["max"] > 2048


# ---------------------------------------------------------------------------------------------- one run per output directory
def test_a_second_run_into_a_locked_output_dir_is_refused_naming_the_holder(tmp_path, capsys, monkeypatch):
    calls = []
    fake = types.ModuleType("data.pack")
    fake.run = lambda cfg, executor=None: calls.append("pack") or {"in": 0, "out": 0, "dropped": {}}
    monkeypatch.setitem(sys.modules, "data.pack", fake)
    config = preprocess_config_file(tmp_path, [])
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from common.lock import directory_lock
with directory_lock({str(tmp_path / 'out')!r}):
    print("locked", flush=True)
    time.sleep(60)
"""], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SystemExit) as exit_:
            pipeline.main([config, "--stages", "pack"])
        assert exit_.value.code == 2 and calls == []
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'out'} is in use by another run (pid {holder.pid} on "
                              f"{socket.gethostname()}, started ")
    finally:
        holder.kill()
        holder.wait()
    pipeline.main([config, "--stages", "pack"])  # the holder is gone: its lock is taken over
    assert calls == ["pack"]
    assert "[lock] took over" in capsys.readouterr().out
    assert not (tmp_path / "out" / LOCK_NAME).exists()  # released at the end


@pytest.mark.parametrize("function, message", [
    ("nope.py:to_record", "inputs[0].function: nope.py is not a file (nope.py is relative to the current directory"),
    ("to_record", "inputs[0].function: 'to_record' is not 'path/to/file.py:function'"),
])
def test_a_missing_converter_file_is_a_config_error_before_any_stage(tmp_path, capsys, monkeypatch, function,
                                                                      message):
    """Before: found by the preprocess stage once it started (after its imports: 7 s on a loaded machine), as
    `function 'nope.py:f': …/nope.py is not a file`."""
    import data.preprocess

    config = write_config(tmp_path)
    raw = orjson.loads(config.read_bytes())
    raw["inputs"][0].update(format="function", function=function)
    config.write_bytes(orjson.dumps(raw))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(data.preprocess, "run", lambda *a, **k: pytest.fail("preprocess ran"))
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([str(config)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
