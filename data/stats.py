"""Packing statistics: stats.json content, the printed table and stats.png (length histogram, row fill,
per-category shares)."""
from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Counts:
    """How often each integer value occurs (`values` increasing and distinct, `counts` positive): a column of
    lengths in memory bounded by its distinct values (at most max_length), not by its size. Workers count their
    parts (`of`), the driver adds them; summaries and plots read the counts, exactly as they would the column."""

    values: np.ndarray  # int64
    counts: np.ndarray  # int64

    @classmethod
    def of(cls, column) -> "Counts":
        values, counts = np.unique(np.asarray(column, dtype=np.int64), return_counts=True)
        return cls(values, counts.astype(np.int64))

    @classmethod
    def total(cls, parts: Iterable["Counts"]) -> "Counts":
        parts = [p for p in parts if p.values.size]
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))
        values = np.concatenate([p.values for p in parts])
        counts = np.concatenate([p.counts for p in parts])
        order = np.argsort(values, kind="stable")
        values, counts = values[order], counts[order]
        starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
        return cls(values[starts], np.add.reduceat(counts, starts))

    def __add__(self, other: "Counts") -> "Counts":
        return Counts.total([self, other])

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    @property
    def sum(self) -> int:
        return int(self.values @ self.counts)

    def nth(self, rank: int) -> int:
        """The value at position `rank` (0-based) of the sorted column."""
        return int(self.values[np.searchsorted(np.cumsum(self.counts), rank, side="right")])

    def summary(self) -> dict:
        """min, mean, median (the mean of the two middle values of an even count) and max, as numpy gives them
        for the column."""
        n = self.n
        if n == 0:
            return {"min": 0, "mean": 0.0, "median": 0.0, "max": 0}
        return {
            "min": int(self.values[0]),
            "mean": self.sum / n,
            "median": (self.nth((n - 1) // 2) + self.nth(n // 2)) / 2,
            "max": int(self.values[-1]),
        }


def category_counts(column, categories) -> dict[int, Counts]:
    """`Counts` of `column` per category id (`categories`: one per element of `column`)."""
    column, categories = np.asarray(column, dtype=np.int64), np.asarray(categories)
    return {int(c): Counts.of(column[categories == c]) for c in np.unique(categories)}


def add_category_counts(total: dict[int, Counts], part: Mapping[int, Counts]) -> None:
    """`part`'s counts added into `total`, per category id."""
    for cid, counts in part.items():
        total[cid] = total[cid] + counts if cid in total else counts


def pack_statistics(
    seq_lengths: Mapping[int, Counts],
    row_tokens: Counts,
    row_sequences: Counts,
    max_length: int,
    category_tokens: Mapping[int, int],
    category_loss_tokens: Mapping[int, int],
    categories: Mapping[int, str] | None = None,
) -> dict:
    """Everything stats.json reports about a packed dataset, from counts: sequence lengths per category id (each
    sequence's category), the tokens and the sequences of each row, tokens and loss tokens per category.

    Padding is what fixed rows of `max_length` would add (`rows * max_length - tokens`); nothing is stored.
    The lower bound on the number of rows is ceil(tokens / max_length).
    """
    rows = row_tokens.n
    tokens = row_tokens.sum
    capacity = rows * int(max_length)
    lower_bound = math.ceil(tokens / max_length)
    names = {int(k): v for k, v in (categories or {}).items()}
    per_category = {
        int(c): {
            "name": names.get(int(c), "untracked" if int(c) == 0 else f"category_{c}"),
            "tokens": int(n),
            "loss_tokens": int(category_loss_tokens.get(c, 0)),
            "token_share": n / tokens if tokens else 0.0,
            "sequence_length": seq_lengths.get(int(c), Counts.of([])).summary(),
        }
        for c, n in sorted(category_tokens.items())
    }
    all_lengths = Counts.total(seq_lengths.values())
    return {
        "max_length": int(max_length),
        "rows": rows,
        "sequences": all_lengths.n,
        "tokens": tokens,
        "loss_tokens": int(sum(category_loss_tokens.values())),
        "capacity_tokens": capacity,
        "padding_tokens": capacity - tokens,
        "fill": tokens / capacity if capacity else 0.0,
        "lower_bound_rows": lower_bound,
        "rows_over_lower_bound": rows / lower_bound if lower_bound else 1.0,
        "sequences_per_row": row_sequences.summary(),
        "row_tokens": row_tokens.summary(),
        "sequence_length": all_lengths.summary(),
        "categories": per_category,
    }


MEDIA_REPORT_KEYS = ("images", "image_tokens", "videos", "video_tokens", "video_seconds", "videos_with_audio",
                     "audios", "audio_tokens", "audio_seconds")  # of stats.json's media counts, in report.json


def media_statistics(counts: dict) -> dict:
    """stats.json's media counts from a media store's `counts`: per kind its items, tokens and bytes (and seconds
    for videos and audio), and the videos with their sound track."""
    out = {}
    for kind in ("image", "video", "audio"):
        out.update({f"{kind}s": counts[f"{kind}s"], f"{kind}_tokens": counts[f"{kind}_tokens"],
                    f"{kind}_bytes": counts[f"{kind}_bytes"]})
        if f"{kind}_millis" in counts:
            out[f"{kind}_seconds"] = counts[f"{kind}_millis"] / 1000
    out["videos_with_audio"] = counts["videos_with_audio"]
    return out


def format_table(stats: dict) -> str:
    """The human-readable summary printed at the end of the pack stage."""
    spr = stats["sequences_per_row"]
    lines = [
        f"{'rows':<28}{stats['rows']:>16,}",
        f"{'sequences':<28}{stats['sequences']:>16,}",
        f"{'tokens':<28}{stats['tokens']:>16,}",
        f"{'loss tokens':<28}{stats['loss_tokens']:>16,}",
        f"{'max_length':<28}{stats['max_length']:>16,}",
        f"{'padding (fixed rows)':<28}{stats['padding_tokens']:>16,}",
        f"{'fill':<28}{stats['fill']:>16.4%}",
        f"{'lower bound rows':<28}{stats['lower_bound_rows']:>16,}",
        f"{'rows / lower bound':<28}{stats['rows_over_lower_bound']:>16.5f}",
        f"{'sequences/row min/mean/max':<28}{spr['min']:>6,} {spr['mean']:>8.2f} {spr['max']:>6,}",
    ]
    if "duplicate_rows" in stats:
        lines.append(f"{'duplicate rows':<28}{stats['duplicate_rows']:>16,}")
        lines.append(f"{'rows with a record twice':<28}{stats['rows_with_a_record_twice']:>16,}")
    if stats.get("images"):
        lines.append(f"{'images':<28}{stats['images']:>16,}")
        lines.append(f"{'image tokens':<28}{stats['image_tokens']:>16,}")
    for kind in ("video", "audio"):
        if stats.get(f"{kind}s"):
            lines.append(f"{kind + 's (seconds)':<28}{stats[f'{kind}s']:>16,} ({stats[f'{kind}_seconds']:,.1f} s)")
            lines.append(f"{kind + ' tokens':<28}{stats[f'{kind}_tokens']:>16,}")
    if stats["categories"]:
        lines.append("")
        lines.append(f"{'category':<24}{'tokens':>16}{'loss tokens':>16}{'share':>9}")
        for cid, c in stats["categories"].items():
            label = f"{cid}:{c['name']}"[:23]
            lines.append(f"{label:<24}{c['tokens']:>16,}{c['loss_tokens']:>16,}{c['token_share']:>9.2%}")
    return "\n".join(lines)


def category_shares(categories: Mapping[int, dict]) -> tuple[list[str], list[float], list[float]]:
    """(labels, token shares, loss-token shares) per category of stats.json's `categories`, in id order."""
    labels = [f"{cid}:{c['name']}" for cid, c in categories.items()]
    tokens = sum(c["tokens"] for c in categories.values())
    loss = sum(c["loss_tokens"] for c in categories.values())
    return (labels, [c["tokens"] / tokens if tokens else 0.0 for c in categories.values()],
            [c["loss_tokens"] / loss if loss else 0.0 for c in categories.values()])


def tokenize_losses_text(tokenize_losses: Mapping | None) -> str:
    """`dropped in tokenize: overlong 3, bad_label 1; truncated 2` from the tokenize report section's `dropped`
    and `truncated`, or "" without one."""
    if not tokenize_losses:
        return ""
    dropped = ", ".join(f"{reason} {n:,}" for reason, n in tokenize_losses.get("dropped", {}).items()) or "none"
    return f"dropped in tokenize: {dropped}; truncated {tokenize_losses.get('truncated', 0):,}"


def stats_figure(seq_lengths: Mapping[int, Counts], row_tokens: Counts, max_length: int,
                 categories: Mapping[int, dict] | None = None, tokenize_losses: Mapping | None = None):
    """The stats.png figure: sequence-length histogram (log-spaced bins, log counts; one outline per category of
    `categories`, stats.json's, and the records tokenize dropped or truncated, `tokenize_losses`, in its title),
    the histogram of row fill, and each category's share of the tokens and of the loss tokens."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    lengths = Counts.total(seq_lengths.values())
    fig = Figure(figsize=(16, 4), dpi=100)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    if lengths.n:
        hi = max(int(lengths.values[-1]), 2)
        bins = np.unique(np.geomspace(1, hi + 1, 60).astype(np.int64))
        ax1.hist(lengths.values, bins=bins, weights=lengths.counts, color="#3b75af", label="all")
        for cid, c in (categories or {}).items():
            own = seq_lengths.get(int(cid), Counts.of([]))
            ax1.hist(own.values, bins=bins, weights=own.counts, histtype="step", linewidth=1.2,
                     label=f"{cid}:{c['name']}"[:20])
        ax1.set_xscale("log")
        ax1.set_yscale("log")
    ax1.axvline(max_length, color="#c44e52", linestyle="--", label=f"max_length {max_length:,}")
    ax1.set_xlabel("sequence length (tokens)")
    ax1.set_ylabel("sequences")
    ax1.set_title(f"{lengths.n:,} sequences" + (f"\n{tokenize_losses_text(tokenize_losses)}"
                                                if tokenize_losses else ""), fontsize="medium")
    ax1.legend(loc="upper right", fontsize="small")
    if row_tokens.n:
        ax2.hist(row_tokens.values / max_length, bins=np.linspace(0, 1, 51), weights=row_tokens.counts,
                 color="#55a868")
        ax2.set_yscale("log")
    mean_fill = row_tokens.sum / (row_tokens.n * max_length) if row_tokens.n else 0.0
    ax2.set_xlabel("row fill (tokens / max_length)")
    ax2.set_ylabel("rows")
    ax2.set_title(f"{row_tokens.n:,} rows, mean fill {mean_fill:.2%}")
    labels, token_share, loss_share = category_shares(categories or {})
    y = np.arange(len(labels))
    ax3.barh(y - 0.2, token_share, height=0.4, color="#3b75af", label="tokens")
    ax3.barh(y + 0.2, loss_share, height=0.4, color="#dd8452", label="loss tokens")
    ax3.set_yticks(y, [label[:20] for label in labels])
    ax3.invert_yaxis()
    ax3.set_xlim(0, 1)
    ax3.set_xlabel("share")
    ax3.set_title("per-category shares")
    if labels:
        ax3.legend(loc="lower right")
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.13, top=0.92, wspace=0.3)  # fixed: tight_layout is slow
    return fig


def plot_stats(seq_lengths: Mapping[int, Counts], row_tokens: Counts, max_length: int,
               categories: Mapping[int, dict] | None = None, tokenize_losses: Mapping | None = None) -> bytes:
    """stats.png (`stats_figure`) as PNG bytes, without a timestamp (so it is deterministic)."""
    buf = io.BytesIO()
    stats_figure(seq_lengths, row_tokens, max_length, categories, tokenize_losses).savefig(
        buf, format="png", metadata={"Software": None})
    return buf.getvalue()
