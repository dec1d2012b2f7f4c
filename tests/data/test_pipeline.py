"""The driver: stage order, --stages and overrides, the last output line, errors, data_process.sh end to end."""
import subprocess
import sys
import types

import orjson
import pytest

from data import pipeline
from data.report import check_arithmetic, read_report
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
