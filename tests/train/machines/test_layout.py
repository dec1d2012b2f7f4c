"""What `sh train.sh` takes from a cluster launcher's environment, and the trainer from torchrun's (train/launch.py
`environment_overrides`); the CPU threads of each process (`choose_cpu_threads`); which stop report the supervisor
says (train/machines/stop_report.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.config import ConfigError
from tests._train_helpers import ROOT, write_config
from train.machines.layout import describe_layout, environment_overrides, load_launch_config
from train.machines.threads import CpuThreads, choose_cpu_threads, machine_cores, trainer_cpu_threads
from train.machines.stop_report import REPORTS_ENV, StopReport, first_report, read_reports, say_stop

TORCHRUN_WORKER = {"TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "4",
                   "LOCAL_WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}


@pytest.fixture
def config(tmp_path):
    """A config of 2 processes on 1 machine (the data and model are not read here)."""
    return str(write_config(tmp_path / "c.yaml", data_path=str(tmp_path / "data"), model_config="m.json",
                            output_dir=str(tmp_path / "out"), launch={"num_processes": 2}))


def test_a_cluster_launchers_variables_set_the_layout(config):
    environ = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600", "NNODES": "2", "NODE_RANK": "1"}
    cfg, found = load_launch_config(config, [], environ)
    launch = cfg.launch
    assert (launch.main_process_ip, launch.main_process_port, launch.num_machines, launch.machine_rank,
            launch.num_processes) == ("10.0.0.1", 29600, 2, 1, 4)  # the config's 2 processes on each machine
    assert [name for name, _ in found] == ["MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NNODES"]
    assert describe_layout(cfg, found) == ("launch: machine 1 of 2, 2 processes each, rank 0 at 10.0.0.1:29600 (from "
                                           "the environment: MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NNODES)")
    # NPROC_PER_NODE: the processes of each machine; a key=value argument wins over the environment
    cfg, _ = load_launch_config(config, ["launch.machine_rank=0"], {**environ, "NPROC_PER_NODE": "8"})
    assert (cfg.launch.num_processes, cfg.launch.machine_rank) == (16, 0)


def test_variables_that_do_not_describe_a_launch_are_not_read(config):
    """WORLD_SIZE and RANK outside a torchrun worker (e.g. left in a shell by an earlier run) change nothing."""
    cfg, found = load_launch_config(config, [], {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    assert found == [] and cfg.launch.num_processes == 2


def test_a_variable_that_does_not_fit_is_named(config):
    with pytest.raises(ConfigError, match=r"launch.machine_rank must be in \[0, launch.num_machines=2\), got 2 .*"
                                          r"launch values from the environment: .*NODE_RANK -> launch.machine_rank=2"):
        load_launch_config(config, [], {"MASTER_ADDR": "h", "NNODES": "2", "NODE_RANK": "2"})
    with pytest.raises(ConfigError, match=r"main_process_ip is required .*NNODES -> launch.num_machines=2"):
        load_launch_config(config, [], {"NNODES": "2"})


def test_a_torchrun_worker_takes_the_world_it_was_started_in(config):
    """`python -m train` under torchrun (started by hand on every node, or by accelerate under train.sh): the
    process group is torchrun's world, whatever the config or the arguments say."""
    cfg, found = load_launch_config(config, ["launch.num_processes=8"], TORCHRUN_WORKER)
    launch = cfg.launch
    assert (launch.num_processes, launch.num_machines, launch.machine_rank, launch.main_process_ip,
            launch.main_process_port) == (4, 2, 1, "10.0.0.1", 29600)
    assert [name for name, _ in found] == ["WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                                           "MASTER_PORT"]
    assert environment_overrides({**TORCHRUN_WORKER, "NNODES": "9"}, 1) == [
        (name, override) for name, override in found]  # a launcher's NNODES is not the worker's business


@pytest.mark.parametrize("cores, processes, threads", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 1, 3), (4, 2, 1),
                                                       (16, 8, 1), (64, 8, 7), (2, 4, 1)])
def test_cpu_threads_from_the_cores_and_the_processes(cores, processes, threads):
    chosen = choose_cpu_threads(None, processes, environ={}, cores=cores)
    assert chosen.per_process == threads
    assert chosen.describe() == (f"cpu threads: {threads} per process ({cores} core{'s' * (cores > 1)}, {processes} "
                                 f"process{'es' * (processes > 1)})")


def test_an_explicit_choice_wins():
    assert choose_cpu_threads(3, 2, environ={"OMP_NUM_THREADS": "5"}, cores=64) == CpuThreads(
        3, "launch.cpu_threads_per_process=3")
    assert choose_cpu_threads(None, 2, environ={"OMP_NUM_THREADS": "5"}, cores=64) == CpuThreads(5, "OMP_NUM_THREADS=5")
    assert choose_cpu_threads(None, 1, environ={"OMP_NUM_THREADS": ""}, cores=4).per_process == 3  # empty: not set
    # a trainer started by train.sh says the supervisor's choice; one started by torchrun alone counts its machine's
    # processes from LOCAL_WORLD_SIZE
    assert trainer_cpu_threads(None, {"PACKSFT_CPU_THREADS": "1\t2 cores, 2 processes", "OMP_NUM_THREADS": "1"}) == \
        CpuThreads(1, "2 cores, 2 processes")
    assert trainer_cpu_threads(None, {"LOCAL_WORLD_SIZE": "2"}).why.endswith(", 2 processes")
    assert 1 <= machine_cores() <= os.cpu_count()


def test_the_trainer_process_runs_the_chosen_threads():
    """The threads chosen are set before numpy and torch load (their pools read OMP_NUM_THREADS) and again once torch
    has loaded (torch caps what it reads there at the cores; an explicit choice may ask for more)."""
    code = ("import os; from train.machines.threads import apply_cpu_threads, CpuThreads; "
            "threads = CpuThreads(3, 'test'); apply_cpu_threads(threads); assert os.environ['OMP_NUM_THREADS'] == '3'; "
            "import numpy, torch; apply_cpu_threads(threads); print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "3", out.stderr


def test_the_report_that_explains_the_stop():
    def report(kind, time_ns, code=1):
        return StopReport(kind, f"{kind} {time_ns}", code, time_ns=time_ns)

    reports = [report("interrupt", 1, 143), report("crash", 2), report("error", 5, 2), report("error", 4, 2),
               report("killed", 3, 137)]
    assert first_report(reports).text == "error 4"  # a rank's own error, the earliest
    assert first_report(reports[:2]).text == "crash 2"  # rank 0 was stopped because another rank crashed
    assert first_report(reports, signalled=True).text == "interrupt 1"  # train.sh was signalled
    assert first_report([]) is None


def test_reports_go_to_the_supervisor_or_are_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(REPORTS_ENV, raising=False)
    assert say_stop("config error: x", 2) == 2
    assert capsys.readouterr().err == "config error: x\n"
    monkeypatch.setenv(REPORTS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert say_stop("model not supported: y", 2) == 2
    assert capsys.readouterr() == ("", "")
    [written] = read_reports(tmp_path)
    assert (written.kind, written.text, written.code, written.rank) == ("error", "model not supported: y", 2, 1)
    assert not list(tmp_path.glob(".*.tmp"))
