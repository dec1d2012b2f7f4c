"""Sequence parallelism: exact equality with sp = 1 (multi-process gloo, CPU), sharding at the data level, backends.

The multi-process checks run once (one spawned world of 4 processes, see tests/_sp_worker.py) and every test below
reads its results: for sp = 4, dp = 2 x sp = 2 and sp = 2, contiguous and zigzag layouts (torch backend), each loss
reduction, the step loss, the per-category sums and every parameter's gradient equal the single-process run.
"""
from __future__ import annotations

import json
import socket

import pytest
import torch

from tests._sp_worker import REDUCTIONS, sample_rows, structured_rows, totals_of
from train.batch import IGNORE_INDEX, make_batch
from train.sequence_parallel import (
    BACKEND_LAYOUT,
    TOKEN_PAD_VALUES,
    SPBackendUnavailable,
    resolve_backend,
    shard_batch,
)

WORLD = 4
RTOL = 1e-5
LAYOUTS = ("contiguous", "zigzag")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    from tests._sp_worker import worker

    out = tmp_path_factory.mktemp("sp") / "results.json"
    mp.spawn(worker, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True)
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------ multi-process equivalence
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", ["sp4", "dp2sp2", "sp2"])
def test_loss_and_gradients_equal_single_process(sp_results, config, layout, reduction):
    result = sp_results[f"{config}/{layout}/{reduction}"]
    assert result["loss"] < RTOL, result
    assert result["cat_sum"] < RTOL, result
    assert result["grad"] < RTOL, result  # worst parameter: max |g_sp - g_ref| / max |g_ref|
    assert result.get("cat_count_equal", True), result


def test_gradient_checkpointing_under_sp(sp_results):
    result = sp_results["checkpointing-sp4/contiguous/token"]
    assert result["loss"] < RTOL and result["cat_sum"] < RTOL and result["grad"] < RTOL, result


