"""stats.png and stats.json (data/stats.py): lengths per category and what tokenize dropped, per-category shares of
tokens and loss tokens; the pack stage writes tokenize's losses and each category's lengths to stats.json."""
from __future__ import annotations

import numpy as np
import orjson

from tests.conftest import ROOT


def test_stats_png_shows_lengths_per_category_and_what_tokenize_dropped(tmp_path):
    from data.stats import Counts, category_counts, pack_statistics, stats_figure

    lengths = category_counts(np.array([5, 7, 9, 40]), np.array([1, 1, 3, 3]))
    rows = Counts.of([12, 9, 40])
    stats = pack_statistics(lengths, rows, Counts.of([2, 1, 1]), 64, {1: 12, 3: 49}, {1: 3, 3: 6},
                            {1: "math", 3: "chat"})
    assert stats["categories"][3]["sequence_length"] == {"min": 9, "mean": 24.5, "median": 24.5, "max": 40}
    fig = stats_figure(lengths, rows, 64, stats["categories"],
                       {"dropped": {"overlong": 3, "bad_label": 1}, "truncated": 2})
    lengths_ax = fig.axes[0]
    assert lengths_ax.get_title() == "4 sequences\ndropped in tokenize: overlong 3, bad_label 1; truncated 2"
    assert [t.get_text() for t in lengths_ax.get_legend().get_texts()] == ["all", "1:math", "3:chat", "max_length 64"]


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


def test_pack_writes_per_category_lengths_and_tokenize_losses_to_stats(tmp_path):
    from data import pipeline

    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    for spec in raw["inputs"]:
        spec["path"] = str(ROOT / spec["path"])
    raw.update(output_dir=str(tmp_path / "out"), tokenizer_path=str(ROOT / raw["tokenizer_path"]),
               ratio_path=str(tmp_path / "ratios.json"), num_workers=1, max_length=200, overlong="truncate",
               merge={"probability": 0.0})
    (tmp_path / "c.json").write_bytes(orjson.dumps(raw))
    pipeline.main([str(tmp_path / "c.json")])
    stats = orjson.loads((tmp_path / "out" / "packed" / "stats.json").read_bytes())
    tokenize = orjson.loads((tmp_path / "out" / "report.json").read_bytes())["tokenize"]
    assert stats["tokenize"] == {"dropped": tokenize["dropped"], "truncated": tokenize["truncated"]}
    assert stats["tokenize"]["truncated"] > 0
    assert {c["name"] for c in stats["categories"].values() if c["sequence_length"]["max"] > 0} == \
        {"math", "code", "chat", "tools"}
