"""Resume on another number of processes: a checkpoint written by 1 process resumes on 2 and back (dp 1 -> 2 -> 1
for ZeRO-2, FSDP2 and no DeepSpeed; sp 1 -> 2 -> 1 for ZeRO-3), with another grad_accum / micro_batch_rows
of the same global batch. Every resumed step trains exactly the rows of the uninterrupted run (recorded per rank)
and gives its loss and gradient norm (fp32, clipping on, relative 1e-5). FSDP2 and ZeRO-2 give the same steps. A
change of the global batch is refused, naming both values.

One uninterrupted 1-process run (no DeepSpeed) is the reference of every case. Per case one 2-process run: it
resumes a 1-process run's step 1 and writes step 2, which a 1-process run resumes for step 3."""
from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

from tests._reshard_worker import record_rows
from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    ROOT, free_port, one_thread, random_rows, save_tiny_model, write_config, write_packed)
from train.checkpoint import CheckpointError, checkpoint_root
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

RTOL = 1e-5
STEPS = 3
ONE_PROCESS = ["grad_accum=4", "micro_batch_rows=1"]  # the global batch: 4 rows per step (8 rows: 2 steps an epoch)
# engine overrides, the 2-process split and its layout, the engine as the resume line names it. ZeRO-3 is resharded
# across an sp change: its partitions span every dp x sp rank alike, so dp 2 would reshard the same files, and the
# dp 2 split of the rows is the plain case's
TWO_PROCESSES = {
    "zero2": (["deepspeed.stage=2"], ["grad_accum=1", "micro_batch_rows=2"], "dp=2 sp=1", "ZeRO-2"),
    "zero3_sp": (["deepspeed.stage=3"], ["sequence_parallel_size=2", "grad_accum=2", "micro_batch_rows=2"],
                 "dp=1 sp=2", "ZeRO-3"),
    "plain": ([], ["grad_accum=2", "micro_batch_rows=1"], "dp=2 sp=1", "no DeepSpeed"),
    "fsdp2": (["distributed_backend=fsdp2"], ["grad_accum=1", "micro_batch_rows=2"], "dp=2 sp=1", "FSDP2"),
}
RESHARDED = {"ZeRO-2": "optimizer state resharded {} → {} ZeRO partitions",
             "ZeRO-3": "optimizer state resharded {} → {} ZeRO partitions",
             "no DeepSpeed": "optimizer state loaded whole, as saved (no DeepSpeed: it is not partitioned)",
             "FSDP2": "weights and optimizer state resharded {} → {} FSDP2 shards (DCP)"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    data = write_packed(tmp / "data", random_rows(11, 8))
    model = save_tiny_model(tmp / "model")
    # clipping on (0.5 is below every step's norm here): each engine's norm of its own gradient layout clips alike
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=STEPS, lr=1e-3,
                          warmup_steps=1, max_grad_norm=0.5, loss_chunk_size=16, save_steps=1, save_total_limit=5,
                          plot=False, output_dir=str(tmp / "unused"))
    return tmp, config


def _in_process(config, out, rows_dir, *overrides):
    """(console lines, log records) of a 1-process run on one torch thread; its rows go to rows_dir."""
    import torch

    rows_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine two threads are ~50x slower
    try:
        trainer = Trainer(load_config(config, [f"output_dir={out}", *ONE_PROCESS, *overrides]), console=lines.append)
        record_rows(trainer, rows_dir)
        trainer.train()
    finally:
        torch.set_num_threads(before)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a ZeRO-3 run's from_pretrained-into-partitions setting ends with it
    return lines, read_log(out)


