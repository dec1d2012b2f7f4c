"""Ulysses sequence parallelism and the Ulysses x gather hybrid: exact equality with sp = 1 (multi-process gloo,
CPU), the choice by shape and placement, and `python -m train` end to end under torchrun.

The multi-process checks run once (one spawned world of 4 processes, tests/_ulysses_worker.py): Ulysses sp = 4,
dp = 2 x Ulysses sp = 2 and the hybrid 2 x 2, two micro-batches per step, on a GQA Qwen2 (kv heads repeated up to
the degree), gemma2 (sliding window, softcap), gpt-oss (sinks, sliding window) and the Parallel-R1 mask.
"""
from __future__ import annotations

import re

import pytest
import torch

from tests._sp_worker import sample_rows, spawned_results, totals_of
from tests._train_helpers import (
    random_rows,
    run_train,
    save_tiny_model,
    write_config,
    write_packed,
)
from train.steps.batch import make_batch
from train.plan.attention import choose_sp_layout
from train.config.sp_rules import allowed_degrees, heads_problem
from train.attention.ulysses import UlyssesSpec, ulysses_shard

LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
CONFIGS = ("ulysses-sp4", "ulysses-dp2sp2", "hybrid-sp4")


@pytest.fixture(scope="module")
def ulysses_results(tmp_path_factory) -> dict:
    from tests._ulysses_worker import worker

    return spawned_results(worker, 4, tmp_path_factory.mktemp("ulysses"))


# ------------------------------------------------------------------------------ multi-process equivalence
@pytest.mark.multiprocess
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", ["qwen2/token", "qwen2/sample", "gemma2/token", "gpt_oss/token", "structure/token"])
def test_loss_and_gradients_equal_single_process(ulysses_results, case, config):
    family, reduction = case.split("/")
    result = ulysses_results[f"{family}/{config}/{reduction}"]
    assert result["loss"] <= LOSS_RTOL, result
    assert result["cat_sum"] <= LOSS_RTOL, result
    assert result["grad"] <= GRAD_RTOL, result  # worst parameter: max |g_sp - g_ref| / max |g_ref|
    assert result["cat_count_equal"], result
    assert result["path"] == config.split("-")[0], result


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", CONFIGS)
def test_rank_without_loss_token_contributes_zero(ulysses_results, config):
    for family, reduction in (("qwen2", "token"), ("qwen2", "sample"), ("gpt_oss", "token")):
        assert ulysses_results[f"{family}/{config}/{reduction}"]["row1_last_rank_loss"] == 0.0


# ------------------------------------------------------------------------------ heads and the choice
def test_heads_problems_name_the_numbers():
    assert heads_problem(8, 8, 4) is None
    assert heads_problem(8, 2, 4) is None  # kv heads repeated 2x
    assert heads_problem(14, 2, 4) == "14 attention heads are not divisible by the Ulysses degree 4"
    assert heads_problem(12, 6, 4) == "6 key/value heads are not divisible by the Ulysses degree 4"
    assert "3 key/value heads cannot be repeated up to the Ulysses degree 4" in heads_problem(12, 3, 4)
    assert allowed_degrees(14, 2, 8) == [2]  # Qwen2.5 0.5B: 14 heads, 2 kv heads
    assert allowed_degrees(28, 4, 8) == [2, 4]  # Qwen2.5 7B
    assert allowed_degrees(16, 8, 8) == [2, 4, 8]


@pytest.mark.parametrize("backend,sp,ulysses,heads,per_machine,want", [
    ("auto", 4, None, (16, 8), 8, (4, "ulysses 4")),  # heads allow it, the group fits one machine
    ("auto", 16, None, (16, 8), 8, (8, "hybrid ulysses 8 x torch 2")),  # beyond one machine: the hybrid
    ("auto", 8, None, (28, 4), 8, (4, "hybrid ulysses 4 x torch 2")),  # the heads allow 4 at most
    ("auto", 4, None, (14, 2), 4, (2, "hybrid ulysses 2 x torch 2")),
    ("auto", 3, None, (4, 2), 3, (1, "torch 3")),  # no degree splits the heads: gather
    ("ulysses", 4, None, (4, 2), 4, (4, "ulysses 4")),  # kv heads 2 repeated to 4
    ("auto", 4, 2, (16, 8), 4, (2, "hybrid ulysses 2 x torch 2")),
    ("torch", 4, 2, (16, 8), 4, (2, "hybrid ulysses 2 x torch 2")),
    ("torch", 4, None, (16, 8), 4, (1, "torch 4")),  # an explicit gather backend stays as it was
    ("llama3", 4, None, (16, 8), 4, (1, "llama3 4")),
    ("auto", 4, 1, (16, 8), 4, (1, "torch 4")),
])
def test_layout_choice(backend, sp, ulysses, heads, per_machine, want):
    layout = choose_sp_layout(backend, sp, ulysses, *heads, per_machine)
    ring = "llama3" if backend == "llama3" else "torch"
    assert (layout.ulysses_size, layout.describe(ring)) == want
    assert layout.reason


