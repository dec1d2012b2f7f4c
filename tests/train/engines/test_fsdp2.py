"""distributed_backend: fsdp2 on CPU (gloo): FSDP2 dp=2 with tiled MLPs and activation checkpointing == one process
with the same global batch, with gradient clipping on (losses and gradient norms within 1e-5 relative); resumed ==
not stopped, bit for bit; LoRA with sequence parallelism and activation checkpointing; DCP files read without
running code from them. FSDP2 == ZeRO-2 and resuming on another number of ranks (through the trainer):
tests/train/run/test_resume_reshard.py."""
from __future__ import annotations

import os

import pytest
import torch

from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    one_thread,
    random_rows,
    run_train,
    save_tiny_model,
    write_config,
    write_packed,
)
from train.checkpoint import CheckpointError
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

RTOL = 1e-5
STEPS = 3
# clipping on (0.5 is below every step's norm here): the FSDP2 norm of the sharded gradients clips as the others do
COMMON = ["max_grad_norm=0.5"]
FSDP2 = ["distributed_backend=fsdp2", "launch.num_processes=2"]
TILED = ["tiled_mlp=true", "tiled_mlp_tile=4", "gradient_checkpointing=true"]  # rows of 18-72 tokens: 5-18 tiles


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    data = write_packed(tmp / "data", random_rows(11, 6))
    model = save_tiny_model(tmp / "model", tie=True)  # tied embeddings: one parameter in two places of a unit
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=STEPS, lr=1e-3,
                          loss_chunk_size=16, plot=False, output_dir=str(tmp / "unused"))
    return tmp, config


def _in_process(config, out, *overrides) -> list[dict]:
    """The log of a single-process run without DeepSpeed or FSDP2 (no process group)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Trainer(load_config(config, [f"output_dir={out}", *COMMON, *overrides]), console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_close(log: list[dict], ref: list[dict], what: str) -> None:
    assert [r["step"] for r in log] == [r["step"] for r in ref], what
    for got, want in zip(log, ref):
        assert _rel(got["loss"], want["loss"]) <= RTOL, (what, got["step"], got["loss"], want["loss"])
        # the gradient norm is scale-sensitive (Adam is not): it proves the gradient is the exact step gradient
        assert _rel(got["grad_norm"], want["grad_norm"]) <= RTOL, (what, got["step"], got["grad_norm"],
                                                                  want["grad_norm"])
        assert got["lr"] == pytest.approx(want["lr"])


@pytest.fixture(scope="module")
def fsdp2_run(setup):
    """FSDP2 over 2 ranks, 2 micro-batches per rank and step (4 rows a step), with the MLPs tiled (4 tokens a tile)
    and activation checkpointing: its output_dir (a checkpoint every step)."""
    tmp, config = setup
    out = tmp / "fsdp2"
    run_train(config, [f"output_dir={out}", *COMMON, *FSDP2, "grad_accum=2", *TILED, "save_steps=1",
                       "save_total_limit=3"], nproc=2)
    return out


@pytest.fixture(scope="module")
def resumed_run(setup, fsdp2_run):
    """The same run resumed from its step-2 checkpoint (a DCP directory) into another output_dir: its output_dir."""
    tmp, config = setup
    out = tmp / "resumed"
    run_train(config, [f"output_dir={out}", *COMMON, *FSDP2, "grad_accum=2", *TILED,
                       f"resume={fsdp2_run / 'checkpoints' / 'step-000002'}"], nproc=2)
    return out


@pytest.mark.multiprocess
def test_fsdp2_equals_one_process(setup, fsdp2_run, tmp_path):
    """The same steps, and the same export: full HF safetensors with the tied head written once. Tiled MLPs work
    with sharded weights here: each decoder layer is gathered whole around its forward and its backward, so the
    tiles and their recomputation see the full weights (ZeRO-3, which gathers per submodule call, refuses
    tiled_mlp). The one process tiles alike: tiling sums an MLP weight's gradient in another order, and Adam's
    first steps magnify that rounding where a gradient is tiny (one up_proj entry ends 1.5e-6 apart, 2e-4
    relative, between one tiled and one untiled process; the losses and gradient norms agree within 1e-7)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp, config = setup
    ref = _in_process(config, tmp_path / "ref", "grad_accum=4", *TILED)  # one process, the same 4 rows a step
    log = read_log(fsdp2_run)
    assert len(log) == len(ref) == STEPS
    _assert_close(log, ref, "fsdp2 (tiled MLP, checkpointing) vs one process")
    got = load_file(fsdp2_run / "final" / "model.safetensors")
    want = load_file(tmp_path / "ref" / "final" / "model.safetensors")
    assert got.keys() == want.keys() and "lm_head.weight" not in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=1e-6)
    AutoModelForCausalLM.from_pretrained(fsdp2_run / "final")


