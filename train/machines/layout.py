"""The layout of a run (its machines, their processes, rank 0's address) as a cluster's launcher gives it: the
variables `sh train.sh` reads over the config's launch keys, and the world a torchrun worker was started in."""
from __future__ import annotations

import os

# What `sh train.sh` reads from its environment when a cluster's launcher exported it (the names torchrun's options
# take, as Slurm scripts, Kubeflow's PyTorchJob and LLaMA-Factory's launcher export them): over the config file,
# under a key=value argument. NPROC_PER_NODE sets the processes of each machine (launch.num_processes =
# NNODES x NPROC_PER_NODE); with NNODES alone, each machine runs the config's processes per machine. WORLD_SIZE and
# RANK are not read here: they describe the processes of a world already started (a stale one, left in a shell,
# would change the layout unseen).
LAUNCHER_VARIABLES = (("MASTER_ADDR", "main_process_ip"), ("MASTER_PORT", "main_process_port"),
                      ("NNODES", "num_machines"), ("NODE_RANK", "machine_rank"))
PROCESSES_VARIABLE = "NPROC_PER_NODE"
# In a trainer process that torchrun started (accelerate's launcher under train.sh, or torchrun by hand on every
# machine): the world it started, over everything (the process group is that world, whatever the config says).
WORKER_VARIABLES = (("WORLD_SIZE", "num_processes"), ("GROUP_WORLD_SIZE", "num_machines"),
                    ("GROUP_RANK", "machine_rank"), ("MASTER_ADDR", "main_process_ip"),
                    ("MASTER_PORT", "main_process_port"))


def is_torchrun_worker(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in environ and "GROUP_RANK" in environ


def environment_overrides(environ, per_machine: int) -> list[tuple[str, str]]:
    """(variable, `launch.KEY=value` override) for the layout variables set in `environ`: torchrun's world in one of
    its workers, else a cluster launcher's (LAUNCHER_VARIABLES; `per_machine`: the config's processes per machine,
    kept when NNODES alone changes the machines)."""
    if is_torchrun_worker(environ):
        return [(name, f"launch.{key}={environ[name]}") for name, key in WORKER_VARIABLES if environ.get(name)]
    found = [(name, f"launch.{key}={environ[name].strip()}") for name, key in LAUNCHER_VARIABLES
             if environ.get(name, "").strip()]
    machines = environ.get("NNODES", "").strip()
    processes = environ.get(PROCESSES_VARIABLE, "").strip()
    if processes:
        total = int(processes) * int(machines) if processes.isdigit() and machines.isdigit() else processes
        found.append((PROCESSES_VARIABLE + (" x NNODES" if machines else ""), f"launch.num_processes={total}"))
    elif machines.isdigit():
        found.append(("NNODES", f"launch.num_processes={per_machine * int(machines)}"))
    return found


def load_launch_config(config_path: str, overrides: list[str], environ=None):
    """The config of `sh train.sh` or of a trainer process, with the layout variables of `environ` applied
    (environment_overrides): a cluster launcher's under the key=value arguments, torchrun's world over them. Returns
    (config, the variables applied). A value that does not fit names its variable."""
    from common.config import ConfigError
    from train.config.sections import load_config

    environ = os.environ if environ is None else environ
    cfg = load_config(config_path, overrides)
    found = environment_overrides(environ, cfg.launch.processes_per_machine)
    if not found:
        return cfg, []
    applied = [override for _, override in found]
    try:
        if is_torchrun_worker(environ):
            return load_config(config_path, [*overrides, *applied]), found
        cfg = load_config(config_path, [*applied, *overrides])
        cfg.validate(cfg.launch.num_processes)  # the launch keys' rules, before the trainer's preflight
        return cfg, found
    except ConfigError as exc:
        if "launch" not in str(exc):
            raise
        raise ConfigError(f"{exc} (launch values from the environment: "
                          f"{', '.join(f'{name} -> {override}' for name, override in found)})") from None


def describe_layout(cfg, found: list[tuple[str, str]]) -> str:
    """One line for `sh train.sh` with several machines or layout variables: this machine's place in the run."""
    launch = cfg.launch
    text = (f"launch: machine {launch.machine_rank} of {launch.num_machines}, {launch.processes_per_machine} "
            f"process{'es' * (launch.processes_per_machine != 1)} each, rank 0 at "
            f"{launch.main_process_ip or '127.0.0.1'}:{launch.main_process_port}")
    if found:
        text += f" (from the environment: {', '.join(name for name, _ in found)})"
    return text
