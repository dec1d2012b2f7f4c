"""Sequence parallelism: exact equality with sp = 1 (multi-process gloo, CPU), sharding at the data level, backends.

The multi-process checks run once (one spawned world of 4 processes, see tests/_sp_worker.py) and every test below
reads its results: for sp = 4, dp = 2 x sp = 2 and sp = 2, contiguous and zigzag layouts (torch backend), each loss
reduction, the step loss, the per-category sums and every parameter's gradient equal the single-process run.
"""
from __future__ import annotations


import pytest
import torch

from tests._sp_worker import REDUCTIONS, sample_rows, spawned_results, structured_rows, totals_of
from tests._train_helpers import free_port
from train.steps.batch import IGNORE_INDEX, make_batch
from tests._kernels import varlen_attention
from train.attention.function import AttentionContext
from train.plan.attention import choose_ring_backend, choose_varlen_kernel, ring_kernel
from train.attention.sequence_parallel import SP_BACKENDS, TOKEN_PAD_VALUES, SPBackendUnavailable, shard_batch
from train.attention.varlen_kernels import NO_FEATURES
from data.shards.dataset import Structure

WORLD = 4
RTOL = 1e-5
LAYOUTS = ("contiguous", "zigzag")



@pytest.fixture(scope="module")
def sp_results(tmp_path_factory) -> dict:
    from tests._sp_worker import worker

    return spawned_results(worker, WORLD, tmp_path_factory.mktemp("sp"))


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
    # the contiguous layout runs one varlen kernel call (SDPA loop on CPU); zigzag is the boolean-mask reference
    assert result["path"] == ("varlen" if layout == "contiguous" else "mask"), result


def test_gradient_checkpointing_under_sp(sp_results):
    result = sp_results["checkpointing-sp4/contiguous/token"]
    assert result["loss"] < RTOL and result["cat_sum"] < RTOL and result["grad"] < RTOL, result
    assert result["path"] == "varlen", result