@pytest.mark.multiprocess
def test_fsdp2_resume_is_bitwise(fsdp2_run, resumed_run):
    """Resumed from step 2: the same step 3 (loss, gradient norm, lr) and final weights, bit for bit, as the run
    that never stopped."""
    from safetensors.torch import load_file

    assert sorted(p.name for p in (fsdp2_run / "checkpoints" / "step-000002" / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    keys = ("step", "loss", "grad_norm", "lr", "category_loss")
    assert [{k: r[k] for k in keys} for r in read_log(resumed_run)] == [
        {k: r[k] for k in keys} for r in read_log(fsdp2_run)[2:]]
    resumed = load_file(resumed_run / "final" / "model.safetensors")
    whole = load_file(fsdp2_run / "final" / "model.safetensors")
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert torch.equal(resumed[name], whole[name]), name


@pytest.mark.multiprocess
def test_another_backend_refuses_the_checkpoint(fsdp2_run):
    """An FSDP2 checkpoint is recognised by its dcp/ and refused by the other engines, naming both settings."""
    from train.engines.build import ENGINES
    from train.engines.engine import saved_with

    checkpoint = fsdp2_run / "checkpoints" / "step-000002"
    assert saved_with(checkpoint) == "fsdp2"
    for name in ("plain", "deepspeed"):
        engine = ENGINES[name].__new__(ENGINES[name])  # only its name is read
        with pytest.raises(CheckpointError, match=r"was saved with FSDP2 \(distributed_backend: fsdp2\), this run "
                                                  r"uses (plain torch|DeepSpeed)"):
            engine.check_saved_with(checkpoint)


@pytest.mark.multiprocess
def test_fsdp2_lora_with_sequence_parallel(setup, tmp_path):
    """LoRA adapters (frozen base weights sharded beside trainable ones), sequence parallel 2 (the sp ranks shard and
    sum like dp ranks) and activation checkpointing, against one plain process."""
    _, config = setup
    lora = ["lora_rank=4", "lora_merge_on_save=false"]
    ref = _in_process(config, tmp_path / "ref", *lora)
    out = tmp_path / "lora_sp"
    run_train(config, [f"output_dir={out}", *COMMON, *FSDP2, *lora, "sequence_parallel_size=2",
                       "gradient_checkpointing=true"], nproc=2)
    _assert_close(read_log(out), ref, "fsdp2 + lora + sp=2")
    assert (out / "final" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------- loading safely
class _Planted:
    """A value whose unpickling would run a command: what a crafted checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process without a group, on purpose
def test_dcp_files_load_without_running_code(tmp_path):
    """A DCP checkpoint (written in one process, without a process group) loads through train.engines.dcp; a
    pickle planted in a non-tensor value, or in .metadata, is refused instead of run."""
    import pickle

    from train.checkpoint import write_manifest
    from train.engines import dcp as dcp_checkpoint

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"param_groups": [{"lr": 0.5}]}}
    dcp_checkpoint.save(state, tmp_path / "good")
    write_manifest(tmp_path / "good", 0)  # a DCP directory is read only with a manifest listing its files
    loaded = {"model": {"w": torch.zeros(2, 3)}, "optimizer": {"param_groups": [{"lr": 0.0}]}}
    dcp_checkpoint.load(loaded, tmp_path / "good", manifest_dir=tmp_path / "good")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.5

    marker = tmp_path / "ran"
    dcp_checkpoint.save({"model": {"w": torch.ones(2)}, "extra": _Planted(marker)}, tmp_path / "value")
    write_manifest(tmp_path / "value", 0)
    with pytest.raises(CheckpointError, match="refused to load"):
        dcp_checkpoint.load({"model": {"w": torch.zeros(2)}, "extra": None}, tmp_path / "value",
                            manifest_dir=tmp_path / "value")
    assert not marker.exists()

    metadata = tmp_path / "good" / ".metadata"
    metadata.write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load: it names posix\.system"):
        dcp_checkpoint.load(loaded, tmp_path / "good", manifest_dir=tmp_path / "good")
    assert not marker.exists()
