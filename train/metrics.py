"""Per-step training log: <output_dir>/log.jsonl, console, TensorBoard / offline wandb, and the loss-curve PNG.

Only the main process (torch.distributed rank 0) writes; the records already hold whole-step values reduced over
every rank and micro-batch.
"""
from __future__ import annotations

import logging
import os
import shlex
import time
from pathlib import Path

import numpy as np
import orjson

from common.config import ConfigError
from common.fsutil import atomic_write_bytes, atomic_writer

logger = logging.getLogger("packsft.train")

LOG_FILE = "log.jsonl"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # wandb.init(dir=output_dir) writes there


def read_log(path: str | os.PathLike) -> list[dict]:
    """The records of a training log (a file, or output_dir). A line that is not a JSON object is a ConfigError
    naming the file and line (the trainer would otherwise truncate a file that is not its log); an incomplete last
    line, which a run killed in the middle of writing it leaves, is dropped with a warning."""
    file = Path(path)
    if file.is_dir():
        file = file / LOG_FILE
    if not file.is_file():
        return []
    content = file.read_bytes()
    lines = content.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None
            if number == len(lines) and not content.endswith(b"\n"):
                logger.warning(f"{file}:{number}: an incomplete last line (a run killed while writing it): dropped")
                continue
        if not isinstance(record, dict):
            raise ConfigError(
                f"{file}:{number}: not a JSON object ({line[:60].decode(errors='replace')!r}): {LOG_FILE} in "
                "output_dir is PackSFT's training log, one JSON object per step, and this file is not one; move it "
                "out of output_dir (or set another output_dir): the run would truncate it"
            )
        records.append(record)
    return records


def truncate_log(output_dir: str | os.PathLike, last_step: int) -> None:
    """Drop records after `last_step` (written by a run that crashed after its last checkpoint; 0: a new run)."""
    file = Path(output_dir) / LOG_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    records = [r for r in read_log(file) if r.get("step", 0) <= last_step]
    atomic_write_bytes(file, b"".join(orjson.dumps(r) + b"\n" for r in records))