@pytest.mark.parametrize("backend,sp,ulysses,heads,message", [
    ("ulysses", 4, None, (14, 2), "sp_backend=ulysses with sequence_parallel_size=4: 14 attention heads are not "
                                  "divisible by the Ulysses degree 4; degrees these heads allow for "
                                  "sequence_parallel_size=4: [2]; alternatives: sp_ulysses_size="),
    ("auto", 8, 8, (28, 4), "sp_ulysses_size=8: 28 attention heads are not divisible by the Ulysses degree 8"),
    ("auto", 4, 3, (12, 4), "sp_ulysses_size=3 must divide sequence_parallel_size=4"),
    ("zigzag", 4, 2, (16, 8), "sp_backend=zigzag cannot be its ring part"),
    ("ulysses", 4, 1, (16, 8), "sp_backend=ulysses needs sp_ulysses_size > 1"),
    ("auto", 16, 16, (16, 8), "sequence_parallel_size=16 does not divide the 8 processes per machine"),
])
def test_layout_errors(backend, sp, ulysses, heads, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        choose_sp_layout(backend, sp, ulysses, *heads, 8)


def test_config_refuses_what_no_ulysses_can_do(tmp_path):
    from common.config import ConfigError
    from train.config.sections import from_keys
    from train.config.sp_rules import placement_problem

    base = dict(model_config="configs/model/tiny_qwen2.json", data_path=str(tmp_path), output_dir=str(tmp_path / "o"))
    cfg = from_keys({**base, "sequence_parallel_size": 4, "sp_ulysses_size": 3, "launch": {"num_processes": 4}})
    with pytest.raises(ConfigError, match="sp_ulysses_size=3 must divide sequence_parallel_size=4"):
        cfg.validate(world_size=4)
    # an sp group of 8 over two machines of 4: the hybrid (Ulysses inside each machine) may span them
    launch = {"num_processes": 8, "num_machines": 2, "main_process_ip": "10.0.0.1"}
    from_keys({**base, "sequence_parallel_size": 8, "launch": launch}).validate(world_size=8)
    assert placement_problem("auto", 8, None, 4) is None
    assert placement_problem("torch", 8, None, 4)
    assert placement_problem("torch", 8, 4, 4) is None
    with pytest.raises(ConfigError, match="does not divide the 4 processes per machine"):
        from_keys({**base, "sequence_parallel_size": 8, "sp_backend": "torch", "launch": launch}).validate(8)


# ------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("sp,ulysses", [(4, 4), (4, 2), (6, 3), (6, 2)])
def test_hybrid_ring_block_is_the_ulysses_groups_slices(sp, ulysses):
    """Every rank keeps its contiguous slice; in the hybrid, the ring context of a rank covers exactly the slices of
    its Ulysses group (adjacent ranks), in a row padded to a multiple of sp with a padding sequence of its own."""
    batch = make_batch([sample_rows()[0]], totals_of(sample_rows()), "token")
    for rank in range(sp):
        spec = UlyssesSpec(size=ulysses, group=None, ring_group=object(), ring_backend="torch")
        local, ctx = ulysses_shard(batch, rank, sp, spec)
        assert ctx.padded_length % sp == 0 and local["input_ids"].shape[1] == ctx.padded_length // sp
        assert ctx.local_range == (rank * ctx.padded_length // sp, (rank + 1) * ctx.padded_length // sp)
        uctx = ctx.ulysses
        assert uctx.rank == rank % ulysses
        if ulysses == sp:
            assert uctx.local.sp is None and uctx.local.bounds.host_cu_q == tuple(ctx.cu_seqlens.tolist())
            continue
        block = ctx.padded_length // sp * ulysses
        group_start = rank // ulysses * block
        ring = uctx.local.sp
        assert ring.local_range == (group_start, group_start + block)
        assert ring.sp_rank == rank // ulysses and ring.sp_size == sp // ulysses
        assert torch.equal(ring.cu_seqlens, ctx.cu_seqlens)  # no second padding


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def e2e_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ulysses_e2e")
    data = write_packed(tmp / "data", random_rows(11, 4, min_len=5, max_len=14))
    model = save_tiny_model(tmp / "model")  # 4 heads, 2 kv heads
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=2, lr=1e-3,
                          max_grad_norm=0.0, loss_chunk_size=16, plot=False, grad_accum=2, self_check=False,
                          output_dir=str(tmp / "unused"))
    return tmp, config


@pytest.mark.multiprocess
@pytest.mark.slow
def test_train_under_torchrun_equals_single_process(e2e_setup, tmp_path):
    """`python -m train` under torchrun: Ulysses sp = 2 (2 processes) and the hybrid sp = 4 = Ulysses 2 x gather 2
    (4 processes) log the losses and gradient norms of one process (2 micro-batches per step)."""
    from train.metrics import read_log

    _, config = e2e_setup
    run_train(config, [f"output_dir={tmp_path / 'one'}"])
    want = read_log(tmp_path / "one")
    runs = {
        "ulysses": (2, ["sequence_parallel_size=2", "sp_backend=ulysses", "launch.num_processes=2"]),
        "hybrid": (4, ["sequence_parallel_size=4", "sp_ulysses_size=2", "launch.num_processes=4"]),
    }
    for name, (nproc, overrides) in runs.items():
        proc = run_train(config, [f"output_dir={tmp_path / name}", *overrides], nproc=nproc)
        expected = "attention: sequence parallelism ulysses 2" if name == "ulysses" else \
            "attention: sequence parallelism hybrid ulysses 2 x torch 2"
        assert expected in proc.stdout + proc.stderr
        got = read_log(tmp_path / name)
        assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
        for a, b in zip(got, want):
            assert a["loss_tokens"] == b["loss_tokens"]
            assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), name
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_RTOL), name