def _two_processes(config, rows_dir, *overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_reshard_worker.py"), str(config), str(rows_dir), "launch.num_processes=2",
           *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return (rows_dir / "console.txt").read_text()


def _rows_by_step(rows_dir) -> dict[int, list[int]]:
    """The rows each step trained, over all ranks (the sp ranks of one dp rank train the same rows: counted once)."""
    steps: dict[int, list[int]] = {}
    for file in sorted(rows_dir.glob("rank_*.jsonl")):
        for line in file.read_bytes().splitlines():
            record = orjson.loads(line)
            if record["sp_rank"] == 0:
                steps.setdefault(record["step"], []).extend(record["rows"])
    return {step: sorted(rows) for step, rows in steps.items()}


def _assert_same_steps(got: list[dict], ref: list[dict], steps: list[int], what: str):
    assert [r["step"] for r in got] == steps, what
    by_step = {r["step"]: r for r in ref}
    for record in got:
        expected = by_step[record["step"]]
        for key in ("loss", "grad_norm"):
            err = abs(record[key] - expected[key]) / abs(expected[key])
            assert err <= RTOL, f"{what}: step {record['step']} {key} relative error {err:.1e}"
        assert record["lr"] == pytest.approx(expected["lr"], rel=1e-12), what
        assert record["loss_tokens"] == expected["loss_tokens"], what


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """The uninterrupted run every resume is compared with: 1 process, no DeepSpeed, all steps: (log, rows by
    step)."""
    tmp = tmp_path_factory.mktemp("reference")
    _, ref = _in_process(setup[1], tmp / "out", tmp / "rows")
    rows = _rows_by_step(tmp / "rows")
    assert sorted(rows) == [1, 2, 3] and all(len(r) == 4 for r in rows.values())
    assert all(r["grad_norm"] > 0.5 for r in ref)  # every step clips
    return ref, rows, tmp / "out"


@pytest.fixture(scope="module")
def resumed(setup, tmp_path_factory):
    """case -> its runs, each made once: 1 process trains step 1 (a checkpoint), 2 processes resume it for steps 2
    and 3, 1 process resumes their step 2 for step 3."""
    _, config = setup
    runs: dict[str, dict] = {}

    def run(case: str) -> dict:
        if case in runs:
            return runs[case]
        tmp = tmp_path_factory.mktemp(case)
        engine, two, _, _ = TWO_PROCESSES[case]
        _, first = _in_process(config, tmp / "first", tmp / "first_rows", *engine, "stop_at_step=1")
        console = _two_processes(config, tmp / "two_rows", f"output_dir={tmp / 'two'}", *engine, *two,
                                 f"resume={checkpoint_root(tmp / 'first') / 'step-000001'}")
        lines, back = _in_process(config, tmp / "back", tmp / "back_rows", *engine,
                                  f"resume={checkpoint_root(tmp / 'two') / 'step-000002'}")
        runs[case] = {"first": first, "first_rows": _rows_by_step(tmp / "first_rows"), "two_console": console,
                      "two": read_log(tmp / "two"), "two_rows": _rows_by_step(tmp / "two_rows"),
                      "back_lines": [str(line) for line in lines], "back": back,
                      "back_rows": _rows_by_step(tmp / "back_rows")}
        return runs[case]

    return run


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(TWO_PROCESSES))
def test_resume_on_another_number_of_processes(reference, resumed, case):
    ref, ref_rows, _ = reference
    _, two, two_layout, name = TWO_PROCESSES[case]
    runs = resumed(case)
    _assert_same_steps(runs["first"], ref, [1], f"{case} 1 process")
    assert runs["first_rows"] == {1: ref_rows[1]}
    # 1 -> 2 processes: resumes step 1, trains steps 2 and 3
    assert (f"at step 1; saved on dp=1 sp=1 grad_accum=4 micro_batch_rows=1 ({name}), now {two_layout} "
            f"grad_accum={two[-2].split('=')[1]} micro_batch_rows={two[-1].split('=')[1]} ({name}): "
            f"{RESHARDED[name].format(1, 2)}") in runs["two_console"], runs["two_console"]
    _assert_same_steps(runs["two"], ref, [2, 3], f"{case} 1 -> 2")
    assert runs["two_rows"] == {2: ref_rows[2], 3: ref_rows[3]}
    # 2 -> 1 process: resumes the 2-process run's step 2, trains step 3
    assert any(f"now dp=1 sp=1 grad_accum=4 micro_batch_rows=1 ({name}): {RESHARDED[name].format(2, 1)}" in line
               for line in runs["back_lines"]), runs["back_lines"]
    _assert_same_steps(runs["back"], ref, [3], f"{case} 2 -> 1")
    assert runs["back_rows"] == {3: ref_rows[3]}


