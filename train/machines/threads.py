"""The intra-op CPU threads of each trainer process, chosen from the machine's cores and its processes, and set
before numpy's and torch's thread pools start."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

THREADS_ENV = "PACKSFT_CPU_THREADS"  # the supervisor's choice, "N\tWHY", in every trainer process it starts


@dataclass(frozen=True)
class CpuThreads:
    """The intra-op threads of each trainer process (torch.set_num_threads, OMP_NUM_THREADS), and why."""

    per_process: int
    why: str  # "2 cores, 2 processes", "OMP_NUM_THREADS=4", "launch.cpu_threads_per_process=3"

    def describe(self) -> str:
        return f"cpu threads: {self.per_process} per process ({self.why})"


def machine_cores() -> int:
    """The physical cores this process may run on: its CPU affinity (taskset, cpusets), capped by a cgroup CPU quota
    (a container's `--cpus`), hyper-threads counted once (they add little to the math kernels)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    import psutil

    logical, physical = psutil.cpu_count() or 1, psutil.cpu_count(logical=False) or 1
    return max(1, cpus * physical // max(logical, physical))


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max, v1 cfs quota), None when unlimited or unknown."""
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            text = Path(quota_file).read_text().split()
            quota, period = text[0], (text[1] if period_file is None else Path(period_file).read_text().strip())
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return int(quota) / int(period)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def choose_cpu_threads(configured: int | None, processes: int, environ=None, cores: int | None = None) -> CpuThreads:
    """The threads of each of the `processes` trainer processes of this machine: `launch.cpu_threads_per_process`
    when set, else an explicit OMP_NUM_THREADS, else the machine's cores shared among its processes, one core left
    for the rest of the run (each process's micro-batch thread, the collectives' threads, the launcher) when there
    are more cores than processes: a thread that finds no free core holds up every parallel operation of its process
    (on 2 shared cores, 2 threads for 1 process trained 4-10x slower than 1 under other load: BENCHMARKS.md)."""
    environ = os.environ if environ is None else environ
    if configured is not None:
        return CpuThreads(configured, f"launch.cpu_threads_per_process={configured}")
    if environ.get("OMP_NUM_THREADS", "").strip().isdigit() and int(environ["OMP_NUM_THREADS"]) > 0:
        return CpuThreads(int(environ["OMP_NUM_THREADS"]), f"OMP_NUM_THREADS={int(environ['OMP_NUM_THREADS'])}")
    cores = machine_cores() if cores is None else cores
    usable = cores - 1 if cores > processes else cores
    return CpuThreads(max(1, usable // processes),
                      f"{cores} core{'s' * (cores != 1)}, {processes} process{'es' * (processes != 1)}")


def trainer_cpu_threads(configured: int | None, environ=None) -> CpuThreads:
    """In a trainer process: the supervisor's choice (THREADS_ENV) when it started this one, else chosen here for
    the processes of this machine (the launcher's LOCAL_WORLD_SIZE; one without a launcher)."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(THREADS_ENV, "")
    if "\t" in chosen and chosen.split("\t", 1)[0].isdigit():
        count, why = chosen.split("\t", 1)
        return CpuThreads(int(count), why)
    return choose_cpu_threads(configured, int(environ.get("LOCAL_WORLD_SIZE", "0") or 0) or 1, environ)


def apply_cpu_threads(threads: CpuThreads) -> None:
    """Set the threads in this process: OMP_NUM_THREADS for what loads later (numpy's and torch's
    OpenMP pools read it when they start), and torch.set_num_threads when torch is loaded already."""
    os.environ["OMP_NUM_THREADS"] = str(threads.per_process)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads.per_process)
