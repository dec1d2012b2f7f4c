"""Per-step training log: <output_dir>/log.jsonl, console, TensorBoard / offline wandb, and the loss-curve PNG.

Only the main process (torch.distributed rank 0) writes; the records already hold whole-step values reduced over
every rank and micro-batch.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import orjson

logger = logging.getLogger("packsft.train")

LOG_FILE = "log.jsonl"


def read_log(path: str | os.PathLike) -> list[dict]:
    file = Path(path)
    if file.is_dir():
        file = file / LOG_FILE
    if not file.is_file():
        return []
    return [orjson.loads(line) for line in file.read_bytes().splitlines() if line.strip()]


def truncate_log(output_dir: str | os.PathLike, last_step: int) -> None:
    """Drop records after `last_step` (written by a run that crashed after its last checkpoint; 0: a new run)."""
    file = Path(output_dir) / LOG_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    records = [r for r in read_log(file) if r.get("step", 0) <= last_step]
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    os.replace(tmp, file)


def _format(record: dict) -> str:
    parts = []
    for key in ("step", "epoch", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "loss_tokens"):
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif value is not None:
            parts.append(f"{key}={value}")
    cats = record.get("category_loss") or {}
    if cats:
        parts.append("category_loss={" + ", ".join(f"{k}: {v:.4g}" for k, v in cats.items()) + "}")
    return " ".join(parts)


class MetricsLogger:
    def __init__(self, output_dir: str | os.PathLike, enabled: bool, backends: list[str], run_config: dict,
                 wandb_project: str = "packsft", write_console=None):
        self.enabled = enabled
        self.out = Path(output_dir)
        self.write_console = write_console or print
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._file = open(self.out / LOG_FILE, "ab")
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        if "wandb" in backends:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("log_backends contains 'wandb' but wandb is not installed (pip install wandb)") from None
            self._wandb = wandb.init(project=wandb_project, dir=str(self.out), mode="offline", config=run_config)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(orjson.dumps(record) + b"\n")
        self._file.flush()
        self.write_console(_format(record))
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        for name, value in (record.get("category_loss") or {}).items():
            scalars[f"category_loss/{name}"] = value
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def plot_losses(output_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path | None:
    """PNG of the loss and every category's loss per step, from log.jsonl (None when there is nothing to plot)."""
    records = [r for r in read_log(output_dir) if "loss" in r]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({name for r in records for name in (r.get("category_loss") or {})})
    fig, axes = plt.subplots(1, 2 if names else 1, figsize=(12 if names else 6, 4), squeeze=False)
    steps = [r["step"] for r in records]
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in records], label="train loss")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.legend()
    if names:
        ax = axes[0][1]
        for name in names:  # NaN where a step had no token of the category: a gap, not an interpolated line
            values = [(r.get("category_loss") or {}).get(name, float("nan")) for r in records]
            ax.plot(steps, values, ".-", markersize=3, label=name)
        ax.set_xlabel("step")
        ax.set_title("per-category loss (token mean)")
        ax.legend(fontsize="small")
    fig.tight_layout()
    target = Path(path) if path else Path(output_dir) / "loss.png"
    tmp = target.with_name(f".{target.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, target)
    return target
