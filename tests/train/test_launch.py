"""`sh train.sh` as jobs are stopped: a signal to it reaches every process of the run, and the output directory is
locked for as long as any of them runs (train/launch.py's supervisor); a single-process launch starts the trainer as
accelerate would."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.lock import LOCK_NAME
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


def _train_sh(data: Path, out: Path, *overrides: str) -> list[str]:
    return ["sh", "train.sh", "configs/train/example.yaml", f"data_path={data}", f"output_dir={out}",
            "max_steps=100000", "save_steps=0", "plot=false", "log_backends=[]", *overrides]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def _start_training(data: Path, out: Path, *overrides: str, steps: int = 1, session: bool = False) -> subprocess.Popen:
    """`sh train.sh` in the background (in a session of its own: `session`), returned once it has logged `steps`
    steps."""
    proc = subprocess.Popen(_train_sh(data, out, *overrides), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=session)
    deadline = time.monotonic() + 300
    while not ((out / "log.jsonl").is_file() and len((out / "log.jsonl").read_text().splitlines()) >= steps):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"{steps} steps not logged in 300 s"
        time.sleep(0.5)
    return proc


def _wait_until_gone(out: Path, timeout: float = 60) -> list[int]:
    """The processes of the run still alive after waiting up to `timeout` s for them to end."""
    deadline = time.monotonic() + timeout
    while (left := _processes_of(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture
def run_dir(tmp_path):
    out = tmp_path / "run"
    yield tmp_path, out
    for pid in _processes_of(out):  # whatever a failed assertion left running
        os.kill(pid, signal.SIGKILL)


@pytest.mark.serial  # scripts/test.sh runs it alone (see pytest.ini)
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

    # `kill <train.sh pid>`: nothing of the run trains on, nothing is exported, the lock is released; the run says
    # where it stopped and how to resume, without a traceback
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 128 + signal.SIGTERM
    output = first.stdout.read()
    assert "Traceback" not in output, output[-3000:]
    stopped = [line for line in output.splitlines() if line.startswith("stopped at step ")]
    assert len(stopped) == 1 and stopped[0].endswith("of 100000 (SIGTERM); last checkpoint: none yet (resume=latest "
                                                     "starts at step 0)"), output[-3000:]
    assert (f"resume with: sh train.sh configs/train/example.yaml data_path={data} output_dir={out} max_steps=100000 "
            "save_steps=0 plot=false 'log_backends=[]' resume=latest") in output
    assert _processes_of(out) == []
    steps = len((out / "log.jsonl").read_text().splitlines())
    time.sleep(2)
    assert len((out / "log.jsonl").read_text().splitlines()) == steps
    assert not (out / "final").exists() and not (out / LOCK_NAME).exists()

    # a lock whose holder is gone (a killed supervisor) is taken over, and said so
    (out / "log.jsonl").unlink()
    (out / LOCK_NAME).write_text(json.dumps({"pid": first.pid, "host": socket.gethostname(), "start": "gone",
                                             "started": "2026-01-01T00:00:00+00:00", "command": "train.sh"}))
    again = _start_training(data, out, "save_steps=1", steps=2)
    again.send_signal(signal.SIGINT)  # Ctrl-C
    assert again.wait(timeout=60) == 128 + signal.SIGINT
    output = again.stdout.read()
    assert f"[lock] took over {out / LOCK_NAME} from a run that is gone (pid {first.pid}" in output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    step, latest = re.search(r"^stopped at step (\d+) of 100000 \(SIGINT\); last checkpoint: (\S+)$", output,
                             re.MULTILINE).groups()
    assert Path(latest) == out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert 1 <= int(latest.rsplit("-", 1)[1]) <= int(step)
    assert "save_steps=1 resume=latest" in output
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


@pytest.mark.serial  # scripts/test.sh runs it alone (see pytest.ini)
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


@pytest.mark.serial  # scripts/test.sh runs it alone (see pytest.ini)
@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["pid", "process group"])
def test_kill_9_to_train_sh_leaves_no_process_of_the_run(run_dir, target):
    """SIGKILL cannot be forwarded: the trainer dies with its supervisor (parent-death signals), also in the middle
    of a save (a checkpoint every step), and the next run resumes from a complete checkpoint."""
    tmp_path, out = run_dir
    data = write_packed(tmp_path / "data", random_rows(0, 8, seqs_per_row=2))
    first = _start_training(data, out, "save_steps=1", steps=2, session=True)
    if target == "pid":
        os.kill(first.pid, signal.SIGKILL)
    else:
        os.killpg(first.pid, signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL
    assert _wait_until_gone(out) == [], "processes of the run outlived train.sh"
    steps = len((out / "log.jsonl").read_text().splitlines())
    time.sleep(2)
    assert len((out / "log.jsonl").read_text().splitlines()) == steps  # nothing trains on
    if target == "pid":
        return
    latest = int((out / "checkpoints" / "latest").read_text().rsplit("-", 1)[1])
    again = subprocess.run(_train_sh(data, out, "save_steps=1", "resume=latest", f"stop_at_step={latest + 1}"),
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"[lock] took over {out / LOCK_NAME} from a run that is gone (pid {first.pid}" in again.stdout
    assert f"resumed from {out / 'checkpoints' / f'step-{latest:06d}'} at step {latest}" in again.stdout
    assert not list((out / "checkpoints").glob(".step-*"))


_HOLDER = """
import subprocess, sys, time
from common.lock import directory_lock
with directory_lock(sys.argv[1]):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
    time.sleep(120)
