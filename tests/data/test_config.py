"""The data config (data/config.py): `sh data_process.sh --help` lists every key with its type, default and help;
inputs that a stage would write over are refused; tokenizer_path names what is wrong with it, and a Hugging Face Hub
id resolves from the cache; the example's ratio file is written to its output directory. (The keys of other tools'
names and relative paths: tests/train/config/test_sections.py checks both configs.)"""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import orjson
import pytest

from common.config import ConfigError, field_help
from data import pipeline
from data.config import DataConfig, InputSpec, MergeConfig, PackConfig
from tests._data_helpers import CHAT_QA, data_config_file, example_config, write_jsonl
from tests.conftest import ROOT


def test_data_process_help_lists_every_key_with_type_default_and_help():
    proc = subprocess.run(["sh", str(ROOT / "data_process.sh"), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for cls, prefix in ((DataConfig, ""), (MergeConfig, "merge."), (PackConfig, "pack."), (InputSpec, "")):
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("merge", "pack"):
                continue
            assert helps[f.name], f"{prefix}{f.name} has no help comment in data/config.py"
            [i] = [i for i, line in enumerate(lines) if line.startswith(f"  {prefix}{f.name} (")]
            assert ", default " in lines[i] and lines[i + 1].strip() == helps[f.name]
    assert "  category_loss_warning (float, default 0.5)" in lines
    assert '  reasoning_tags (list[str], default ["<think>\\n","\\n</think>\\n\\n"])' in lines


@pytest.mark.parametrize("name, stage", [("canonical.jsonl", "preprocess"), ("merged.jsonl", "merge"),
                                         ("tokenized/raw.jsonl", "tokenize"), ("report.json", "every stage")])
def test_an_input_that_a_stage_would_write_over_is_refused(tmp_path, capsys, name, stage):
    """Inputs named like an output inside output_dir were overwritten (exit 0, the source data gone)."""
    source = tmp_path / "out" / name
    source.parent.mkdir(parents=True)
    write_jsonl(source, [CHAT_QA] * 3)
    before = source.read_bytes()
    config = data_config_file(tmp_path, [{"path": str(source), "category_name": "chat"}])
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
    write_jsonl(out / "mine.jsonl", [CHAT_QA] * 2)
    write_jsonl(out / "sampled.jsonl", [CHAT_QA])  # an earlier run's output, matched by the glob
    config = data_config_file(tmp_path, [{"path": str(out / "*.jsonl"), "category_name": "chat"}])
    with pytest.raises(SystemExit):
        pipeline.main([config, "--stages", "preprocess"])
    assert f"error: inputs[0].path: {out / 'sampled.jsonl'} is an output of sample" in capsys.readouterr().err


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


def _hub_snapshot(cache, repo: str, source_dir) -> None:
    """A Hugging Face cache entry of `repo` (models--org--name/snapshots/<rev>, refs/main) holding the files of
    `source_dir`, as `hf download` leaves it."""
    import shutil

    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / "0"
    snapshot.mkdir(parents=True)
    for f in source_dir.iterdir():
        shutil.copy(f, snapshot / f.name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0")


def test_data_tokenizer_path_takes_a_hub_id_from_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from common.config import pretrained_dir
    from data.config import check_tokenizer_dir

    pretrained_dir.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _hub_snapshot(tmp_path / "hub", "example-org/example-tokenizer", ROOT / "data" / "example" / "tokenizer")
    resolved = check_tokenizer_dir("example-org/example-tokenizer")
    assert resolved.is_dir() and (resolved / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match=r"unreachable \(HF_HUB_OFFLINE=1\).*hf download example-org/missing"):
        check_tokenizer_dir("example-org/missing")
    pretrained_dir.cache_clear()


def test_the_examples_ratio_file_is_written_to_its_output_directory_not_under_configs():
    from data.config import load_config

    cfg = load_config(ROOT / "configs/data/example.json")
    assert cfg.ratio_file == Path("outputs/example/ratios.json")  # outputs/ is ignored by git
    assert "outputs/" in (ROOT / ".gitignore").read_text().splitlines()
    tracked_ratio_files = [p for p in (ROOT / "configs").rglob("*.json")
                           if list(orjson.loads(p.read_bytes())) == ["categories"]]
    assert tracked_ratio_files == []
