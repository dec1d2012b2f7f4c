"""The lines a training run ends with: how long it took (start-up and steps), tokens/s, the final loss (and eval
loss), where the checkpoint and the exported model are, and how to talk to the model (train/chat.py)."""
from __future__ import annotations

import os
import shlex
import time
from pathlib import Path


def _duration(seconds: float) -> str:
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
        took = f"{steps} in {_duration(seconds)}"
        if total_seconds is not None:
            took += f" ({_duration(total_seconds)} in all, start-up and saving included)"
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