def _format(record: dict) -> str:
    parts = []
    for key in ("step", "epoch", "loss", "aux_loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "loss_tokens"):
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif value is not None:
            parts.append(f"{key}={value}")
    for key in ("category_loss", "eval_category_loss"):
        cats = record.get(key) or {}
        if cats:
            parts.append(f"{key}={{" + ", ".join(f"{k}: {v:.4g}" for k, v in cats.items()) + "}")
    return " ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def step_progress(step: int, total: int, first_step: int, elapsed: float) -> str:
    """What a progress bar would show, for step lines written to a file: `[step/total, elapsed h:mm:ss, eta
    h:mm:ss]`, the ETA from the mean time of the steps this run has taken (a resumed run's start excluded)."""
    done = step - first_step
    eta = elapsed / done * (total - step) if done > 0 else 0.0
    return f"[{step}/{total}, elapsed {_duration(elapsed)}, eta {_duration(eta)}]"


EVAL_PROGRESS_EVERY_S = 10.0  # without a terminal: a progress line of an evaluation at most this often


class EvalProgress:
    """What an evaluation shows while it runs (a pass over 12 long rows took 97 s in silence): a tqdm bar on a
    terminal, else a line when it starts, one every EVAL_PROGRESS_EVERY_S seconds and one at the end. Only where
    `enabled` (the main rank); rows are counted over all ranks."""

    def __init__(self, total_rows: int, write, bar: bool, enabled: bool):
        import time

        self.total, self.write, self.enabled = total_rows, write, enabled
        self._clock = time.perf_counter
        self._start = self._last = self._clock()
        self._bar = None
        if enabled and bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_rows, desc="eval", unit="row", leave=False, dynamic_ncols=True)
        elif enabled:
            self._line(0)

    def _line(self, done: int) -> None:
        elapsed = self._clock() - self._start
        eta = elapsed / done * (self.total - done) if done else 0.0
        self.write(f"evaluating: {done}/{self.total} rows [elapsed {_duration(elapsed)}, eta {_duration(eta)}]")
        self._last = self._clock()

    def update(self, done: int) -> None:
        """`done` rows evaluated so far."""
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
        elif self.enabled and (done == self.total or self._clock() - self._last >= EVAL_PROGRESS_EVERY_S):
            self._line(done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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

            self._tb = SummaryWriter(log_dir=str(self.out / TENSORBOARD_DIR))
        if "wandb" in backends:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("log_backends contains 'wandb' but wandb is not installed (pip install wandb)") from None
            self._wandb = wandb.init(project=wandb_project, dir=str(self.out), mode="offline", config=run_config)

    def log(self, record: dict, progress: str | None = None) -> None:
        """One step's record: log.jsonl, the console line (with `progress` at its end, when given), the backends."""
        if not self.enabled:
            return
        self._file.write(orjson.dumps(record) + b"\n")
        self._file.flush()
        self.write_console(_format(record) + (f" {progress}" if progress else ""))
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        for key in ("category_loss", "eval_category_loss"):
            for name, value in (record.get(key) or {}).items():
                scalars[f"{key}/{name}"] = value
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


def ema_weight(n_points: int) -> float:
    """Smoothing of a curve of n points: an exponential moving average spanning about n/20 points (none up to 20
    points), so a long run's per-category noise is smoothed and a short run's curve stays as measured."""
    return min(0.98, max(0.0, 1.0 - 20.0 / n_points)) if n_points else 0.0


def smoothed(values: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average over the given points only (a step without a value is not a
    point, so it leaves no gap and does not pull the curve)."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(avg / norm)
    return out


def loss_curves(records: list[dict]) -> dict:
    """What loss.png shows, as data: train/eval loss, the router aux loss (MoE), per-category (raw and smoothed,
    each over the steps where the category had loss tokens; eval points), lr, grad norm and the tokens trained by
    the end of each step. A step skipped for a non-finite loss (logged as null) is left out."""
    records = [r for r in records if r.get("loss") is not None]
    curves = {
        "tokens_seen": ([r["step"] for r in records if "tokens" in r],
                        np.cumsum([r["tokens"] for r in records if "tokens" in r]).tolist()),
        "loss": ([r["step"] for r in records], [r["loss"] for r in records]),
        "eval_loss": ([r["step"] for r in records if "eval_loss" in r],
                      [r["eval_loss"] for r in records if "eval_loss" in r]),
        "aux_loss": ([r["step"] for r in records if "aux_loss" in r],
                     [r["aux_loss"] for r in records if "aux_loss" in r]),
        "lr": ([r["step"] for r in records if "lr" in r], [r["lr"] for r in records if "lr" in r]),
        "grad_norm": ([r["step"] for r in records if r.get("grad_norm") is not None],
                      [r["grad_norm"] for r in records if r.get("grad_norm") is not None]),
        "category": {},
    }
    names = sorted({name for r in records for name in (r.get("category_loss") or {})})
    for name in names:
        present = [r for r in records if name in (r.get("category_loss") or {})]
        steps = [r["step"] for r in present]
        raw = [r["category_loss"][name] for r in present]
        curves["category"][name] = (steps, raw, smoothed(raw, ema_weight(len(records))))
    curves["eval_category"] = {}
    for r in records:
        for name, value in (r.get("eval_category_loss") or {}).items():
            steps, values = curves["eval_category"].setdefault(name, ([], []))
            steps.append(r["step"])
            values.append(value)
    return curves


def add_token_axis(ax, steps: list[int], tokens_seen: list[int]) -> None:
    """A second x axis on top: the tokens trained by the end of each step (interpolated between steps)."""
    if len(steps) < 2:
        return
    secondary = ax.secondary_xaxis("top", functions=(lambda x: np.interp(x, steps, tokens_seen),
                                                     lambda t: np.interp(t, tokens_seen, steps)))
    secondary.set_xlabel("tokens trained")


def loss_figure(records: list[dict]):
    """Panels: loss (train, eval; the router aux loss on its own axis); per-category loss (smoothed lines over faint
    raw points); lr and grad norm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = loss_curves(records)
    cats = curves["category"]
    n = 3 if cats else 2
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(*curves["loss"], label="train loss")
    if curves["eval_loss"][0]:
        ax.plot(*curves["eval_loss"], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.legend()
    add_token_axis(ax, *curves["tokens_seen"])
    if curves["aux_loss"][0]:  # much smaller than the LM loss: its own scale
        aux_ax = ax.twinx()
        aux_ax.plot(*curves["aux_loss"], color="tab:green", linewidth=0.8)
        aux_ax.set_ylabel("router aux loss", color="tab:green")
    if cats:
        ax = axes[0][1]
        eval_cats = curves["eval_category"]
        for name, (steps, raw, smooth) in cats.items():
            (line,) = ax.plot(steps, smooth, "-", label=name)
            ax.plot(steps, raw, ".", markersize=2, alpha=0.3, color=line.get_color())
            if name in eval_cats:
                ax.plot(*eval_cats[name], "o--", color=line.get_color(), label=f"{name} (eval)")
        ax.set_xlabel("step")
        ax.set_title("per-category loss (lines smoothed, dots measured)")
        ax.legend(fontsize="small")
        add_token_axis(ax, *curves["tokens_seen"])
    ax = axes[0][n - 1]
    ax.plot(*curves["lr"], color="tab:blue", label="lr")
    ax.set_xlabel("step")
    ax.set_ylabel("lr", color="tab:blue")
    ax.set_title("learning rate and gradient norm")
    norm_ax = ax.twinx()
    norm_ax.plot(*curves["grad_norm"], color="tab:red", linewidth=0.8, label="grad norm (before clipping)")
    norm_ax.set_ylabel("grad norm", color="tab:red")
    fig.tight_layout()
    return fig


def plot_losses(output_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path | None:
    """loss.png from log.jsonl (None when there is nothing to plot), written atomically."""
    records = [r for r in read_log(output_dir) if r.get("loss") is not None]
    if not records:
        return None
    import matplotlib.pyplot as plt

    fig = loss_figure(records)
    target = Path(path) if path else Path(output_dir) / PLOT_FILE
    try:
        with atomic_writer(target) as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
    return target


# ---------------------------------------------------------------------------------------------- the run summary
# The lines a training run ends with: how long it took (start-up and steps), tokens/s, the final loss (and eval
# loss), where the checkpoint and the exported model are, and how to talk to the model (train/chat.py).
def _span(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def process_age() -> float | None:
    """Seconds since this process started (psutil), None where it cannot tell."""
    try:
        import psutil

        return time.time() - psutil.Process(os.getpid()).create_time()
    except Exception:  # psutil missing or the platform refuses: the summary leaves the start-up out
        return None


def chat_target(final: Path) -> tuple[Path | None, str]:
    """The directory `python -m train.chat` takes for an export, or None and why (a LoRA adapter alone)."""
    if (final / "adapter_config.json").is_file():
        merged = final / "merged"
        if (merged / "config.json").is_file():
            return merged, ""
        return None, "the export is a LoRA adapter: set lora_merge_on_save=true to chat with the merged model"
    return final, ""


def run_summary(records: list[dict], loop_seconds: float, checkpoint: Path | None, final: Path | None,
                total_seconds: float | None = None) -> str:
    """The summary of this process's steps (`records`, the step records of train(); a resumed run counts from
    where it resumed), whose time is the steps' own (`loop_seconds`, the step loop's, where the records lack it), `total_seconds` since the process started (start-up,
    the last checkpoint and the export included; None: not said); `final` None: the run stopped before its last
    step (no export)."""
    lines = []
    if records:
        first, last = records[0]["step"], records[-1]["step"]
        tokens = sum(r.get("tokens", 0) for r in records)
        # the steps' own time (each record's tokens / tokens_per_s), without evaluations and checkpoints
        step_seconds = sum(r["tokens"] / r["tokens_per_s"] for r in records if r.get("tokens_per_s") and r.get("tokens"))
        seconds = step_seconds or loop_seconds
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        took = f"{steps} in {_span(seconds)}"
        if total_seconds is not None:
            took += f" ({_span(total_seconds)} in all, start-up and saving included)"
        rate = f", {tokens / seconds:,.0f} tokens/s" if seconds > 0 and tokens else ""
        loss = f", final loss {last_loss:.4g}" if (last_loss := records[-1].get("loss")) is not None else ""
        evals = [r for r in records if "eval_loss" in r]
        if evals:
            loss += f", eval loss {evals[-1]['eval_loss']:.4g} (step {evals[-1]['step']})"
        lines.append(f"run summary: {took}{rate}{loss}")
    else:
        lines.append("run summary: no step ran (the run had reached its last step already)")
    if checkpoint is not None:
        lines.append(f"  checkpoint:  {checkpoint}")
    if final is not None:
        lines.append(f"  final model: {final}")
        target, why = chat_target(final)
        if target is not None:
            lines.append(f"  try it:      python -m train.chat {shlex.quote(str(target))}   (one user turn per line; "
                         "with .venv active, from the project directory)")
        else:
            lines.append(f"  try it:      {why}")
    return "\n".join(lines)
