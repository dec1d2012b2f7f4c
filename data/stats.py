"""Packing statistics: stats.json content, the printed table and stats.png (length histogram, row fill,
per-category shares)."""
from __future__ import annotations

import io
import math
from typing import Mapping

import numpy as np


def _summary(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"min": 0, "mean": 0.0, "median": 0.0, "max": 0}
    return {
        "min": int(values.min()),
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "max": int(values.max()),
    }


def pack_statistics(
    seq_lengths: np.ndarray,
    row_n_tokens: np.ndarray,
    row_n_seqs: np.ndarray,
    max_length: int,
    category_tokens: Mapping[int, int],
    category_loss_tokens: Mapping[int, int],
    categories: Mapping[int, str] | None = None,
    seq_categories: np.ndarray | None = None,
) -> dict:
    """Everything stats.json reports about a packed dataset, from its index arrays and per-category counts
    (`seq_categories`: each sequence's category, for per-category sequence lengths).

    Padding is what fixed rows of `max_length` would add (`rows * max_length - tokens`); nothing is stored.
    The lower bound on the number of rows is ceil(tokens / max_length).
    """
    seq_lengths = np.asarray(seq_lengths, dtype=np.int64)
    row_n_tokens = np.asarray(row_n_tokens, dtype=np.int64)
    row_n_seqs = np.asarray(row_n_seqs, dtype=np.int64)
    rows = int(row_n_tokens.shape[0])
    tokens = int(row_n_tokens.sum())
    capacity = rows * int(max_length)
    lower_bound = math.ceil(tokens / max_length)
    names = {int(k): v for k, v in (categories or {}).items()}
    per_category = {
        int(c): {
            "name": names.get(int(c), "untracked" if int(c) == 0 else f"category_{c}"),
            "tokens": int(n),
            "loss_tokens": int(category_loss_tokens.get(c, 0)),
            "token_share": n / tokens if tokens else 0.0,
            **({} if seq_categories is None else
               {"sequence_length": _summary(seq_lengths[np.asarray(seq_categories) == int(c)])}),
        }
        for c, n in sorted(category_tokens.items())
    }
    return {
        "max_length": int(max_length),
        "rows": rows,
        "sequences": int(seq_lengths.shape[0]),
        "tokens": tokens,
        "loss_tokens": int(sum(category_loss_tokens.values())),
        "capacity_tokens": capacity,
        "padding_tokens": capacity - tokens,
        "fill": tokens / capacity if capacity else 0.0,
        "lower_bound_rows": lower_bound,
        "rows_over_lower_bound": rows / lower_bound if lower_bound else 1.0,
        "sequences_per_row": _summary(row_n_seqs),
        "row_tokens": _summary(row_n_tokens),
        "sequence_length": _summary(seq_lengths),
        "categories": per_category,
    }


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


def stats_figure(seq_lengths: np.ndarray, row_n_tokens: np.ndarray, max_length: int,
                 categories: Mapping[int, dict] | None = None, seq_categories: np.ndarray | None = None,
                 tokenize_losses: Mapping | None = None):
    """The stats.png figure: sequence-length histogram (log-spaced bins, log counts; one outline per category
    with `seq_categories`, and the records tokenize dropped or truncated, `tokenize_losses`, in its title), the
    histogram of row fill, and each category's share of the tokens and of the loss tokens (`categories`:
    stats.json's)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seq_lengths = np.asarray(seq_lengths)
    fill = np.asarray(row_n_tokens) / max_length
    fig = Figure(figsize=(16, 4), dpi=100)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    if seq_lengths.size:
        hi = max(int(seq_lengths.max()), 2)
        bins = np.unique(np.geomspace(1, hi + 1, 60).astype(np.int64))
        ax1.hist(seq_lengths, bins=bins, color="#3b75af", label="all")
        if seq_categories is not None:
            for cid, c in (categories or {}).items():
                ax1.hist(seq_lengths[np.asarray(seq_categories) == int(cid)], bins=bins, histtype="step",
                         linewidth=1.2, label=f"{cid}:{c['name']}"[:20])
        ax1.set_xscale("log")
        ax1.set_yscale("log")
    ax1.axvline(max_length, color="#c44e52", linestyle="--", label=f"max_length {max_length:,}")
    ax1.set_xlabel("sequence length (tokens)")
    ax1.set_ylabel("sequences")
    ax1.set_title(f"{seq_lengths.size:,} sequences" + (f"\n{tokenize_losses_text(tokenize_losses)}"
                                                      if tokenize_losses else ""), fontsize="medium")
    ax1.legend(loc="upper right", fontsize="small")
    if fill.size:
        ax2.hist(fill, bins=np.linspace(0, 1, 51), color="#55a868")
        ax2.set_yscale("log")
    mean_fill = float(fill.mean()) if fill.size else 0.0
    ax2.set_xlabel("row fill (tokens / max_length)")
    ax2.set_ylabel("rows")
    ax2.set_title(f"{fill.size:,} rows, mean fill {mean_fill:.2%}")
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


def plot_stats(seq_lengths: np.ndarray, row_n_tokens: np.ndarray, max_length: int,
               categories: Mapping[int, dict] | None = None, seq_categories: np.ndarray | None = None,
               tokenize_losses: Mapping | None = None) -> bytes:
    """stats.png (`stats_figure`) as PNG bytes, without a timestamp (so it is deterministic)."""
    buf = io.BytesIO()
    stats_figure(seq_lengths, row_n_tokens, max_length, categories, seq_categories,
                 tokenize_losses).savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()
