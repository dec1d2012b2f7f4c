"""Progress output (data/progress.py): a bar on a terminal, whole lines at most every 10 s otherwise, and the stages
of a run print whole lines when not on a terminal."""
from __future__ import annotations

import types

import orjson

from data import pipeline
from tests._data_helpers import copy_run


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
    config, out = copy_run(example_run, tmp_path)
    pipeline.main([str(config), "--stages", "tokenize,pack"])
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    size = (out / "merged.jsonl").stat().st_size
    assert any(line.startswith(f"[tokenize] {size / 1000:.1f}k/{size / 1000:.1f}k B (100%) ") for line in lines), err
    rows = orjson.loads((out / "packed" / "meta.json").read_bytes())["counts"]["rows"]
    assert any(line.startswith(f"[pack] {rows}/{rows} row (100%) ") for line in lines), err
