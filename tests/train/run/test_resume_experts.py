"""Resume on another expert_parallel_size and another number of processes (distributed_backend: fsdp2; DCP holds
every expert parameter whole, each rank reading its part): a chain of runs of one tiny qwen3_moe (8 experts top-2,
router aux loss, clipping on), 4 rows a step, equals one uninterrupted process without expert parallelism (losses,
router aux losses, gradient norms, the rows of every step, final/ within 1e-5 relative):

    1 process, EP 1, step 1  ->  2 processes, EP 2, steps 2-4  ->  4 processes, EP 4, steps 3-4
                                                     |                       |
                                          1 process, steps 3-4     1 process, step 4

i.e. 1 -> 2, 2 -> 4 (EP 4 on 4 processes equals EP 1: two steps and the final weights), 2 -> 1 and 4 -> 1. Two
multi-process launches in all. The plain engine's 2 -> 1 is tests/train/model/test_experts_parallel.py's. Also: what
cannot be regrouped is refused by name, and the resume line's words."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests._reshard_worker import record_rows
from tests._train_helpers import ROOT, free_port, one_thread  # noqa: F401 (a fixture)
from tests.train.model.test_experts_parallel import _assert_equal_runs, _options, _setup, data  # noqa: F401 (a fixture)
from tests.train.run.test_resume_reshard import _rows_by_step
from train.checkpoint import checkpoint_root, load_trainer_state
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

STEPS = 4  # 4 rows a step over 6 rows: steps 2 and 4 cross an epoch
FSDP2 = ["distributed_backend=fsdp2", "save_steps=1", "save_total_limit=5", f"max_steps={STEPS}"]
SPLITS = {1: ["grad_accum=4"], 2: ["grad_accum=2"], 4: ["grad_accum=1"]}  # processes -> the split of 4 rows


def _in_process(config, out, *overrides) -> tuple[list[str], dict[int, list[int]]]:
    """A 1-process run on one torch thread: (console lines, rows by step)."""
    rows, lines = out.parent / f"{out.name}_rows", []
    rows.mkdir(parents=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Trainer(load_config(config, [f"output_dir={out}", *_options("qwen3_moe"), f"max_steps={STEPS}",
                                               *SPLITS[1], *overrides]), console=lines.append)
        record_rows(trainer, rows)
        trainer.train()
    finally:
        torch.set_num_threads(before)
    return [str(line) for line in lines], _rows_by_step(rows)


def _processes(n, config, out, *overrides) -> tuple[str, dict[int, list[int]]]:
    """`n` processes (gloo) through the trainer's start-up: (rank 0's console, rows by step over the ranks)."""
    rows = out.parent / f"{out.name}_rows"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_reshard_worker.py"), str(config), str(rows), f"output_dir={out}",
           f"launch.num_processes={n}", *_options("qwen3_moe"), *FSDP2, *SPLITS[n], "moe_kernel=auto", *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return (rows / "console.txt").read_text(), _rows_by_step(rows)


def _step(out, step: int):
    return checkpoint_root(out) / f"step-{step:06d}"


@pytest.fixture(scope="module")
def chain(data):
    tmp, config = _setup(data, "qwen3_moe")
    runs = {"ref": tmp / "ref", "one": tmp / "one", "two": tmp / "two", "four": tmp / "four",
            "two_to_one": tmp / "two_to_one", "four_to_one": tmp / "four_to_one"}
    console, rows = {}, {}
    console["ref"], rows["ref"] = _in_process(config, runs["ref"])  # no DeepSpeed, no FSDP2, no EP
    console["one"], rows["one"] = _in_process(config, runs["one"], *FSDP2, "stop_at_step=1")
    console["two"], rows["two"] = _processes(2, config, runs["two"], "expert_parallel_size=2",
                                             f"resume={_step(runs['one'], 1)}")
    console["four"], rows["four"] = _processes(4, config, runs["four"], "expert_parallel_size=4",
                                               f"resume={_step(runs['two'], 2)}")
    console["two_to_one"], rows["two_to_one"] = _in_process(config, runs["two_to_one"], *FSDP2,
                                                            f"resume={_step(runs['two'], 2)}")
    console["four_to_one"], rows["four_to_one"] = _in_process(config, runs["four_to_one"], *FSDP2,
                                                              f"resume={_step(runs['four'], 3)}")
    return runs, console, rows, config


def _assert_equal(chain, name: str, first_step: int):
    runs, _, rows, _ = chain
    ref_log = read_log(runs["ref"])
    assert rows[name] == {step: rows["ref"][step] for step in range(first_step, STEPS + 1)}  # the data position
    _assert_equal_runs("qwen3_moe", runs[name], runs["ref"], ref_log, first_step=first_step, steps=STEPS)


@pytest.mark.multiprocess
def test_fsdp2_resume_one_to_two(chain):
    """EP 1 on 1 process (step 1) -> EP 2 on 2 processes (steps 2-4)."""
    runs, console, rows, _ = chain
    assert [r["step"] for r in read_log(runs["one"])] == [1] and rows["one"] == {1: rows["ref"][1]}
    assert ("experts regrouped: expert_parallel_size 1 → 2 (each rank read its experts from the whole tensors of "
            "the DCP checkpoint, weights and Adam moments)") in console["two"], console["two"]
    assert "weights and optimizer state resharded 1 → 2 FSDP2 shards (DCP)" in console["two"]
    assert load_trainer_state(_step(runs["two"], 2))["expert_parallel_size"] == 2
    _assert_equal(chain, "two", 2)


@pytest.mark.multiprocess
def test_fsdp2_ep4_resumed_from_ep2_equals_one_process(chain):
    """EP 2 on 2 processes (step 2) -> EP 4 on 4 processes (2 of 8 experts a rank, each EP 2 part split in two):
    steps 3-4 and final/ equal the process without EP."""
    runs, console, _, _ = chain
    assert load_trainer_state(_step(runs["four"], 3))["expert_parallel_size"] == 4
    assert "experts regrouped: expert_parallel_size 2 → 4" in console["four"]
    _assert_equal(chain, "four", 3)


@pytest.mark.multiprocess
@pytest.mark.parametrize("source", ["two", "four"])
def test_fsdp2_resume_on_one_process(chain, source):
    """EP 2 (step 2) and EP 4 (step 3) checkpoints resumed on 1 process without EP."""
    runs, console, _, _ = chain
    name, first = f"{source}_to_one", {"two": 3, "four": 4}[source]
    saved = {"two": 2, "four": 4}[source]
    regrouped = f"experts regrouped: expert_parallel_size {saved} → 1"
    assert any(regrouped in line for line in console[name]), console[name]
    _assert_equal(chain, name, first)


def test_resume_line_names_the_expert_regrouping():
    """The resume line says when the experts were regrouped (also on an unchanged dp / sp layout), and how each
    engine did it; the same degree adds nothing."""
    from train.checkpoint import describe_resume

    layout = {"dp_size": 2, "sp_size": 1, "grad_accum": 2, "micro_batch_rows": 1, "world_size": 2,
              "deepspeed_stage": None}
    fsdp2, plain = {**layout, "engine": "fsdp2"}, {**layout, "engine": "plain"}
    assert describe_resume({**fsdp2, "expert_parallel_size": 2}, {**fsdp2, "expert_parallel_size": 1}) == (
        "experts regrouped: expert_parallel_size 2 → 1 (each rank read its experts from the whole tensors of the DCP "
        "checkpoint, weights and Adam moments)")
    four = {**plain, "dp_size": 4, "grad_accum": 1, "world_size": 4, "expert_parallel_size": 4}
    line = describe_resume({**plain, "expert_parallel_size": 2}, four)
    assert line.startswith("saved on dp=2 sp=1 grad_accum=2 micro_batch_rows=1 (no DeepSpeed), now dp=4 ")
    assert line.endswith("; experts regrouped: expert_parallel_size 2 → 4 (the saved parts put together, each "
                         "rank's part cut from them, weights and Adam moments)")
    assert describe_resume({**fsdp2, "expert_parallel_size": 2}, {**fsdp2, "expert_parallel_size": 2}) is None
    assert describe_resume(fsdp2, {**fsdp2, "expert_parallel_size": 1}) is None  # older records: no EP


@pytest.mark.multiprocess
def test_what_cannot_be_regrouped_is_refused(chain, tmp_path, one_thread):
    """Before any tensor loads, naming the key and the way: an FSDP2 checkpoint of another degree on the plain engine
    (the engine named), and a plain checkpoint recorded as saved with EP 2 but without the names of its split
    parameters (trainer_state.json's expert_parameters) on another degree."""
    import shutil

    import orjson

    from train.checkpoint import CheckpointError, write_manifest

    runs, _, _, config = chain
    with pytest.raises(CheckpointError, match=r"was saved with FSDP2 \(distributed_backend: fsdp2\), this run uses "
                                              r"plain torch"):
        Trainer(load_config(config, [f"output_dir={tmp_path / 'a'}", *_options("qwen3_moe"), f"max_steps={STEPS}",
                                     *SPLITS[1], f"resume={_step(runs['two'], 2)}"]), console=lambda *_: None)
    step = tmp_path / "step-000004"
    shutil.copytree(_step(runs["ref"], STEPS), step)
    state = orjson.loads((step / "trainer_state.json").read_bytes())
    (step / "trainer_state.json").write_bytes(orjson.dumps({**state, "expert_parallel_size": 2}))
    write_manifest(step, STEPS)
    with pytest.raises(CheckpointError, match=r"saved with expert_parallel_size=2, this run has "
                                              r"expert_parallel_size=1, and its trainer_state.json does not record "
                                              r".*\(expert_parameters\).*; resume with expert_parallel_size=2"):
        Trainer(load_config(config, [f"output_dir={tmp_path / 'b'}", *_options("qwen3_moe"), f"max_steps={STEPS}",
                                     *SPLITS[1], f"resume={step}"]), console=lambda *_: None)