@pytest.mark.parametrize("config", ["structure-sp4", "structure-dp2sp2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_structure_mode_equals_full_row_mask(sp_results, config, layout):
    result = sp_results[f"{config}/{layout}/token"]
    assert result["loss"] < RTOL and result["cat_sum"] < RTOL and result["grad"] < RTOL, result
    assert result["cat_count_equal"], result
    assert result["path"] == "mask", result  # the Parallel-R1 mask


@pytest.mark.parametrize("config", ["sp4", "dp2sp2"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shard_without_loss_token_contributes_exactly_zero(sp_results, config, reduction):
    # row 1's last contiguous shard (rank 3) has no loss target; it still ran forward/backward for the others
    assert sp_results[f"{config}/contiguous/{reduction}"]["row1_last_rank_loss"] == 0.0


# ------------------------------------------------------------------------------ sharding at the data level
def _batches(structure: bool = False):
    rows = structured_rows() if structure else sample_rows()
    totals = totals_of(rows)
    kind = Structure.PARALLEL_THINKING if structure else Structure.NONE
    return [make_batch([row], totals, "sample", structure=kind) for row in rows]


def _shards(batch, sp, layout):
    return [shard_batch(batch, r, sp, "torch", layout=layout) for r in range(sp)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_no_loss_token_lost_at_boundaries(layout, sp):
    for batch in _batches():
        shards = _shards(batch, sp, layout)
        trained = sum(int((local["targets"] != IGNORE_INDEX).sum()) for local, _ in shards)
        assert trained == batch.n_loss_tokens == int((batch.targets != IGNORE_INDEX).sum())
        # the same weights, token for token (only reordered), so the weighted sums agree exactly
        local_weights = torch.cat([local["weights"] for local, _ in shards])
        assert torch.equal(local_weights[local_weights > 0].sort().values,
                           batch.weights[batch.weights > 0].sort().values)
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
        assert torch.equal(ctx0.source_index[real], torch.arange(batch.input_ids.shape[1]))
        for name in ("input_ids", "position_ids", "targets", "weights", "target_categories", "seq_ids",
                     *(("block_ids", "path_ids") if structure else ())):
            row = torch.zeros(n, dtype=getattr(batch, name).dtype)
            for local, ctx in shards:
                row[ctx.local_index] = local[name].reshape(-1)
            assert torch.equal(row[real], getattr(batch, name).reshape(-1)), name
            if name in ("targets", "weights"):
                assert (row[~real] == TOKEN_PAD_VALUES[name]).all(), name
        for local, ctx in shards:
            assert local["input_ids"].shape == (1, ctx.local_length)
            assert local["position_ids"].shape == (1, ctx.local_length)
            assert "cu_seqlens" not in local


@pytest.mark.parametrize("sp", [2, 4])
def test_contiguous_padding_is_its_own_sequence(sp):
    batch = _batches()[0]  # 81 tokens
    local, ctx = shard_batch(batch, sp - 1, sp, "torch")
    pad = ctx.padded_length - batch.input_ids.shape[1]
    assert ctx.padded_length % sp == 0 and 0 < pad < sp
    assert ctx.cu_seqlens.tolist() == batch.cu_seqlens.tolist() + [ctx.padded_length]
    assert local["position_ids"][0, -pad:].tolist() == list(range(pad))  # a fresh sequence
    moved = ctx.to("cpu")
    assert torch.equal(moved.cu_seqlens, ctx.cu_seqlens) and moved.local_range == ctx.local_range
    # varlen path: the padding is the last sequence of the last rank, its own queries against its own keys only
    cu_q, cu_k = ctx.bounds.host_cu_q, ctx.bounds.host_cu_k
    assert cu_q[-1] - cu_q[-2] == cu_k[-1] - cu_k[-2] == pad
    # mask path (structure mode uses it in this layout)
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
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
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
    for requested in ("auto", "ulysses"):  # ulysses: the ring across the Ulysses groups of the hybrid
        assert choose_ring_backend(requested, structure=False, half_precision=True) == "torch"
        assert choose_ring_backend(requested, structure=False, half_precision=False) == "torch"
    assert choose_ring_backend("torch", structure=False, half_precision=False) == "torch"
    for backend in ("llama3", "zigzag"):
        with pytest.raises(SPBackendUnavailable, match="ring-flash-attn|flash-attn"):
            choose_ring_backend(backend, structure=False, half_precision=True)
    with pytest.raises(SPBackendUnavailable, match="llama3"):
        shard_batch(_batches()[0], 0, 2, "llama3")


def test_structure_data_picks_the_torch_backend(monkeypatch):
    """`auto` on a GPU with ring-flash-attn picks llama3, whose causal kernels cannot apply the Parallel-R1 mask."""
    import dataclasses

    from common.config import ConfigError

    monkeypatch.setitem(SP_BACKENDS, "llama3", dataclasses.replace(SP_BACKENDS["llama3"], reasons=lambda half: []))
    assert choose_ring_backend("auto", structure=False, half_precision=True) == "llama3"
    assert choose_ring_backend("auto", structure=True, half_precision=True) == "torch"
    assert choose_ring_backend("torch", structure=True, half_precision=True) == "torch"
    for backend in ("llama3", "zigzag"):
        with pytest.raises(ConfigError, match=f"sp_backend='{backend}'.*structure ids"):
            choose_ring_backend(backend, structure=True, half_precision=True)


def test_bad_inputs_are_named():
    batch = _batches()[0]
    with pytest.raises(ValueError, match="choose 'auto' first"):
        shard_batch(batch, 0, 2, "auto")
    with pytest.raises(ValueError, match="sp_rank 2 out of range"):
        shard_batch(batch, 2, 2, "torch")
    with pytest.raises(ValueError, match="needs the contiguous layout"):
        shard_batch(batch, 0, 2, "llama3", layout="zigzag")
    with pytest.raises(ValueError, match="'loss_mask' has no padding rule"):
        shard_batch({**batch.row_fields(), "loss_mask": torch.ones(batch.input_ids.shape[1])}, 0, 2, "torch")
    with pytest.raises(ValueError, match="structure mode .* needs sp_backend=torch"):
        shard_batch(_batches(structure=True)[0], 0, 2, "zigzag")


@pytest.mark.gpu
def test_flash_backends_refuse_fp32():
    pytest.importorskip("flash_attn")
    pytest.importorskip("ring_flash_attn")
    assert choose_ring_backend("auto", structure=False, half_precision=False) == "torch"
    with pytest.raises(SPBackendUnavailable, match="bf16"):
        choose_ring_backend("llama3", structure=False, half_precision=False)


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

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    batch = _batches()[0]
    outputs = {}
    for name in ("torch", backend):  # the torch reference in the backend's layout: the same tokens in the same order
        _, ctx = shard_batch(batch, 0, 1, name, group=dist.group.WORLD, layout=SP_BACKENDS[backend].layout)
        ctx = ctx.to("cuda")
        q, k, v = _gpu_qkv(ctx.local_length)
        kernel = ring_kernel(name, q, NO_FEATURES, structure=False)
        out = kernel.fn(q, k, v, AttentionContext(ctx.cu_seqlens, ctx.max_seqlen, sp=ctx), 0.125, NO_FEATURES, None)
        out.float().square().sum().backward()
        outputs[name] = (out.float(), q.grad.float(), k.grad.float(), v.grad.float())
    for got, want in zip(outputs[backend], outputs["torch"]):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------ torch backend: varlen bounds
def _token_only_batch(lengths: list[int]) -> dict:
    """The least shard_batch needs: a packed row of these sequence lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return {"input_ids": torch.zeros(1, int(cu[-1]), dtype=torch.int64), "cu_seqlens": cu}


def _random_packings(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        n_seqs = int(torch.randint(1, 9, (1,), generator=gen))
        yield torch.randint(1, 40, (n_seqs,), generator=gen).tolist()


def _visible_from_bounds(bounds, n_queries: int, n_keys: int) -> torch.Tensor:
    """[L, K] bool: what a bottom-right aligned causal varlen kernel lets each query see, read off the bounds."""
    visible = torch.zeros(n_queries, n_keys, dtype=torch.bool)
    cu_q, cu_k = bounds.host_cu_q, bounds.host_cu_k
    for qlo, qhi, klo, khi in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        offset = (khi - klo) - (qhi - qlo)
        for i in range(qhi - qlo):
            visible[qlo + i, klo: klo + i + offset + 1] = True
    return visible


@pytest.mark.parametrize("sp", [1, 2, 3, 4, 5])
def test_varlen_bounds_equal_brute_force(sp):
    """For random packings, every rank's bounds let each local query see exactly the keys of its own sequence at or
    before it (padding sequence included), over the key window it reads from the gathered K/V."""
    for lengths in _random_packings(40, seed=sp):
        batch = _token_only_batch(lengths)
        for rank in range(sp):
            _, ctx = shard_batch(batch, rank, sp, "torch")
            bounds, (start, end), (key_lo, key_hi) = ctx.bounds, ctx.local_range, ctx.key_range
            assert end == key_hi and bounds.host_cu_q[-1] == end - start and bounds.host_cu_k[-1] == end - key_lo
            assert bounds.cu_q.tolist() == list(bounds.host_cu_q) and bounds.cu_k.tolist() == list(bounds.host_cu_k)
            q_index, k_index = torch.arange(start, end), torch.arange(key_lo, key_hi)
            seq = ctx.seq_ids
            want = (seq[q_index][:, None] == seq[k_index][None, :]) & (k_index[None, :] <= q_index[:, None])
            assert torch.equal(_visible_from_bounds(bounds, end - start, key_hi - key_lo), want), (lengths, rank)
            # the window starts at the first key any local query sees
            assert want[:, 0].any()


def test_varlen_bounds_only_for_the_varlen_path():
    batch = _batches()[0]
    assert shard_batch(batch, 0, 2, "torch", layout="zigzag")[1].bounds is None  # mask reference of the layout
    assert shard_batch(_batches(structure=True)[0], 0, 2, "torch")[1].bounds is None  # Parallel-R1 mask
    ctx = shard_batch(batch, 1, 2, "torch")[1]
    assert ctx.bounds is not None
    moved = ctx.to("cpu")
    assert moved.bounds.host_cu_k == ctx.bounds.host_cu_k and torch.equal(moved.bounds.cu_k, ctx.bounds.cu_k)


def test_kernel_choice(monkeypatch):
    """The fastest kernel without reasons: on CPU the SDPA loop; flash-attn first, then torch's varlen_attn."""
    from train.attention.varlen_kernels import KERNELS, VarlenKernel

    cpu = torch.empty(0)
    assert choose_varlen_kernel(cpu).name == "sdpa_loop"
    assert choose_varlen_kernel(cpu.bfloat16()).name == "sdpa_loop"
    usable = lambda q, features: []  # noqa: E731
    monkeypatch.setitem(KERNELS, "torch_varlen", VarlenKernel("torch_varlen", usable, KERNELS["torch_varlen"].fn))
    assert choose_varlen_kernel(cpu).name == "torch_varlen"
    monkeypatch.setitem(KERNELS, "flash_attn", VarlenKernel("flash_attn", usable, KERNELS["flash_attn"].fn))
    assert choose_varlen_kernel(cpu).name == "flash_attn"
    assert ring_kernel("torch", cpu, NO_FEATURES, structure=False).name == \
        "all-gathered K/V, one flash_attn varlen call"
    assert ring_kernel("torch", cpu, NO_FEATURES, structure=True).name == \
        "all-gathered K/V, SDPA with the Parallel-R1 mask"


def _full_row_attention(q, k, v, cu, scale):
    """Reference: the whole padded row through the SDPA loop (fp32), q [T, H, D], k/v [T, Hkv, D]."""
    from train.row import Row

    return varlen_attention("sdpa_loop", q, k, v, Row.build(cu.tolist()), scale)


def _row_qkv(total, device, dtype, heads=4, kv_heads=2, seed=0):
    dim = 16 if device == "cpu" else 64  # a head size every flash build has
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads)]


KERNEL_CASES = [
    pytest.param("sdpa_loop", "cpu", id="sdpa_loop-cpu"),
    pytest.param("flash_attn", "cuda", marks=pytest.mark.gpu, id="flash_attn-cuda"),
    pytest.param("torch_varlen", "cuda", marks=pytest.mark.gpu, id="torch_varlen-cuda"),
]


@pytest.mark.parametrize("kernel,device", KERNEL_CASES)
@pytest.mark.parametrize("sp", [2, 4])
def test_rank_slices_through_varlen_kernel_equal_full_row(kernel, device, sp):
    """Each rank's bounds + kernel on its slice of queries against the key window of the (locally built) gathered
    K/V give the full-row output rows of that slice; the K/V gradients summed over ranks (what the all-gather's
    backward does) give the full-row gradients. On CUDA: bf16 kernels against the fp32 reference."""
    from train.attention.varlen_kernels import KERNELS

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if reasons := KERNELS[kernel].reasons(torch.empty(0, device=device, dtype=dtype), NO_FEATURES):
        pytest.skip(f"{kernel}: {'; '.join(reasons)}")
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    grad_tol = tol if device == "cpu" else dict(rtol=5e-2, atol=5e-2)
    for lengths in ([81], [30, 7, 1, 44, 19], [5, 120, 3]):
        batch = _token_only_batch(lengths)
        contexts = [shard_batch(batch, r, sp, "torch")[1].to(device) for r in range(sp)]
        total = contexts[0].padded_length
        q, k, v = (t.requires_grad_() for t in _row_qkv(total, device, torch.float32))
        ref = _full_row_attention(q, k, v, contexts[0].cu_seqlens, 0.25)
        grad_out = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
        got_dk, got_dv = torch.zeros_like(k), torch.zeros_like(v)
        for ctx in contexts:
            (start, end), (key_lo, key_hi) = ctx.local_range, ctx.key_range
            q_local = q.detach()[start:end].to(dtype).requires_grad_()
            k_all, v_all = (t.detach().to(dtype).requires_grad_() for t in (k, v))
            out = varlen_attention(kernel, q_local, k_all[key_lo:key_hi], v_all[key_lo:key_hi], ctx.bounds, 0.25)
            torch.testing.assert_close(out.float(), ref[start:end], **tol)
            out.float().backward(grad_out[start:end])
            torch.testing.assert_close(q_local.grad.float(), ref_grads[0][start:end], **grad_tol)
            got_dk += k_all.grad.float()
            got_dv += v_all.grad.float()
        torch.testing.assert_close(got_dk, ref_grads[1], **grad_tol)
        torch.testing.assert_close(got_dv, ref_grads[2], **grad_tol)


def _fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch's varlen_attn (2.11 signature) on CPU: checks the device offsets it is given, computes with the
    reference kernel from those offsets alone."""
    from train.row import Row

    assert window_size == (-1, 0) and cu_q.dtype == cu_k.dtype == torch.int32
    assert q.shape[1] == k.shape[1] == v.shape[1]  # kv heads repeated: no enable_gqa in this signature
    assert all(t.is_contiguous() for t in (q, k, v))
    bounds = Row.build(cu_q.tolist(), cu_k.tolist())
    assert (max_q, max_k) == (bounds.max_q, bounds.max_k)
    return varlen_attention("sdpa_loop", q, k, v, bounds, scale)


@pytest.mark.parametrize("device,kernel", [
    ("cpu", "sdpa_loop"),
    ("cpu", "torch_varlen"),  # varlen_attn replaced by _fake_varlen_attn: what the gather backend hands the CUDA kernel
    pytest.param("cuda", None, marks=pytest.mark.gpu),  # whatever kernel this GPU has
])
def test_gather_backend_varlen_path_with_local_gather(monkeypatch, device, kernel):
    """The torch gather backend as the plan gives it to a layer (layouts, the K/V stacking, the gather, the kernel
    chosen once) for every rank of sp = 3 in one process: the all-gather is replaced by the full row's K/V with this
    rank's part spliced in."""
    import dataclasses

    import train.attention.sequence_parallel as sequence_parallel
    import train.attention.varlen_kernels as varlen_kernels
    from train.attention.varlen_kernels import VarlenKernel

    if kernel == "torch_varlen":
        fake_api = varlen_kernels._TorchVarlenAPI(_fake_varlen_attn, {"window_size": (-1, 0)}, False, None)
        monkeypatch.setattr(varlen_kernels, "torch_varlen_api", lambda: fake_api)
        monkeypatch.setitem(varlen_kernels.KERNELS, "torch_varlen", varlen_kernels.VarlenKernel(
            "torch_varlen", lambda q, features: [], varlen_kernels.KERNELS["torch_varlen"].fn))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    batch = _token_only_batch([30, 7, 1, 44, 19])
    contexts = [shard_batch(batch, r, 3, "torch")[1].to(device) for r in range(3)]
    q, k, v = _row_qkv(contexts[0].padded_length, device, torch.float32)
    ref = _full_row_attention(q, k, v, contexts[0].cu_seqlens, 0.25)
    full_kv = torch.stack([k, v]).to(dtype)  # [2, T, Hkv, D]: the gathered layout
    planned = ring_kernel("torch", torch.empty(0, device=device, dtype=dtype), NO_FEATURES, structure=False)
    chosen, window_bytes = planned.fn.varlen, []

    def recording_kernel(q, k, v, *args):
        window_bytes.append((k.untyped_storage().nbytes(), v.untyped_storage().nbytes()))
        return chosen.fn(q, k, v, *args)

    layer = dataclasses.replace(planned.fn, varlen=VarlenKernel(chosen.name, chosen.reasons, recording_kernel))
    for ctx in contexts:
        start, end = ctx.local_range

        def local_gather(kv, group, dim, start=start, end=end):
            assert dim == 1 and torch.equal(kv, full_kv[:, start:end])
            return torch.cat([full_kv[:, :start], kv, full_kv[:, end:]], dim=1)

        monkeypatch.setattr(sequence_parallel._GatherSequence, "apply", local_gather)
        as_hf = lambda t: t[start:end].to(dtype).transpose(0, 1).unsqueeze(0)  # noqa: E731  [1, H, L, D]
        attn = AttentionContext(ctx.cu_seqlens, ctx.max_seqlen, sp=ctx)
        out = layer(as_hf(q), as_hf(k), as_hf(v), attn, 0.25, NO_FEATURES, None)
        assert out.shape == (1, end - start, q.shape[1], q.shape[2])
        torch.testing.assert_close(out[0].float(), ref[start:end], **tol)
        # the kernel holds (for backward) the key window's K/V, never the whole gathered row
        window = 2 * (ctx.key_range[1] - ctx.key_range[0]) * k[0].numel() * full_kv.element_size()
        assert window_bytes[-1] == (window, window)
    assert len(window_bytes) == 3
    if kernel is not None:
        assert chosen.name == kernel
