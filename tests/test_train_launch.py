"""`sh train.sh` as jobs are stopped: a signal to it reaches every process of the run, and the output directory is
locked for as long as any of them runs."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.lock import LOCK_NAME
from tests._train_helpers import ROOT, random_rows, write_packed


def _processes_of(out: Path) -> list[int]:
    """Live (not zombie) processes whose command line names `out`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(out) in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


def _train_sh(data: Path, out: Path) -> list[str]:
    return ["sh", "train.sh", "configs/train/example.yaml", f"data_path={data}", f"output_dir={out}",
            "max_steps=100000", "save_steps=0", "plot=false", "log_backends=[]"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def _start_training(data: Path, out: Path) -> subprocess.Popen:
    """`sh train.sh` in the background, returned once it has logged a step."""
    proc = subprocess.Popen(_train_sh(data, out), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not ((out / "log.jsonl").is_file() and (out / "log.jsonl").read_text().strip()):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no step logged in 300 s"
        time.sleep(0.5)
    return proc


@pytest.fixture
def run_dir(tmp_path):
    out = tmp_path / "run"
    yield tmp_path, out
    for pid in _processes_of(out):  # whatever a failed assertion left running
        os.kill(pid, signal.SIGKILL)


@pytest.mark.multiprocess
def test_sigterm_to_train_sh_stops_the_whole_run_and_the_lock_refuses_a_second_run(run_dir):
    tmp_path, out = run_dir
    data = write_packed(tmp_path / "data", random_rows(0, 8, seqs_per_row=2))
    first = _start_training(data, out)
    assert len(_processes_of(out)) >= 2  # train.sh (now the supervisor), accelerate, the trainer

    # a second run into the same output directory is refused, naming the holder
    second = subprocess.run([*_train_sh(data, out), "resume=latest"], cwd=ROOT, env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"{out} is in use by another run (pid {first.pid} on {socket.gethostname()}, started " in second.stderr

    # `kill <train.sh pid>`: nothing of the run trains on, nothing is exported, the lock is released
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 128 + signal.SIGTERM
    assert _processes_of(out) == []
    steps = len((out / "log.jsonl").read_text().splitlines())
    time.sleep(2)
    assert len((out / "log.jsonl").read_text().splitlines()) == steps
    assert not (out / "final").exists() and not (out / LOCK_NAME).exists()

    # a lock whose holder is gone (a killed supervisor) is taken over, and said so
    (out / "log.jsonl").unlink()
    (out / LOCK_NAME).write_text(json.dumps({"pid": first.pid, "host": socket.gethostname(), "start": "gone",
                                             "started": "2026-01-01T00:00:00+00:00", "command": "train.sh"}))
    again = _start_training(data, out)
    again.send_signal(signal.SIGINT)  # Ctrl-C
    assert again.wait(timeout=60) == 128 + signal.SIGINT
    assert f"[lock] took over {out / LOCK_NAME} from a run that is gone (pid {first.pid}" in again.stdout.read()
    assert _processes_of(out) == [] and not (out / "final").exists()


# each rank writes its report to its own file: two ranks' buffered stdout can interleave mid-line at exit
_REPORT_THREADS = """
import json, os, sys
from train.__main__ import main
code = main(sys.argv[1:])
threads = []
for task in os.listdir("/proc/self/task"):
    try:
        threads.append(open(f"/proc/self/task/{task}/comm").read().strip())
    except FileNotFoundError:  # a thread that ended meanwhile
        pass
report = {"rank": os.environ["RANK"], "code": code, "gloo": [t for t in threads if "gloo" in t]}
with open(os.path.join(os.environ["THREAD_REPORTS"], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump(report, f)
"""


@pytest.mark.multiprocess
def test_gloo_threads_are_joined_before_the_interpreter_shuts_down(tmp_path):
    """The cause of a rare SIGABRT at exit ("terminate called without an active exception") of the rank that exits
    first: destroy_process_group() left gloo's process groups, and their worker threads, alive as long as the
    trainer referenced them, so they were torn down during interpreter finalization while a worker could still
    release a last collective's Python tensors. When `python -m train` returns, no gloo thread is left."""
    script = tmp_path / "report_threads.py"
    script.write_text(_REPORT_THREADS)
    data = write_packed(tmp_path / "data", random_rows(0, 4, seqs_per_row=2))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
         str(script), "configs/train/example_sp.yaml", f"data_path={data}", f"output_dir={tmp_path / 'run'}",
         "max_steps=2", "stop_at_step=1", "log_backends=[]"],  # a checkpoint (object collectives), then exit
        cwd=ROOT, env=dict(_env(), PYTHONPATH=str(ROOT), THREAD_REPORTS=str(tmp_path)), capture_output=True,
        text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == ["0", "1"]
    assert [(r["code"], r["gloo"]) for r in reports] == [(0, []), (0, [])]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
