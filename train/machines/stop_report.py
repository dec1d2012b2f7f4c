"""Why a run stopped, said once for the run, whichever of its processes knows it.

With several processes, every trainer rank that stops on an error (a config error, a refused model, a checkpoint
error...) printed its own message, and torchrun stops the other ranks as soon as the first one exits: how many of the
messages came out depended on which rank got there first. Under `sh train.sh` with several processes, each process
of the run writes its message into the run's report directory instead (`REPORTS_ENV`, made by the supervisor,
train/launch.py) and prints nothing; once no process of the run is left, the supervisor prints the one report that
explains the stop and exits with its status. Which one, by kind (then the earliest):

- `error` (a trainer rank): its own error, `config error: …`, `model not supported: …`, `checkpoint error: …`;
- `killed` (accelerate's launcher): a rank killed by a signal, which could say nothing itself;
- `crash` (a trainer rank): an unexpected exception, with its traceback; under several processes mostly a collective
  that failed because another rank or machine ended first, so it is said only when nothing above explains the stop;
- `interrupt` (rank 0): where a signalled run stopped and how to resume it; first of all when `train.sh` itself was
  signalled, else last (the launcher stopped rank 0 because another rank ended, which a report above says).

Before any of them: the supervisor's own word that another machine of the run is lost or failed
(train/machines/heartbeat.py). Without a supervisor (`python -m train`, torchrun started by hand) or with one
process (no race), a report is printed at once, as before.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPORTS_ENV = "PACKSFT_STOP_REPORTS"  # the run's report directory, in every process of a multi-process run
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what asks a run to stop (train.sh forwards them)
KINDS = ("error", "killed", "crash", "interrupt")  # the order in which they explain a stop


@dataclass(frozen=True)
class StopReport:
    kind: str
    text: str  # printed as it is (several lines for an interrupt or a traceback)
    code: int  # the exit status it stands for
    stream: str = "stderr"  # where it is printed: "stderr" or "stdout"
    rank: int | None = None  # the trainer rank that wrote it (None: a launcher or supervisor)
    time_ns: int = 0

    def say(self) -> int:
        """Print it; returns its exit status."""
        stream = sys.stdout if self.stream == "stdout" else sys.stderr
        print(self.text, file=stream, flush=True)
        return self.code


def reports_directory() -> Path | None:
    return Path(os.environ[REPORTS_ENV]) if os.environ.get(REPORTS_ENV) else None


def stopping() -> None:
    """This process is stopping on its own: from now on a stop signal (torchrun stopping it because another rank
    ended, the supervisor stopping the machine) is ignored, so that it cannot cut short what the process says (a
    traceback out of the middle of a report) before it exits."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def say_stop(text: str, code: int, kind: str = "error", stream: str = "stderr") -> int:
    """A process of the run stops and says why: into the run's report directory under the supervisor of a
    multi-process run, else printed at once. Returns `code` (the exit status); the process exits next."""
    stopping()
    rank = os.environ.get("RANK")
    report = StopReport(kind, text, code, stream, int(rank) if rank is not None else None, time.time_ns())
    directory = reports_directory()
    if directory is None:
        return report.say()
    write_report(directory, report)
    return code


def write_report(directory: Path, report: StopReport) -> None:
    """One file per report, written whole (temp + rename): the supervisor reads only complete ones."""
    if report.kind not in KINDS:
        raise ValueError(f"unknown stop report kind {report.kind!r}")
    name = f"{report.kind}-{report.rank if report.rank is not None else 'launcher'}-{os.getpid()}-{report.time_ns}"
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps(asdict(report)))
    os.replace(tmp, directory / f"{name}.json")


def read_reports(directory: Path) -> list[StopReport]:
    reports = []
    for path in sorted(directory.glob("*.json")):
        try:
            reports.append(StopReport(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):  # not one of ours: nothing of the run writes another shape
            continue
    return reports


def first_report(reports: list[StopReport], signalled: bool = False) -> StopReport | None:
    """The report that explains the stop: by kind (KINDS' order; an interrupt first when `signalled`: the run was
    stopped by a signal to `train.sh`), then the earliest."""
    order = ("interrupt", *(k for k in KINDS if k != "interrupt")) if signalled else KINDS
    known = [r for r in reports if r.kind in order]
    return min(known, key=lambda r: (order.index(r.kind), r.time_ns)) if known else None
