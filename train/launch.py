"""What `sh train.sh` runs: one supervising process that holds the output directory's lock and starts
`accelerate launch` in a process group of its own, and (`python -m train.launch`) accelerate's launcher as it runs
under that supervisor.

Why: `kill <train.sh pid>`, `timeout` or a closed terminal signal that one process; accelerate's launcher died of
it (-15) while its trainer child trained on, exported `final/`, and a restart with resume=latest read the orphan's
checkpoint while it was still being written. Here SIGTERM, SIGINT and SIGHUP are forwarded to the whole group
(accelerate and its trainer processes; torchrun, which starts its workers in sessions of their own, stops them on
the same signals), and the lock is released only once no process of the run is left, so a second run into the
same output directory is refused (naming the holder) for as long as anything of the first one runs.

A signal cannot be forwarded by a supervisor that SIGKILL ended (`kill -9` to it or to train.sh's process group):
then every process of the run dies with it. The supervisor starts accelerate's launcher with the parent-death
signal SIGKILL (Linux `PR_SET_PDEATHSIG`), every trainer rank sets the same on itself (`die_with_supervisor`, so it
dies with the launcher that started it), and the processes of the run carry the supervisor in their environment
(`SUPERVISOR_ENV`) and the lock's run token (`common.lock.LOCKS_ENV`): the lock is not taken over while one of them is
alive, and the supervisor waits for all of them, torchrun's workers in their own sessions included.

accelerate's launcher ends a failed run with its own traceback (`CalledProcessError`, torchrun's `ChildFailedError`)
after the trainer's message, and exits 1 whatever the trainer's status: `run_accelerate` runs it in-process and
exits with the trainer's status instead, saying only what the trainer could not (a rank killed by a signal). With
several processes, what the processes of the run say when they stop goes to the supervisor, which says the one that
explains the stop once (train/machines/stop_report.py). With several machines, the supervisors watch each other
(train/machines/heartbeat.py): a lost machine stops the others, with one line naming it.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common.lock import directory_lock, pid_running, process_start, processes_with_env
from train.machines.heartbeat import Heartbeat
from train.machines.stop_report import REPORTS_ENV, STOP_SIGNALS, first_report, read_reports, say_stop

FORWARDED_SIGNALS = STOP_SIGNALS
STOP_GRACE_S = 30.0  # after the launcher exits, how long what is left of the run may take before SIGKILL
LOST_GRACE_S = 5.0  # after another machine was lost, how long this machine's processes may take to stop
VERDICT_WAIT_S = 3.0  # after this machine's run failed, how long the heartbeat may take to say another machine died
LOST_MACHINE_STATUS = 75  # the exit status for a lost machine (EX_TEMPFAIL: retry, here resume=latest)
SUPERVISOR_ENV = "PACKSFT_SUPERVISOR"  # "pid:start" of the supervising process, in every process of the run
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _become_subreaper() -> None:
    """Orphans of the run (a trainer whose launcher died) become our children, so we can reap them: an init that
    does not reap (containers) would otherwise leave zombies that keep the group alive (Linux only)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _supervisor_marker() -> str:
    return f"{os.getpid()}:{process_start(os.getpid()) or ''}"


def die_with_supervisor() -> None:
    """In a process started under the supervisor (SUPERVISOR_ENV set; nothing otherwise, so `python -m train`
    started by hand or under nohup is left alone): be SIGKILLed when the process that started this one dies, and end
    at once if the supervisor is already gone (it died before this process could ask)."""
    marker = os.environ.get(SUPERVISOR_ENV)
    if not marker:
        return
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    pid, start = marker.split(":", 1)
    if not pid_running(int(pid)) or (start and process_start(int(pid)) != start):
        os._exit(128 + signal.SIGKILL)


