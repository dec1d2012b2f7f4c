"""Issue 13, data side: killed stages' temporaries, durable renames, full disks, ratio-file mistakes, template
overhead, tokenizer consistency, max_length override, progress output."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import orjson
import pytest

from data import pipeline
from data.shards.dataset import ShardWriter
from tests.conftest import ROOT


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _fake_stage(name, calls):
    module = types.ModuleType(f"data.{name}")

    def run(cfg, executor=None):
        calls.append(name)
        return {"in": 0, "out": 0, "dropped": {}}

    module.run = run
    return module


def _minimal_config(tmp_path, **extra):
    cfg = {"inputs": [], "output_dir": str(tmp_path / "out"), "tokenizer_path": "unused",
           "ratio_path": str(tmp_path / "ratios.json"), **extra}
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps(cfg))
    return path


# ---------------------------------------------------------------------------------------------- item 6
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
    aside = out / f".merged.jsonl.old-{_dead_pid()}-abcd1234"
    aside.write_bytes(b"previous")
    done_aside = out / f".sampled.jsonl.old-{_dead_pid()}-abcd1234"  # its swap finished: stale
    done_aside.write_bytes(b"old")
    (out / "sampled.jsonl").write_bytes(b"new")

    calls = []
    monkeypatch.setitem(sys.modules, "data.pack", _fake_stage("pack", calls))
    pipeline.main([str(_minimal_config(tmp_path)), "--stages", "pack"])
    first, kept = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("[cleanup] removed 4 temporaries of killed runs (")
    assert kept.startswith("[cleanup] kept 1 temporary named by pid alone") and kept.endswith(f"{live} (pid {os.getpid()})")
    for name in left[:2]:
        assert str(out / name) in first
    assert sorted(p.name for p in out.iterdir()) == sorted([live.name, aside.name, "sampled.jsonl",
                                                            "provenance.json"])
    assert not list(tmp_path.glob(".ratios.json.*"))
    assert calls == ["pack"]
    pipeline.main([str(_minimal_config(tmp_path)), "--stages", "pack"])  # nothing left to remove
    assert capsys.readouterr().out.splitlines()[0].startswith("[cleanup] kept 1 temporary named by pid alone")
    live.rmdir()
    pipeline.main([str(_minimal_config(tmp_path)), "--stages", "pack"])  # nothing left: no cleanup line
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
    monkeypatch.setitem(sys.modules, "data.pack", _fake_stage("pack", []))
    pipeline.main([str(_minimal_config(tmp_path)), "--stages", "pack"])
    assert capsys.readouterr().out.splitlines()[0].startswith(
        f"[cleanup] removed 1 temporaries of killed runs (0.0 MB): {pid_reused}")
    assert sorted(p.name for p in out.iterdir()) == [mine.name, "provenance.json"]  # the fake pack's record


def test_writes_are_fsynced_before_the_renames_that_publish_them(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    from common.fsutil import atomic_write_bytes

    for _ in range(2):  # the second time replaces an existing dataset
        with ShardWriter(tmp_path / "ds", max_shard_bytes=100) as w:
            for n in (30, 30, 30):
                w.add_row([{k: np.ones(n, np.int32) for k in ("input_ids", "labels", "category_ids", "turn_ids")}])
            w.close({}, extra_files={"stats.json": b"{}"})
    atomic_write_bytes(tmp_path / "report.json", b"{}")

    publish = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(tmp_path / "ds")]
    assert len(publish) == 2
    files = sorted(p.name for p in (tmp_path / "ds").iterdir())
    assert len(files) == 3 * 4 + 2
    start = 0
    for at in publish:
        tmp_dir = events[at][1]
        synced = [e[1] for e in events[start:at] if e[0] == "fsync"]
        assert sorted(os.path.basename(p) for p in synced if os.path.dirname(p) == tmp_dir) == files
        assert synced[-1] == tmp_dir  # the directory itself, after its files
        assert events[at + 1] == ("fsync", str(tmp_path))  # the parent, after the swap
        start = at
    rename = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(tmp_path / "report.json"))
    assert events[rename - 1] == ("fsync", events[rename][1]) and events[rename + 1] == ("fsync", str(tmp_path))


# ---------------------------------------------------------------------------------------------- item 7
def example_config(directory, **extra):
    """configs/data/example.json with absolute paths, its own output_dir and ratio file, one worker."""
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    for spec in raw["inputs"]:
        spec["path"] = str(ROOT / spec["path"])
    raw.update({"output_dir": str(directory / "out"), "ratio_path": str(directory / "ratios.json"),
                "tokenizer_path": str(ROOT / raw["tokenizer_path"]), "num_workers": 1, **extra})
    path = directory / "config.json"
    path.write_bytes(orjson.dumps(raw))
    return path


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """The example pipeline run once; tests take a copy (`_copy_run`)."""
    directory = tmp_path_factory.mktemp("example")
    pipeline.main([str(example_config(directory))])  # preprocess writes ratios.json (every rate 1.0)
    return directory


def _copy_run(example_run, tmp_path):
    import shutil

    shutil.copytree(example_run / "out", tmp_path / "out")
    shutil.copy(example_run / "ratios.json", tmp_path / "ratios.json")
    return example_config(tmp_path), tmp_path / "out"


def test_disk_full_leaves_a_consistent_report_and_one_line(example_run, tmp_path, monkeypatch, capsys):
    import errno

    from data.shards import dataset as shards
    from data.report import read_report

    monkeypatch.chdir(ROOT)  # the command the error suggests names data_process.sh from here
    config, out = _copy_run(example_run, tmp_path)
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
    config, out = _copy_run(example_run, tmp_path)
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

# ---------------------------------------------------------------------------------------------- item 9
def test_max_length_below_the_template_overhead_is_refused_before_any_stage(tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "data/example/tokenizer")
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
                                         tokenize=False)
    overhead = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert overhead > 5
    config = example_config(tmp_path, max_length=overhead, overlong="left")
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: max_length={overhead} leaves no room for a conversation: the chat template of "
                   f"{ROOT / 'data/example/tokenizer'} alone takes {overhead} tokens (an empty user and assistant "
                   f"turn); set max_length above {overhead}")
    assert not (tmp_path / "out").exists()  # no stage ran
    pipeline.load(*pipeline.parse_args([str(example_config(tmp_path, max_length=overhead + 1))], "x"), None)


# ---------------------------------------------------------------------------------------------- item 11
def test_tokenizer_path_that_is_a_file_or_an_empty_dir_names_the_key(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for bad, message in ((ROOT / "data/example/tokenizer/tokenizer.json", "is a file; give the tokenizer's directory"),
                         (tmp_path / "empty", "holds no tokenizer files (looked for tokenizer.json")):
        with pytest.raises(SystemExit):
            pipeline.main([str(example_config(tmp_path, tokenizer_path=str(bad)))])
        assert capsys.readouterr().err.strip().startswith(f"error: tokenizer_path: {bad} {message}")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_bytes(b"{not json")
    with pytest.raises(SystemExit):
        pipeline.main([str(example_config(tmp_path, tokenizer_path=str(broken)))])
    assert capsys.readouterr().err.strip().startswith(f"error: tokenizer_path: cannot load a tokenizer from {broken}")


@pytest.mark.parametrize("content", [b"", b"PAR1 this is not parquet"])
def test_empty_or_corrupt_parquet_names_the_file(tmp_path, capsys, content):
    bad = tmp_path / "train.parquet"
    bad.write_bytes(content)
    config = _minimal_config(tmp_path, inputs=[{"path": str(bad)}], stages=["preprocess"])
    with pytest.raises(SystemExit):
        pipeline.main([str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {bad}: file: not a readable parquet file: ")
    assert not any("Traceback" in line for line in err)


def test_stages_refuse_the_output_of_another_tokenizer(example_run, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.chdir(ROOT)  # the command the error suggests names data_process.sh from here
    config, out = _copy_run(example_run, tmp_path)
    other = tmp_path / "other_tokenizer"
    shutil.copytree(ROOT / "data/example/tokenizer", other)
    config_json = orjson.loads(config.read_bytes())
    original = config_json["tokenizer_path"]
    (other / "tokenizer_config.json").write_bytes((other / "tokenizer_config.json").read_bytes() + b"\n")
    packed_meta = (out / "packed" / "meta.json").read_bytes()
    for stages, made, rerun in (("pack", out / "tokenized", "tokenize,pack"),
                                ("tokenize,pack", out / "merged.jsonl", "merge,tokenize,pack")):
        with pytest.raises(SystemExit):
            pipeline.main([str(config), "--stages", stages, f"tokenizer_path={other}"])
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: tokenizer_path: {made}") and f"from {original}) than the config's {other}" in err
        assert err.endswith(f"re-run from that stage with this tokenizer (sh data_process.sh {config} --stages "
                            f"{rerun} tokenizer_path={other}), or set tokenizer_path/chat_template back")
    assert (out / "packed" / "meta.json").read_bytes() == packed_meta  # nothing ran
    pipeline.main([str(config), "--stages", "merge,tokenize,pack", f"tokenizer_path={other}"])  # the way out
    assert orjson.loads((out / "packed" / "meta.json").read_bytes())["tokenizer_path"] == str(other)



# ---------------------------------------------------------------------------------------------- item 15
def test_max_length_override_drives_the_packed_row_capacity(example_run, tmp_path):
    """The README's `sh data_process.sh configs/data/example.json --stages merge,tokenize,pack max_length=4096`
    (merge is in it: with merge.probability > 0 its token budget is max_length)."""
    config, out = _copy_run(example_run, tmp_path)
    assert orjson.loads((out / "packed" / "meta.json").read_bytes())["max_length"] == 2048
    pipeline.main([str(config), "--stages", "merge,tokenize,pack", "max_length=4096"])
    for d in ("tokenized", "packed"):
        assert orjson.loads((out / d / "meta.json").read_bytes())["max_length"] == 4096
    stats = orjson.loads((out / "packed" / "stats.json").read_bytes())
    assert stats["max_length"] == 4096 and stats["row_tokens"]["max"] > 2048


# ---------------------------------------------------------------------------------------------- item 16
class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_progress_is_a_bar_on_a_terminal_and_whole_lines_otherwise(monkeypatch):
    from tqdm import tqdm

    from data import progress as progress_module
    from data.progress import PlainProgress, progress

    tty = _Stream(tty=True)
    with progress(total=10, desc="pack", unit="row", stream=tty) as bar:
        assert isinstance(bar, tqdm)
        bar.update(10)
    assert "\r" in tty.text

    clock = iter([0.0, 4.0, 11.0, 12.0, 25.0, 26.0])
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    plain = _Stream(tty=False)
    with progress(total=3_500_000, desc="tokenize", unit="B", unit_scale=True, stream=plain) as bar:
        assert isinstance(bar, PlainProgress)
        for _ in range(4):  # at 4 s (no line), 11 s, 12 s (no line: < 10 s since the last), 25 s
            bar.update(700_000)
    # closed at 26 s
    assert plain.text.splitlines() == ["[tokenize] 1.4M/3.5M B (40%) 11s", "[tokenize] 2.8M/3.5M B (80%) 25s",
                                       "[tokenize] 2.8M/3.5M B (80%) 26s"]
    assert "\r" not in plain.text
    monkeypatch.undo()
    rows = _Stream(tty=False)
    assert list(progress(range(3), desc="pack", unit="row", stream=rows)) == [0, 1, 2]
    assert rows.text.startswith("[pack] 3/3 row (100%) ")


def test_stages_print_whole_progress_lines_when_not_on_a_terminal(example_run, tmp_path, capsys):
    config, out = _copy_run(example_run, tmp_path)
    pipeline.main([str(config), "--stages", "tokenize,pack"])
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    size = (out / "merged.jsonl").stat().st_size
    assert any(line.startswith(f"[tokenize] {size / 1000:.1f}k/{size / 1000:.1f}k B (100%) ") for line in lines), err
    rows = orjson.loads((out / "packed" / "meta.json").read_bytes())["counts"]["rows"]
    assert any(line.startswith(f"[pack] {rows}/{rows} row (100%) ") for line in lines), err


# ---------------------------------------------------------------------------------------------- item 17
def test_stats_png_shows_per_category_shares():
    from data.stats import Counts, pack_statistics, plot_stats, stats_figure

    lengths = {1: Counts.of([5, 7]), 3: Counts.of([9])}
    stats = pack_statistics(lengths, Counts.of([12, 9]), Counts.of([2, 1]), 16, {1: 12, 3: 9}, {1: 3, 3: 6},
                            {1: "math", 3: "chat"})
    fig = stats_figure(lengths, Counts.of([12, 9]), 16, stats["categories"])
    shares = fig.axes[2]
    assert shares.get_title() == "per-category shares"
    assert [t.get_text() for t in shares.get_yticklabels()] == ["1:math", "3:chat"]
    widths = [round(p.get_width(), 6) for p in shares.patches]
    assert widths == [round(12 / 21, 6), round(9 / 21, 6), round(3 / 9, 6), round(6 / 9, 6)]  # tokens, then loss
    assert plot_stats({1: Counts.of([5])}, Counts.of([5]), 16, stats["categories"]).startswith(b"\x89PNG")
