"""Stale stage outputs are never served silently: each stage records what its output was made from
(<output_dir>/provenance.json), and a run that starts after preprocess is refused, with one line naming the file, what
changed and the command to re-run, when an output it reads was made from other raw inputs, settings or tokenizer than
the run's; an untouched re-run is accepted and packs the same bytes."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import orjson
import pytest

from data import pipeline
from tests.conftest import ROOT

SCRIPT = ROOT / "data_process.sh"
ALL = "preprocess,sample,merge,tokenize,pack"


def _rows(n: int, offset: int = 0) -> bytes:
    return b"".join(orjson.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                               {"role": "assistant", "content": str(2 * i)}]}) + b"\n"
                    for i in range(offset, offset + n))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A full run on relative paths (config, raw input, output_dir), so a copy of the directory that keeps
    modification times (`shutil.copy2`) is the same run in another place."""
    base = tmp_path_factory.mktemp("provenance")
    (base / "raw.jsonl").write_bytes(_rows(24))
    (base / "c.json").write_bytes(orjson.dumps({
        "inputs": [{"path": "raw.jsonl", "category_name": "math"}], "output_dir": "out",
        "tokenizer_path": str(ROOT / "data/example/tokenizer"), "num_workers": 1, "max_length": 256, "seed": 3}))
    cwd = os.getcwd()
    os.chdir(base)
    try:
        pipeline.main(["c.json"])
    finally:
        os.chdir(cwd)
    return base


@pytest.fixture
def work(made, tmp_path, monkeypatch):
    """A copy of the full run's directory (modification times kept), the current directory."""
    where = tmp_path / "w"
    shutil.copytree(made, where, copy_function=shutil.copy2)
    monkeypatch.chdir(where)
    return where