def _reap_orphans() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _group_alive(pgid: int) -> bool:
    _reap_orphans()
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for_run(pgid: int, marker: str, lost: bool = False) -> None:
    """Until no process of group `pgid` and no process started with `marker` (torchrun's workers, in sessions of
    their own) is left; SIGKILL what still runs after STOP_GRACE_S (`lost`: another machine is lost, this machine's
    run is being stopped: after LOST_GRACE_S, silently: a rank blocked in a collective with it never ends itself)."""
    grace = LOST_GRACE_S if lost else STOP_GRACE_S
    deadline = time.monotonic() + grace
    while _group_alive(pgid) or processes_with_env(SUPERVISOR_ENV, marker):
        if time.monotonic() > deadline:
            if not lost:
                print(f"[train.sh] processes of the run still alive {grace:.0f} s after the launcher exited: "
                      "killing them", flush=True)
            _kill_run(pgid, marker)
            deadline = float("inf")
        time.sleep(0.1)


def _kill_run(pgid: int, marker: str) -> None:
    """SIGKILL to group `pgid` and to every process started with `marker`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    for pid in processes_with_env(SUPERVISOR_ENV, marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass(frozen=True)
class MachineWatch:
    """This machine's place in a multi-machine run, for the heartbeat between the machines' supervisors
    (train/machines/heartbeat.py)."""

    machine: int
    machines: int
    hub_address: str  # machine 0's address (launch.main_process_ip)
    port: int  # the hub's port (heartbeat_port(launch.main_process_port))
    timeout_s: float  # launch.heartbeat_timeout_s


def supervise(command: list[str], lock_dir: str | os.PathLike | None, reports: bool = False,
              watch: MachineWatch | None = None) -> int:
    """Run `command` in a new process group, holding the lock of `lock_dir` (None: no lock) until every process
    of the run has ended; forward FORWARDED_SIGNALS to the group. `reports`: the processes of the run write why they
    stop into a report directory (train/machines/stop_report.py) and this process says the one that explains the
    stop, once. `watch`: take part in the heartbeat of the run's machines; when another machine is lost or ends with
    a failure, stop this machine's processes (SIGTERM, SIGKILL after LOST_GRACE_S) and say so in one line. Returns
    the exit code for the shell: 128 + the signal when one was forwarded, LOST_MACHINE_STATUS for a lost machine (a
    failed machine's status when one ended first), else the status of the report that explains the stop, else the
    launcher's (the trainer's)."""
    lock = directory_lock(Path(lock_dir)) if lock_dir is not None else contextlib.nullcontext()
    directory = tempfile.TemporaryDirectory(prefix="packsft-stop-") if reports else contextlib.nullcontext()
    with lock, directory as reports_dir:
        _become_subreaper()
        received: list[int] = []
        child: subprocess.Popen | None = None
        me = os.getpid()
        marker = _supervisor_marker()
        env = {**os.environ, SUPERVISOR_ENV: marker, **({REPORTS_ENV: reports_dir} if reports_dir else {})}
        decided = threading.Event()

        def die_with_me() -> None:  # in the child, before exec
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != me:  # died between the fork and the prctl
                os._exit(128 + signal.SIGKILL)

        def forward(signum, _frame) -> None:
            received.append(signum)
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
        heartbeat = None
        try:
            if watch is not None:
                heartbeat = Heartbeat(watch.machine, watch.machines, watch.hub_address, watch.port, watch.timeout_s,
                                      on_verdict=lambda _: decided.set()).start()
            child = subprocess.Popen(command, start_new_session=True, env=env, preexec_fn=die_with_me)
            if received:  # arrived before the group existed
                os.killpg(child.pid, received[0])
            code = _wait_for_launcher(child, decided, marker)
            _wait_for_run(child.pid, marker, lost=decided.is_set())
            verdict = heartbeat.verdict if heartbeat is not None else None
            if heartbeat is not None:
                if verdict is None and code != 0 and not received:  # our collectives may have failed because
                    verdict = heartbeat.wait_verdict(VERDICT_WAIT_S)  # another machine died first: its word
                status = code if code >= 0 else 128 - code
                heartbeat.finish(LOST_MACHINE_STATUS if verdict is not None and verdict.code is None else status)
                heartbeat = None
        finally:
            if heartbeat is not None:  # an exception above: the other machines learn that this one is gone
                heartbeat.finish(1)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        stop_reports = read_reports(Path(reports_dir)) if reports_dir else []
    if received:
        report = first_report(stop_reports, signalled=True)
        if report is not None:
            report.say()
        return 128 + received[0]
    report = first_report(stop_reports)
    # a lost machine explains whatever this machine's ranks said after it (a collective that failed); another
    # machine's failed end does not hide this machine's own error (the same config error raised on both)
    if verdict is not None and (verdict.code is None or report is None or report.kind not in ("error", "killed")):
        print(verdict.line(watch.machine, watch.machines), file=sys.stderr, flush=True)
        return LOST_MACHINE_STATUS if verdict.code is None else verdict.code
    if report is not None:
        return report.say()
    return code if code >= 0 else 128 - code


def _wait_for_launcher(child: subprocess.Popen, decided: threading.Event, marker: str) -> int:
    """The launcher's return code. Once `decided` is set (the heartbeat's verdict: another machine is lost or
    failed), this machine's run cannot go on: SIGTERM to its group (torchrun stops its workers), and after
    LOST_GRACE_S SIGKILL to every process of the run: a rank blocked in a collective with the lost machine never
    returns to Python to handle the SIGTERM."""
    deadline = None
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if decided.is_set() and deadline is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            deadline = time.monotonic() + LOST_GRACE_S
        elif deadline is not None and time.monotonic() > deadline:
            _kill_run(child.pid, marker)
            deadline = float("inf")


def _status(code: int, who: str) -> int:
    """The shell's exit status for a trainer process's return code; one line when a signal killed it (then it
    printed nothing itself)."""
    if code >= 0:
        return code
    return say_stop(f"[train.sh] {who} was killed by {signal.Signals(-code).name}", 128 - code, kind="killed")


def run_single_process(argv: list[str]) -> int:
    """One process on one machine: the trainer (`-m MODULE ARGS` of ARGV) started as accelerate's single-process
    launcher would, without importing accelerate and torch in this process first (seconds of start-up, and
    accelerate's notice about `--num_cpu_threads_per_process`, which says nothing to a user). The trainer is in this
    process group and receives the forwarded signals itself; this process waits for it (dying first would SIGKILL it
    through its parent-death signal, before it could say where it stopped)."""
    module = argv[argv.index("-m") + 1:]
    env = dict(os.environ)
    if "--num_cpu_threads_per_process" in argv:  # the OpenMP threads, as accelerate's launcher sets them
        env["OMP_NUM_THREADS"] = argv[argv.index("--num_cpu_threads_per_process") + 1]
    else:  # accelerate's single-process launcher on a GPU: one thread unless OMP_NUM_THREADS says otherwise
        env.setdefault("OMP_NUM_THREADS", "1")
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda *_: None)
    try:
        code = subprocess.call([sys.executable, "-m", *module], env=env)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return _status(code, "the trainer")


def run_accelerate(argv: list[str]) -> int:
    """`accelerate launch ARGV` in this process; returns the trainer's exit status (the first failed rank's under
    torchrun) instead of raising accelerate's and torchrun's tracebacks over the trainer's own message."""
    if "--multi_gpu" not in argv and "-m" in argv:
        return run_single_process(argv)
    import torch.distributed.run  # noqa: F401  (imports the elastic modules below)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # "failed (exitcode: 2) local_rank: 0 …", "Sending process … closing signal …" and "Received 15 death signal,
    # shutting down workers": the trainer, or the supervisor, says why
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    args = launch_command_parser().parse_args(argv)
    if not args.multi_gpu:
        # accelerate's single-process launcher: the trainer is in this process group and receives the forwarded
        # signal itself; this process waits for it (dying first would SIGKILL it through its parent-death signal,
        # before it could say where it stopped). torchrun's agent installs its own handlers and stops its workers.
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, lambda *_: None)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:  # the single-process launcher
        return _status(exc.returncode, "the trainer")
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        return _status(failure.exitcode, f"rank {rank} (pid {failure.pid})")
    except SignalException as exc:  # torchrun's agent was signalled and has stopped its workers
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:  # SIGINT before torchrun's agent installed its handlers
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":  # the supervisor's command (train/__main__.py): it set our parent-death signal
    sys.exit(run_accelerate(sys.argv[1:]))
