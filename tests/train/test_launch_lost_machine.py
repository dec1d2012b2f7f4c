"""A lost machine stops the others within a bound, with one line naming it, and the run resumes from its last
checkpoint, also on fewer machines, at the exact data position.

- The supervisors alone (train/launch.py `supervise` with a heartbeat, a dummy "launcher"): machine 1's supervisor
  frozen (SIGSTOP: its connection stays open, nothing comes): machine 0 stops its launcher, which ignores SIGTERM as
  a rank blocked in a collective with the lost machine does, within the heartbeat timeout plus LOST_GRACE_S
  (SIGKILL); one line; exit status 75. A machine that ends on its own error stops the other, which says so unless
  it raised an error of its own.
- The whole stack: DeepSpeed ZeRO-2 on 2 machines of 1 process (accelerate's flags through the launch keys), a
  checkpoint every step; machine 1's `sh train.sh` process group killed (kill -9) mid-run; machine 0 ends with the
  line; resume=latest on 1 machine of 1 process: every step equals one uninterrupted process on the same rows.

`serial`: they time what they run and send signals."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests._train_helpers import ROOT, random_rows, save_tiny_model, write_config, write_packed
from tests.train.test_launch_machines import _env, assert_same_steps, free_ports
from train.config.sections import load_config
from train.launch import LOST_GRACE_S, LOST_MACHINE_STATUS
from train.metrics import read_log
from train.trainer import Trainer

pytestmark = pytest.mark.serial

TIMEOUT_S = 3.0  # the heartbeat timeout of the supervisor tests

# a "launcher" stuck as a rank in a collective with a lost machine is: it ignores SIGTERM
STUCK = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('started', flush=True); "
         "time.sleep(600)")
# a "launcher" that stops when signalled
SLEEPS = "import time; print('started', flush=True); time.sleep(600)"
# a "launcher" whose rank stops on its own error after a second (a config error raised on every machine)
FAILS = ("import sys, time; from train.machines.stop_report import say_stop; print('started', flush=True); "
         "time.sleep(1); sys.exit(say_stop('config error: lr must be > 0, got 0', 2))")
SUPERVISOR = """
import sys
from train.launch import MachineWatch, supervise
machine, port, timeout, launcher = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
sys.exit(supervise([sys.executable, "-c", launcher], None, reports=True,
                   watch=MachineWatch(machine, 2, "127.0.0.1", port, timeout)))