def _refused(capsys, *argv: str) -> str:
    """The one-line error of a refused run (exit code 2)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(["c.json", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0].removeprefix("error: ")


def _outputs(where) -> dict[str, bytes]:
    out = where / "out"
    files = [out / name for name in ("canonical.jsonl", "sampled.jsonl", "merged.jsonl")]
    files += sorted(p for d in ("tokenized", "packed") for p in (out / d).iterdir() if p.is_file())
    return {str(p.relative_to(out)): p.read_bytes() for p in files}


def test_a_changed_raw_input_refuses_the_later_stages_until_preprocess_re_runs(work, capsys):
    before = _outputs(work)
    with open("raw.jsonl", "ab") as f:
        f.write(_rows(1, offset=100))
    size = os.path.getsize("raw.jsonl")
    message = _refused(capsys, "--stages", "sample,merge,tokenize,pack")
    assert message == (
        f"sample would read out/canonical.jsonl, made from other inputs or settings than this run's: an input of "
        f"preprocess, raw.jsonl, changed (size {size - len(_rows(1, 100))} -> {size} bytes) since preprocess ran; "
        f"re-run from preprocess: sh {SCRIPT} c.json --stages {ALL}")
    assert _outputs(work) == before  # refused before any stage
    # every later start is refused alike, naming the file it would read
    assert _refused(capsys, "--stages", "pack").startswith("pack would read out/tokenized, made from other inputs")
    # the command as printed runs, and the record then matches: a partial run is accepted again
    rerun = subprocess.run(shlex.split(message.rsplit("re-run from preprocess: ", 1)[1]), capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert orjson.loads((work / "out/report.json").read_bytes())["preprocess"]["out"] == 25
    pipeline.main(["c.json", "--stages", "tokenize,pack"])


@pytest.mark.parametrize("override, stage, changed, stages", [
    ("seed=7", "sample", "seed=3 (this run: 7)", "sample,merge,tokenize,pack"),
    ("merge.probability=0.5", "merge", "merge.probability=0.0 (this run: 0.5)", "merge,tokenize,pack"),
    ("image_root=.", "preprocess", "image_root=[] (this run: [\".\"])", ALL),
])
def test_a_setting_an_earlier_stage_reads_refuses_a_run_on_its_output(work, capsys, override, stage, changed, stages):
    """`--stages tokenize,pack seed=7` packed merged.jsonl made with seed 3 and wrote seed 7 into meta.json."""
    meta = (work / "out/packed/meta.json").read_bytes()
    message = _refused(capsys, "--stages", "tokenize,pack", override)
    assert message == (f"tokenize would read out/merged.jsonl, made from other inputs or settings than this run's: "
                       f"{stage} ran with {changed}; re-run from {stage}: sh {SCRIPT} c.json --stages {stages} "
                       f"{override}")
    assert (work / "out/packed/meta.json").read_bytes() == meta


def test_another_tokenizer_refuses_a_run_on_tokenized_output(work, capsys, tmp_path):
    other = tmp_path / "tok"
    shutil.copytree(ROOT / "data/example/tokenizer", other)
    config = other / "tokenizer_config.json"
    config.write_bytes(orjson.dumps({**orjson.loads(config.read_bytes()), "model_max_length": 12345}))
    message = _refused(capsys, "--stages", "pack", f"tokenizer_path={other}")
    assert message.startswith("tokenizer_path: out/tokenized was made with another tokenizer")
    assert message.endswith(f"(sh {SCRIPT} c.json --stages tokenize,pack tokenizer_path={other}), or set "
                            "tokenizer_path/chat_template back")
    # the record says so too, whoever calls the pipeline (run_pipeline does not run the command line's preflight)
    cfg = pipeline.load_config("c.json", [f"tokenizer_path={other}"])
    cfg.stages = ["pack"]
    with pytest.raises(pipeline.ConfigError, match=r"^pack would read out/tokenized, made from other inputs or "
                       r"settings than this run's: tokenize ran with another tokenizer \(hash [0-9a-f]{12}, this "
                       r"run's [0-9a-f]{12}\); re-run from tokenize: --stages tokenize,pack$"):
        pipeline.run_pipeline(cfg)


def test_an_output_changed_after_its_stage_ran_is_refused(work, capsys):
    """An edit, or a stage that rewrote its output and stopped before recording it, is not what the record says."""
    size = os.path.getsize("out/merged.jsonl")
    with open("out/merged.jsonl", "ab") as f:
        f.write(b"\n")
    assert _refused(capsys, "--stages", "tokenize,pack") == (
        f"tokenize would read out/merged.jsonl, made from other inputs or settings than this run's: out/merged.jsonl "
        f"changed (size {size} -> {size + 1} bytes) after merge recorded what it was made from (edited, or written by "
        f"a run that stopped before recording, or by the stage called from Python); re-run from merge: sh {SCRIPT} "
        f"c.json --stages merge,tokenize,pack")


def test_untouched_re_runs_are_accepted_and_pack_the_same_bytes(work, capsys):
    before = _outputs(work)
    for stages in ("pack", "tokenize,pack", "sample,merge,tokenize,pack"):
        pipeline.main(["c.json", "--stages", stages])
        assert "WARNING" not in capsys.readouterr().err
        assert _outputs(work) == before, stages
    # a key only later stages read (documented: --stages tokenize,pack max_length=... pack.max_length=...)
    pipeline.main(["c.json", "--stages", "tokenize,pack", "max_length=128", "pack.max_length=128"])
    assert orjson.loads((work / "out/packed/meta.json").read_bytes())["max_length"] == 128


def test_outputs_without_a_record_are_accepted_with_a_warning(work, capsys):
    """A version without provenance.json wrote them: its inputs and settings cannot be checked; the run says so
    and how to record them, at its start and again at its end."""
    (work / "out/provenance.json").unlink()
    capsys.readouterr()
    pipeline.main(["c.json", "--stages", "tokenize,pack"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING")]
    assert warnings[0] == warnings[-1] == (
        "WARNING: inputs: out/canonical.jsonl has no record of what it was made from (written by a version without "
        "provenance.json, or by a stage called from Python): its inputs and settings are not checked; re-run from "
        f"preprocess once to record them: sh {SCRIPT} c.json --stages {ALL}") and len(warnings) == 2
    records = orjson.loads((work / "out/provenance.json").read_bytes())["stages"]
    assert list(records) == ["tokenize", "pack"]  # what this run made is recorded


def test_the_eval_splits_outputs_are_judged_alike(work, capsys):
    pipeline.main(["c.json", "eval_size=4"])
    with open("out/eval/merged.jsonl", "ab") as f:
        f.write(b"\n")
    message = _refused(capsys, "--stages", "tokenize,pack", "eval_size=4")
    assert message.startswith("tokenize would read out/eval/merged.jsonl, made from other inputs or settings than "
                              "this run's: out/eval/merged.jsonl changed (size ")
    assert message.endswith(f"re-run from merge: sh {SCRIPT} c.json --stages merge,tokenize,pack eval_size=4")
    assert _refused(capsys, "--stages", "tokenize,pack").startswith(  # the split's size is sample's
        "tokenize would read out/merged.jsonl, made from other inputs or settings than this run's: sample ran with "
        "eval_size=4 (this run: null); re-run from sample: ")


def _converter_run(base, monkeypatch, converter: str):
    """A run whose input is read by `format: function` (conv.py, which imports helpers.py beside it), from `base`
    as the current directory (on sys.path, as `python -m data.pipeline` run there has it)."""
    (base / "raw.jsonl").write_bytes(b"".join(orjson.dumps({"q": f"What is {i} + {i}?", "a": str(2 * i)}) + b"\n"
                                              for i in range(12)))
    (base / "helpers.py").write_text("def answer(row):\n    return row['a']\n")
    (base / "conv.py").write_text(converter)
    (base / "c.json").write_bytes(orjson.dumps({
        "inputs": [{"path": "raw.jsonl", "format": "function", "function": "conv.py:to_record"}],
        "output_dir": "out", "tokenizer_path": str(ROOT / "data/example/tokenizer"), "num_workers": 1,
        "max_length": 256}))
    monkeypatch.chdir(base)
    monkeypatch.syspath_prepend(str(base))
    pipeline.main(["c.json"])


CONVERTER = """import helpers