@pytest.mark.multiprocess
def test_fsdp2_equals_zero2(resumed):
    """The same 2-process steps (the same split of each step, clipping on) under FSDP2 and ZeRO-2."""
    fsdp2, zero2 = resumed("fsdp2"), resumed("zero2")
    assert TWO_PROCESSES["fsdp2"][1:3] == TWO_PROCESSES["zero2"][1:3]
    for runs in ("first", "two", "back"):
        _assert_same_steps(fsdp2[runs], zero2[runs], [r["step"] for r in zero2[runs]], f"fsdp2 vs zero2 ({runs})")


def test_another_global_batch_is_refused(setup, reference, one_thread):
    _, config = setup
    out = reference[2]
    with pytest.raises(CheckpointError, match=r"the global batch is 2 rows per step here \(dp 1 x grad_accum 2 x "
                                              r"micro_batch_rows 1\), but the checkpoint was saved with 4 rows per "
                                              r"step \(dp 1 x grad_accum 4 x micro_batch_rows 1\)"):
        Trainer(load_config(config, [f"output_dir={out}", "resume=latest", "grad_accum=2", "micro_batch_rows=1"]),
                console=lambda *_: None)
    # the same global batch split otherwise resumes
    lines = []
    Trainer(load_config(config, [f"output_dir={out}", "resume=latest", "grad_accum=2", "micro_batch_rows=2"]),
            console=lines.append)
    assert any("grad_accum=2 micro_batch_rows=2 (no DeepSpeed): optimizer state loaded as saved" in str(line)
               for line in lines)


def test_resume_line_names_the_engine():
    """trainer_state.json's `engine` names FSDP2 (its deepspeed_stage is null, as without DeepSpeed); a checkpoint
    older than the key is named from deepspeed_stage."""
    from train.checkpoint import describe_resume

    saved = {"dp_size": 2, "sp_size": 1, "grad_accum": 1, "micro_batch_rows": 2, "world_size": 2}
    now = {"dp_size": 1, "sp_size": 1, "grad_accum": 4, "micro_batch_rows": 1, "world_size": 1}
    fsdp2 = {"engine": "fsdp2", "deepspeed_stage": None}
    assert describe_resume({**saved, **fsdp2}, {**now, **fsdp2}).startswith(
        "saved on dp=2 sp=1 grad_accum=1 micro_batch_rows=2 (FSDP2), now dp=1 sp=1 grad_accum=4 micro_batch_rows=1 "
        "(FSDP2): weights and optimizer state resharded 2 → 1 FSDP2 shards (DCP)")
    line = describe_resume({**saved, "deepspeed_stage": 2}, {**now, "engine": "deepspeed", "deepspeed_stage": 2})
    assert "micro_batch_rows=2 (ZeRO-2), now" in line and ": optimizer state resharded 2 → 1 ZeRO partitions" in line
    same = {**saved, "engine": "plain", "deepspeed_stage": None}
    assert describe_resume(same, same) is None


class _Payload:
    """Unpickling it runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_partition_files_are_read_without_running_code(tmp_path):
    """The reshard path reads DeepSpeed's partition files itself: a planted pickle is refused, not run; a missing
    rank's file is named."""
    import re

    import torch

    from train.engines.deepspeed_engine import read_zero_state

    ds = tmp_path / "ds"
    ds.mkdir()
    marker = tmp_path / "pwned"
    for rank in (0, 2):
        torch.save({"optimizer_state_dict": {"planted": _Payload(marker)}},
                   ds / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=re.escape(f"{ds}: the ZeRO optimizer partition files are not ranks "
                                                        "0..n-1 (found ranks [0, 2])")):
        read_zero_state(ds)
    (ds / "zero_pp_rank_2_mp_rank_00_optim_states.pt").rename(ds / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=re.escape(f"{ds / 'zero_pp_rank_0_mp_rank_00_optim_states.pt'}: "
                                                        "refused to load")):
        read_zero_state(ds)
    assert not marker.exists()