"""


def _supervisor(machine: int, port: int, launcher: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(machine), str(port), str(TIMEOUT_S), launcher],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "started"  # its launcher runs
    return proc


def _launcher_of(supervisor: subprocess.Popen) -> list[int]:
    """The processes the supervisor started (its children)."""
    children = f"/proc/{supervisor.pid}/task/{supervisor.pid}/children"
    return [int(pid) for pid in open(children).read().split()] if os.path.exists(children) else []


def test_supervisors_stop_when_another_machine_freezes():
    """Machine 1's supervisor frozen (SIGSTOP): its connection stays open and nothing comes; machine 0 stops its
    launcher, which ignores SIGTERM as a rank blocked in a collective with machine 1 does, within the heartbeat
    timeout plus LOST_GRACE_S (SIGKILL). A killed machine (its connection closed: at once) is the whole-stack test
    below."""
    port = free_ports()
    machine0 = _supervisor(0, port, STUCK)
    machine1 = _supervisor(1, port, SLEEPS)
    stuck0 = _launcher_of(machine0)
    try:
        time.sleep(TIMEOUT_S + 1)  # connected and beating: nothing happens
        assert machine0.poll() is None and machine1.poll() is None
        frozen_at = time.monotonic()
        os.kill(machine1.pid, signal.SIGSTOP)
        status = machine0.wait(timeout=120)
        took = time.monotonic() - frozen_at
        stderr = machine0.stderr.read()
    finally:
        for proc in (machine0, machine1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert status == LOST_MACHINE_STATUS
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("[train.sh] lost machine 1 of 2 ("), stderr
    assert ("): no heartbeat for 3 s (frozen, powered off or cut off); stopped the processes of machine 0. "
            "resume=latest continues from the last") in lines[0]
    # the bound: the timeout (counted from the last line heard, up to a second before the freeze), LOST_GRACE_S for
    # the processes to stop before SIGKILL, and reaping; 10 s of slack for a loaded machine
    assert TIMEOUT_S - 1 <= took <= TIMEOUT_S + LOST_GRACE_S + 10, took
    assert all(not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split(")")[1][:3]
               for pid in stuck0), "machine 0's launcher outlived it"


@pytest.mark.parametrize("both", [True, False], ids=["both fail", "machine 1 fails"])
def test_a_machine_that_fails_stops_the_others_without_hiding_their_own_error(both):
    """Machine 1's rank stops on its own error: machine 0 stops too, saying so in one line with machine 1's status,
    unless its own rank raised an error of its own (the same config error, raised on every machine): then it says
    that one."""
    port = free_ports()
    machine0 = _supervisor(0, port, FAILS if both else SLEEPS)
    machine1 = _supervisor(1, port, FAILS)
    try:
        results = [(proc.wait(timeout=120), proc.stderr.read()) for proc in (machine0, machine1)]
    finally:
        for proc in (machine0, machine1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert results[1] == (2, "config error: lr must be > 0, got 0\n")
    if both:
        assert results[0] == (2, "config error: lr must be > 0, got 0\n")
    else:
        status, stderr = results[0]
        assert status == 2 and stderr.startswith("[train.sh] machine 1 of 2 (") and stderr.endswith(
            ") ended with exit status 2 (its own output says why); stopped the processes of machine 0\n"), stderr


# ---------------------------------------------------------------------------------------------- the whole stack
def test_zero2_machine_killed_mid_run_then_resumed_on_one_machine(tmp_path):
    data = write_packed(tmp_path / "data", random_rows(11, 8))
    model = save_tiny_model(tmp_path / "model")
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model), max_steps=100000,
                          lr=1e-3, warmup_steps=1, max_grad_norm=0.5, loss_chunk_size=16, plot=False, log_backends=[],
                          output_dir=str(tmp_path / "unused"), save_steps=1, save_total_limit=3)
    out, port = tmp_path / "zero2", free_ports()
    common = ["sh", "train.sh", str(config), f"output_dir={out}", "deepspeed.stage=2",
              "deepspeed.template=configs/deepspeed/zero2.json"]
    logs = [(tmp_path / f"machine{rank}.out", tmp_path / f"machine{rank}.err") for rank in (0, 1)]
    machines = [subprocess.Popen([*common, "launch.num_processes=2", "launch.num_machines=2",
                                  "launch.main_process_ip=127.0.0.1", f"launch.main_process_port={port}",
                                  f"launch.machine_rank={rank}", "launch.heartbeat_timeout_s=30"],
                                 cwd=ROOT, env=_env(), stdout=logs[rank][0].open("w"), stderr=logs[rank][1].open("w"),
                                 start_new_session=True) for rank in (0, 1)]
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 600
        while not (latest.is_file() and int(latest.read_text().rsplit("-", 1)[1]) >= 2):
            assert all(m.poll() is None for m in machines), [p.read_text()[-3000:] for log in logs for p in log]
            assert time.monotonic() < deadline, "no checkpoint of step 2 in 600 s"
            time.sleep(0.2)
        said_before = [path.stat().st_size for path in logs[0]]
        killed_at = time.monotonic()
        os.killpg(machines[1].pid, signal.SIGKILL)  # machine 1's train.sh and its process group
        status = machines[0].wait(timeout=300)
        took = time.monotonic() - killed_at
    finally:
        for machine in machines:
            if machine.poll() is None:
                os.killpg(machine.pid, signal.SIGKILL)
                machine.wait()
    stdout, stderr = (path.read_text() for path in logs[0])
    assert status == LOST_MACHINE_STATUS, stdout[-3000:] + stderr[-3000:]
    # what machine 0 said once machine 1 was killed: one line naming it, nothing else (no traceback of a collective)
    after = [line for path, size in zip(logs[0], said_before) for line in path.read_text()[size:].splitlines()]
    after = [line for line in after if line.strip() and not line.startswith("step=")]  # a last step's record
    assert len(after) == 1 and after[0].startswith("[train.sh] lost machine 1 of 2 ("), "\n".join(after)[-5000:]
    assert after[0].endswith("): its heartbeat connection closed without a word (its processes died); stopped the "
                             "processes of machine 0. resume=latest continues from the last complete checkpoint, on "
                             "these machines or on others")
    assert took <= LOST_GRACE_S + 30, took  # closed connection: at once, then the grace to stop (loaded machine)
    print(f"machine 0 ended {took:.1f} s after machine 1 was killed")

    # resumed on 1 machine of 1 process, one step past its last checkpoint
    last = int((out / "checkpoints" / "latest").read_text().rsplit("-", 1)[1])
    resumed = subprocess.run([*common, "grad_accum=2", "resume=latest", f"stop_at_step={last + 1}"], cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step-{last:06d}'} at step {last}" in resumed.stdout
    assert "optimizer state resharded 2 → 1 ZeRO partitions" in resumed.stdout
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the uninterrupted run: one process, no DeepSpeed, the same 2 rows a step
        Trainer(load_config(config, [f"output_dir={tmp_path / 'ref'}", "grad_accum=2", f"stop_at_step={last + 1}"]),
                console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)
    assert_same_steps(read_log(out), read_log(tmp_path / "ref"), "ZeRO-2: 2 machines, killed, resumed on 1",
                      steps=list(range(1, last + 2)))