@pytest.mark.parametrize("config", ["structure-sp4", "structure-dp2sp2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_structure_mode_equals_full_row_mask(sp_results, config, layout):
    result = sp_results[f"{config}/{layout}/token"]
    assert result["loss"] < RTOL and result["cat_sum"] < RTOL and result["grad"] < RTOL, result
    assert result["cat_count_equal"], result


@pytest.mark.parametrize("config", ["sp4", "dp2sp2"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shard_without_loss_token_contributes_exactly_zero(sp_results, config, reduction):
    # row 1's last contiguous shard (rank 3) has no loss target; it still ran forward/backward for the others
    assert sp_results[f"{config}/contiguous/{reduction}"]["row1_last_rank_loss"] == 0.0


# ------------------------------------------------------------------------------ sharding at the data level
def _batches(structure: bool = False):
    rows = structured_rows() if structure else sample_rows()
    totals = totals_of(rows)
    return [make_batch([row], totals, "sample", structure=structure) for row in rows]


def _shards(batch, sp, layout):
    return [shard_batch(batch, r, sp, "torch", layout=layout) for r in range(sp)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_no_loss_token_lost_at_boundaries(layout, sp):
    for batch in _batches():
        shards = _shards(batch, sp, layout)
        trained = sum(int((local["targets"] != IGNORE_INDEX).sum()) for local, _ in shards)
        assert trained == batch["n_loss_tokens"] == int((batch["targets"] != IGNORE_INDEX).sum())
        # the same weights, token for token (only reordered), so the weighted sums agree exactly
        local_weights = torch.cat([local["weights"] for local, _ in shards])
        assert torch.equal(local_weights[local_weights > 0].sort().values,
                           batch["weights"][batch["weights"] > 0].sort().values)
        for local, _ in shards:
            assert torch.equal(local["weights"] > 0, local["targets"] != IGNORE_INDEX)


@pytest.mark.parametrize("structure", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_inverse_permutation_recovers_the_row(layout, sp, structure):
    """Scatter every rank's tokens back by their global index: the real tokens are the row, in order, with all
    their fields (positions, targets, weights, categories, structure ids); padding carries no loss."""
    for batch in _batches(structure):
        shards = _shards(batch, sp, layout)
        ctx0 = shards[0][1]
        n = ctx0.padded_length
        assert all(ctx.local_length == n // sp for _, ctx in shards)  # equal shards
        gathered = torch.cat([ctx.local_index for _, ctx in shards])
        assert torch.equal(gathered, ctx0.gathered_index)
        assert torch.equal(gathered.sort().values, torch.arange(n))  # a permutation of the padded row
        real = ctx0.source_index >= 0
        assert torch.equal(ctx0.source_index[real], torch.arange(batch["input_ids"].shape[1]))
        for name in ("input_ids", "position_ids", "targets", "weights", "target_categories", "seq_ids",
                     *(("block_ids", "path_ids") if structure else ())):
            row = torch.zeros(n, dtype=batch[name].dtype)
            for local, ctx in shards:
                row[ctx.local_index] = local[name].reshape(-1)
            assert torch.equal(row[real], batch[name].reshape(-1)), name
            if name in ("targets", "weights"):
                assert (row[~real] == TOKEN_PAD_VALUES[name]).all(), name
        for local, ctx in shards:
            assert local["input_ids"].shape == (1, ctx.local_length)
            assert local["position_ids"].shape == (1, ctx.local_length)
            assert "cu_seqlens" not in local and local["n_loss_tokens"] == batch["n_loss_tokens"]


@pytest.mark.parametrize("sp", [2, 4])
def test_contiguous_padding_is_its_own_sequence(sp):
    batch = _batches()[0]  # 81 tokens
    local, ctx = shard_batch(batch, sp - 1, sp, "torch")
    pad = ctx.padded_length - batch["input_ids"].shape[1]
    assert ctx.padded_length % sp == 0 and 0 < pad < sp
    assert ctx.cu_seqlens.tolist() == batch["cu_seqlens"].tolist() + [ctx.padded_length]
    assert local["position_ids"][0, -pad:].tolist() == list(range(pad))  # a fresh sequence
    moved = ctx.to("cpu")
    assert torch.equal(moved.cu_seqlens, ctx.cu_seqlens) and moved.local_range == ctx.local_range
    mask = moved.attention_mask(torch.device("cpu"))
    key_index = ctx.gathered_index[ctx.key_range[0]: ctx.key_range[1]]
    pad_keys = ctx.source_index[key_index] < 0
    real_queries = ctx.source_index[ctx.local_index] >= 0
    assert not mask[real_queries][:, pad_keys].any()  # nothing real sees padding
    assert not mask[~real_queries][:, ~pad_keys].any()  # padding sees nothing real


@pytest.mark.parametrize("sp", [2, 3, 4])
def test_zigzag_layout(sp):
    """Every sequence padded to a multiple of 2*sp; rank i holds chunks i and 2*sp-1-i of each sequence, whose
    positions run on consecutively; the local cu_seqlens (what the zigzag kernel gets) are the padded ones / sp."""
    batch = _batches()[0]
    lengths = (batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]).tolist()
    for rank in range(sp):
        local, ctx = shard_batch(batch, rank, sp, "torch", layout="zigzag")
        padded = (ctx.cu_seqlens[1:] - ctx.cu_seqlens[:-1]).tolist()
        assert padded == [-(-n // (2 * sp)) * 2 * sp for n in lengths]
        assert torch.equal(ctx.local_cu_seqlens, (ctx.cu_seqlens // sp).to(torch.int32))
        assert ctx.local_max_seqlen == max(padded) // sp
        bounds = ctx.local_cu_seqlens.tolist()
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            chunk = (hi - lo) // 2
            first, second = ctx.local_index[lo: lo + chunk], ctx.local_index[lo + chunk: hi]
            start = int(ctx.cu_seqlens[s])
            assert first.tolist() == list(range(start + rank * chunk, start + (rank + 1) * chunk))
            assert second.tolist() == list(range(start + (2 * sp - 1 - rank) * chunk, start + (2 * sp - rank) * chunk))
            for half in (slice(lo, lo + chunk), slice(lo + chunk, hi)):
                positions = local["position_ids"][0, half]
                assert (positions[1:] - positions[:-1] == 1).all()  # padding continues its sequence's positions
                assert (local["seq_ids"][half] == s).all()


# ------------------------------------------------------------------------------ backends and errors
def test_backend_selection_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")
    assert resolve_backend("auto") == "torch"
    assert resolve_backend("auto", half_precision=False) == "torch"
    assert resolve_backend("torch", half_precision=False) == "torch"
    for backend in ("llama3", "zigzag"):
        with pytest.raises(SPBackendUnavailable, match=f"sp_backend='{backend}'.*sp_backend=torch"):
            resolve_backend(backend)
    with pytest.raises(SPBackendUnavailable, match="llama3"):
        shard_batch(_batches()[0], 0, 2, "llama3")
    with pytest.raises(ValueError, match="sp_backend"):
        resolve_backend("ring")


def test_structure_data_picks_the_torch_backend(monkeypatch):
    """`auto` on a GPU with ring-flash-attn picks llama3, whose causal kernels cannot apply the Parallel-R1 mask."""
    import train.sequence_parallel as sequence_parallel
    from data.config import ConfigError
    from train.trainer import choose_sp_backend

    monkeypatch.setattr(sequence_parallel, "resolve_backend", lambda name, half_precision=True: "llama3")
    assert choose_sp_backend("auto", structure=False, half_precision=True) == "llama3"
    assert choose_sp_backend("auto", structure=True, half_precision=True) == "torch"
    assert choose_sp_backend("torch", structure=True, half_precision=True) == "torch"
    for backend in ("llama3", "zigzag"):
        with pytest.raises(ConfigError, match=f"sp_backend='{backend}'.*structure ids"):
            choose_sp_backend(backend, structure=True, half_precision=True)


def test_bad_inputs_are_named():
    batch = _batches()[0]
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        shard_batch(batch, 0, 2, "auto")
    with pytest.raises(ValueError, match="sp_rank 2 out of range"):
        shard_batch(batch, 2, 2, "torch")
    with pytest.raises(ValueError, match="needs the contiguous layout"):
        shard_batch(batch, 0, 2, "llama3", layout="zigzag")
    with pytest.raises(ValueError, match="'loss_mask' has no padding rule"):
        shard_batch({**batch, "loss_mask": torch.ones(batch["input_ids"].shape[1])}, 0, 2, "torch")
    with pytest.raises(ValueError, match="structure mode .* needs sp_backend=torch"):
        shard_batch(_batches(structure=True)[0], 0, 2, "zigzag")


@pytest.mark.gpu
def test_flash_backends_refuse_fp32():
    pytest.importorskip("flash_attn")
    pytest.importorskip("ring_flash_attn")
    assert resolve_backend("auto", half_precision=False) == "torch"
    with pytest.raises(SPBackendUnavailable, match="bf16"):
        resolve_backend("llama3", half_precision=False)


# ------------------------------------------------------------------------------ GPU: ring-flash-attn vs torch
def _gpu_qkv(total, heads=4, kv_heads=2, dim=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = lambda h: (1, h, total, dim)  # noqa: E731
    return [torch.randn(shape(h), generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["llama3", "zigzag"])
def test_ring_flash_attn_backends_match_torch_on_one_gpu(backend):
    """sp = 1 on one GPU (a one-process NCCL group): output and q/k/v gradients of the ring-flash-attn kernels
    against the torch reference, on a row of several sequences (bf16 tolerances)."""
    pytest.importorskip("flash_attn")
    pytest.importorskip("ring_flash_attn")
    import torch.distributed as dist

    from train.sequence_parallel import sp_attention

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    batch = _batches()[0]
    module = torch.nn.Module().eval()
    outputs = {}
    for name in ("torch", backend):  # the torch reference in the backend's layout: the same tokens in the same order
        _, ctx = shard_batch(batch, 0, 1, name, group=dist.group.WORLD, layout=BACKEND_LAYOUT[backend])
        ctx = ctx.to("cuda")
        q, k, v = _gpu_qkv(ctx.local_length)
        out = sp_attention(module, q, k, v, ctx, 0.125)
        out.float().square().sum().backward()
        outputs[name] = (out.float(), q.grad.float(), k.grad.float(), v.grad.float())
    for got, want in zip(outputs[backend], outputs["torch"]):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