"""


@pytest.mark.serial  # scripts/test.sh runs it alone (see pytest.ini)
def test_a_lock_is_kept_while_a_process_its_holder_started_runs(tmp_path, capsys):
    """The holder killed, a process it started (a trainer rank) still running: the lock is not taken over."""
    from common.lock import LockHeldError, directory_lock

    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    child = int(holder.stdout.readline())
    try:
        holder.kill()
        holder.wait(timeout=30)
        with pytest.raises(LockHeldError, match=rf"its holder is gone \(pid {holder.pid} .*\) but process\(es\) it "
                                                rf"started still run \({child}\)"):
            with directory_lock(tmp_path):
                pass
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:  # reaped by init
        time.sleep(0.1)
    with directory_lock(tmp_path):
        pass
    assert f"[lock] took over {tmp_path / LOCK_NAME} from a run that is gone (pid {holder.pid}" in capsys.readouterr().out


@pytest.mark.serial  # scripts/test.sh runs it alone (see pytest.ini)
@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_train_sh_exits_with_the_trainers_status_and_only_its_message(tmp_path, processes):
    """A refusal raised in the trainer (here a model family): exit code 2 and the trainer's message once for the run,
    whichever rank raised it first (with 2 processes both raise it; torchrun stops the other as soon as one exits, so
    that the message printed by each rank came out once or twice: train/machines/stop_report.py), without accelerate's
    CalledProcessError or torchrun's ChildFailedError traceback after it, nor a rank's "stopped at step" report (it
    was not signalled by the user)."""
    from transformers import BloomConfig

    model = tmp_path / "bloom"
    BloomConfig(vocab_size=128, hidden_size=32, n_layer=1, n_head=2).save_pretrained(model)
    data = write_packed(tmp_path / "data", random_rows(0, 4, seqs_per_row=2))
    proc = subprocess.run(["sh", "train.sh", "configs/train/example.yaml", f"data_path={data}",
                           f"output_dir={tmp_path / 'run'}", f"model_config={model / 'config.json'}",
                           "tokenizer_path=null", f"launch.num_processes={processes}",
                           f"launch.main_process_port={_free_port()}", "log_backends=[]"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    messages = [line for line in proc.stderr.splitlines() if line.startswith("model not supported: ")]
    assert len(messages) == 1 and "model family 'bloom' cannot be trained on packed rows" in messages[0], proc.stderr
    for noise in ("Traceback", "CalledProcessError", "ChildFailedError", "exitcode", "stopped "):
        assert noise not in proc.stderr + proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]



def test_a_single_process_launch_starts_the_trainer_as_accelerate_would(tmp_path, monkeypatch, capfd):
    """One process on one machine: the trainer module started directly (no accelerate launcher process), with
    accelerate's OpenMP setting (the threads train/__main__.py chose on CPU; one on a GPU unless set), and its exit
    status."""
    import signal

    from train.launch import FORWARDED_SIGNALS, run_single_process

    (tmp_path / "probe_env.py").write_text("import os, sys\nprint(os.environ.get('OMP_NUM_THREADS'), *sys.argv[1:])\n"
                                           "sys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
    try:
        assert run_single_process(["--num_processes", "1", "--cpu", "--num_cpu_threads_per_process", "2", "-m",
                                   "probe_env", "a.yaml", "k=v"]) == 3
        assert run_single_process(["--num_processes", "1", "-m", "probe_env", "a.yaml"]) == 3
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert capfd.readouterr().out.splitlines() == ["2 a.yaml k=v", "1 a.yaml"]
