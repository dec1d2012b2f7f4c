"""Training across machines as clusters launch it, on this host: two "machines" are two launches of 1 process each,
machine ranks 0 and 1, rank 0 at 127.0.0.1. Each chain of runs equals one process on the same rows a step (losses
and gradient norms of every step within 1e-5 relative, final/ within the tolerance of tests/train/test_fsdp2.py):

    FSDP2   Slurm (scripts/slurm/train.sbatch; a simulated srun starts both nodes' `sh train.sh`), steps 1-2
            -> `sh train.sh` on each machine under a cluster launcher's MASTER_ADDR / MASTER_PORT / NNODES /
               NODE_RANK (no launch key), resume=latest: step 3 and final/
    EP 2    `torchrun --nnodes 2` on each machine (`python -m train` started by torchrun alone), steps 1-2
            -> 1 machine of 2 processes (`sh train.sh launch.num_processes=2`), resume=latest: step 3 and final/

Four 2-process launches in all. DeepSpeed ZeRO-2 with accelerate's flags (the launch keys), one machine killed, and
the run resumed on 1 machine of 1 process: tests/train/test_launch_lost_machine.py. The Slurm script's `sh train.sh`
command on each node (simulated Slurm variables, scontrol and srun; no training): here, first."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._train_helpers import ROOT, random_rows, save_tiny_model, write_config, write_packed
from tests.train.model.test_experts_parallel import _assert_equal_runs, _options, _reference, _setup, data  # noqa: F401
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

RTOL = 1e-5
STEPS = 3
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[07-08]",
         "FAKE_SLURM_HOSTS": "node07 node08"}

# srun as the Slurm script uses it: `srun --opt=value ... COMMAND...` runs --ntasks copies of COMMAND at once, task i
# with SLURM_NODEID=SLURM_PROCID=i (one task per node), and exits with the worst status; it logs its options
FAKE_SRUN = """#!{python}
import json, os, subprocess, sys
args, options = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    options[key] = value
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write(json.dumps({{"options": options, "command": args, "cwd": os.getcwd()}}) + "\\n")
tasks = [subprocess.Popen(args, env=dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0"))
         for i in range(int(options["ntasks"]))]
sys.exit(max(task.wait() for task in tasks))
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2 $3" = "show hostnames $SLURM_JOB_NODELIST" ] || exit 1
printf '%s\\n' $FAKE_SLURM_HOSTS
"""
# a project whose train.sh writes down the arguments it got, one per line, per node
FAKE_TRAIN_SH = """#!/bin/sh
printf '%s\\n' "$@" > "$FAKE_SLURM_OUT/node-$SLURM_NODEID.args"
"""


def fake_slurm(tmp: Path, scontrol: bool = True) -> dict:
    """The environment of a batch script in a 2-node job, with a simulated srun (and scontrol) on PATH."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    if scontrol:
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NNODES", "NODE_RANK"))}
    return dict(env, **SLURM, PATH=path, FAKE_SLURM_LOG=str(tmp / "srun.jsonl"), OMP_NUM_THREADS="1",
                DS_ACCELERATOR="cpu")


def free_ports() -> int:
    """A free port whose next one is free too: the rendezvous' and the machines' heartbeat."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                with socket.socket() as second:
                    second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.parametrize("case", ["gpus", "tasks, no scontrol", "the config's processes"])
def test_the_slurm_script_gives_each_node_its_train_sh(tmp_path, case):
    """`sbatch scripts/slurm/train.sbatch CONFIG ARGS` in a simulated 2-node job: one srun task per node, each
    running `sh train.sh CONFIG` with its launch keys before the user's arguments (which win)."""
    project, out = tmp_path / "project", tmp_path / "out"
    project.mkdir()
    out.mkdir()
    (project / "train.sh").write_text(FAKE_TRAIN_SH)
    env = dict(fake_slurm(tmp_path, scontrol=case != "tasks, no scontrol"), PACKSFT_ROOT=str(project),
               FAKE_SLURM_OUT=str(out))
    if case == "tasks, no scontrol" and shutil.which("scontrol", path=env["PATH"]):
        pytest.skip("a real scontrol is on PATH: the script's own reading of the node list is not reached")
    args, expected_ip, port, processes = ["my.yaml", "lr=1e-4"], "node07", 29500 + 4242 % 1000 * 2, ["16"]
    if case == "gpus":
        env.update(SLURM_GPUS_ON_NODE="8", SLURM_NTASKS_PER_NODE="1")
    elif case == "tasks, no scontrol":  # the node list read without scontrol; MASTER_PORT exported; no config file
        env.update(SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="cn[009-010,017],gpu1", MASTER_PORT="31000")
        args, expected_ip, port, processes = ["max_steps=5"], "cn009", 31000, ["4"]
    else:
        processes = []
    proc = subprocess.run(["sh", str(SBATCH), *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = [arg for arg in args[:1] if "=" not in arg]
    for node in (0, 1):
        got = (out / f"node-{node}.args").read_text().splitlines()
        assert got == [*config, f"launch.machine_rank={node}", "launch.num_machines=2",
                       f"launch.main_process_ip={expected_ip}", f"launch.main_process_port={port}",
                       *[f"launch.num_processes={n}" for n in processes], *[a for a in args if "=" in a]]
    [srun] = [json.loads(line) for line in (tmp_path / "srun.jsonl").read_text().splitlines()]
    assert srun["options"] == {"nodes": "2", "ntasks": "2", "ntasks-per-node": "1", "kill-on-bad-exit": "1"}
    assert srun["cwd"] == str(project)
    per_node = {"gpus": "8", "tasks, no scontrol": "2"}.get(case, "the config's")
    assert f"[slurm] job 4242: 2 nodes, rank 0 at {expected_ip}:{port}, {per_node} processes per node" in proc.stdout


def test_the_slurm_script_outside_a_job(tmp_path):
    env = {k: v for k, v in fake_slurm(tmp_path).items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["sh", str(SBATCH), "my.yaml"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not inside a Slurm job" in proc.stderr


# ---------------------------------------------------------------------------------------------- training
def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK",
                                                            "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return dict(env, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT),
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra)


def run_machines(commands: list[list[str]], envs: list[dict], timeout: int = 600) -> list[tuple[int, str, str]]:
    """Start every machine's command at once (they meet in the rendezvous); (status, stdout, stderr) of each."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(commands, envs)]
    try:
        results = [(proc.wait(timeout=timeout), *proc.communicate()) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for status, stdout, stderr in results:
        assert status == 0, stdout[-3000:] + stderr[-6000:]
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_same_steps(log: list[dict], ref: list[dict], what: str, steps: list[int] | None = None) -> None:
    """Every step of `log` trains the rows of the same step of `ref` (its tokens and loss tokens) to the same loss and
    gradient norm (1e-5 relative: the gradient norm is scale-sensitive, Adam is not)."""
    by_step = {r["step"]: r for r in ref}
    assert [r["step"] for r in log] == (steps or [r["step"] for r in ref]), what
    for got in log:
        want = by_step[got["step"]]
        assert (got["tokens"], got["loss_tokens"]) == (want["tokens"], want["loss_tokens"]), (what, got["step"])
        for key in ("loss", "grad_norm"):
            assert _rel(got[key], want[key]) <= RTOL, (what, got["step"], key, got[key], want[key])
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12), what


def assert_same_weights(out: Path, ref_out: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    got, want = load_file(out / "final" / "model.safetensors"), load_file(ref_out / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:  # atol as tests/train/test_fsdp2.py
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=1e-6)
    AutoModelForCausalLM.from_pretrained(out / "final")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny Qwen2 on 8 rows, 2 rows a step, clipping on; the reference: one process, no DeepSpeed or FSDP2."""
    tmp = tmp_path_factory.mktemp("machines")
    packed = write_packed(tmp / "data", random_rows(11, 8))
    model = save_tiny_model(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(packed), model_path=str(model), max_steps=STEPS, lr=1e-3,
                          warmup_steps=1, max_grad_norm=0.5, loss_chunk_size=16, plot=False, log_backends=[],
                          output_dir=str(tmp / "unused"), save_total_limit=5)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(load_config(config, [f"output_dir={tmp / 'ref'}", "grad_accum=2"]), console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)
    return tmp, config, tmp / "ref"


@pytest.fixture(scope="module")
def fsdp2_chain(dense):
    """Steps 1-2 through the Slurm script (its srun simulated: both nodes on this host), then step 3 resumed by
    `sh train.sh` on each machine under a cluster launcher's variables. (output_dir, the runs' outputs)."""
    tmp, config, _ = dense
    out, port = tmp / "fsdp2", free_ports()
    common = [str(config), f"output_dir={out}", "distributed_backend=fsdp2"]
    slurm = dict(fake_slurm(tmp / "slurm"), SLURM_JOB_NODELIST="localhost,localhost", FAKE_SLURM_HOSTS="127.0.0.1 x",
                 SLURM_NTASKS_PER_NODE="1", MASTER_PORT=str(port), PACKSFT_ROOT=str(ROOT))
    [(_, slurm_out, slurm_err)] = run_machines([["sh", str(SBATCH), *common, "stop_at_step=2"]], [slurm])
    launcher = [_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2", NODE_RANK=str(rank))
                for rank in (0, 1)]
    resumed = run_machines([["sh", "train.sh", *common, "resume=latest"]] * 2, launcher)
    return out, slurm_out + slurm_err, resumed


@pytest.mark.multiprocess
def test_fsdp2_on_two_machines_through_slurm_then_a_launchers_variables(dense, fsdp2_chain):
    _, _, ref_out = dense
    out, slurm_output, resumed = fsdp2_chain
    assert "[slurm] job 4242: 2 nodes, rank 0 at 127.0.0.1:" in slurm_output
    assert "launch: machine 0 of 2, 1 process each, rank 0 at 127.0.0.1:" in slurm_output
    assert "launch: machine 1 of 2, 1 process each" in slurm_output
    assert "cpu threads: 1 per process (OMP_NUM_THREADS=1)" in slurm_output
    machine0 = resumed[0][1]
    assert ("(from the environment: MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NNODES)" in machine0
            and f"resumed from {out / 'checkpoints' / 'step-000002'} at step 2" in machine0), machine0
    assert "world 2 (dp 2 x sp 1)" in machine0 and "FSDP2" in machine0
    assert_same_steps(read_log(out), read_log(ref_out), "FSDP2 on 2 machines vs 1 process")
    assert_same_weights(out, ref_out)


@pytest.fixture(scope="module")
def ep_chain(data):
    """EP 2 on qwen3_moe: steps 1-2 by `torchrun --nnodes 2` on each machine, step 3 resumed on 1 machine of 2
    processes by `sh train.sh`; the reference: one process, no EP. (the chain's output_dir, the reference's and its
    log, the resumed run's output)."""
    tmp, config = _setup(data, "qwen3_moe")
    out, port = tmp / "ep_machines", free_ports()
    options = [f"output_dir={out}", *_options("qwen3_moe"), "expert_parallel_size=2", "moe_kernel=auto"]
    torchrun = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
                 "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "train",
                 str(config), *options, "stop_at_step=2"] for rank in (0, 1)]
    run_machines(torchrun, [_env()] * 2)
    [(_, resumed, _)] = run_machines([["sh", "train.sh", str(config), *options, "launch.num_processes=2",
                                       f"launch.main_process_port={port}", "resume=latest"]], [_env()])
    ref_out = tmp / "qwen3_moe_machines_ref"
    return out, ref_out, _reference(config, ref_out, "qwen3_moe"), resumed


@pytest.mark.multiprocess
def test_ep2_on_two_machines_by_torchrun_then_one_machine(ep_chain):
    out, ref_out, ref_log, resumed = ep_chain
    assert f"resumed from {out / 'checkpoints' / 'step-000002'} at step 2" in resumed
    assert "expert parallel 2: 4 of 8 experts per rank" in resumed
    _assert_equal_runs("qwen3_moe", out, ref_out, ref_log)