def to_record(row):
    return {"messages": [{"role": "user", "content": row["q"]}, {"role": "assistant", "content": helpers.answer(row)}]}
"""


def test_a_changed_module_the_converter_imports_refuses_the_reuse_of_canonical_jsonl(tmp_path, capsys, monkeypatch):
    """Before: the converter's own file was recorded, not the helper module it imports; after an edit of the helper
    `--stages sample,merge,tokenize,pack` reused the stale canonical.jsonl."""
    _converter_run(tmp_path, monkeypatch, CONVERTER)
    helper = tmp_path / "helpers.py"
    before = helper.stat().st_size
    helper.write_text("def answer(row):\n    return row['a'] + ' (checked)'\n")
    message = _refused(capsys, "--stages", "sample,merge,tokenize,pack")
    assert message == (
        f"sample would read out/canonical.jsonl, made from other inputs or settings than this run's: an input of "
        f"preprocess, {helper}, changed (size {before} -> {helper.stat().st_size} bytes) since preprocess ran; "
        f"re-run from preprocess: sh {SCRIPT} c.json --stages {ALL}")


def test_a_converter_importing_by_a_computed_name_is_said_to_be_unfollowed(tmp_path, capsys, monkeypatch):
    _converter_run(tmp_path, monkeypatch, "import importlib\n" + CONVERTER.replace(
        "import helpers\n", "helpers = importlib.import_module('helpers')\n"))
    capsys.readouterr()
    pipeline.main(["c.json", "--stages", "sample,merge,tokenize,pack"])
    err = capsys.readouterr().err
    assert (f"WARNING: inputs: out/canonical.jsonl is reused, but the converter conv.py:to_record "
            f"imports modules by a computed name ({tmp_path / 'conv.py'}:2: import_module(...)), whose changes PackSFT "
            f"cannot see: if they changed, re-run from preprocess: sh {SCRIPT} c.json --stages {ALL}") in err, err
