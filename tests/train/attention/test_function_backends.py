"""The attention backend table: selection (auto order, reasons, explicit names), the [1,H,T,D] -> [T,H,D] ->
[1,T,H,D] layout plumbing through the real trainer with CUDA kernels simulated on CPU, no host sync per layer, the
flex document mask on CPU (forward), and each backend against the SDPA loop on a GPU (`gpu`)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import train.attention.function as attention
from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    one_thread,
    random_rows,
    save_tiny_model,
    tiny_model,
    write_config,
    write_packed,
)
from train.attention import varlen_kernels
from train.attention.function import (
    BACKENDS,
    AttentionContext,
    LayerKernels,
    flex_bucket_length,
    flex_document_attention,
    packsft_attention,
)
from train.plan.attention import choose_backend
from train.config.backend_names import ATTENTION_BACKENDS
from train.attention.varlen_kernels import KERNELS, NO_FEATURES, AttentionFeatures, VarlenKernel
from common.config import ConfigError

RTOL = 1e-5


def _query(device="cpu", dtype=torch.float32):
    return torch.empty((1, 1, 0, 1), device=device, dtype=dtype)


def _usable(monkeypatch, *names):
    """Make the named backends report no reasons (their kernels are not run)."""
    for name in names:
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], reasons=lambda q, d: []))


# ---------------------------------------------------------------------------------------------- selection
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_is_sdpa_on_cpu(dtype):
    assert choose_backend("auto", _query(dtype=dtype)).name == "sdpa"


@pytest.mark.parametrize(
    "usable,expected",
    [(("flash_varlen", "torch_varlen", "flex"), "flash_varlen"), (("torch_varlen", "flex"), "torch_varlen"),
     (("flex",), "flex"), ((), "sdpa")],
)
def test_auto_takes_the_first_usable_backend_in_order(monkeypatch, usable, expected):
    _usable(monkeypatch, *usable)
    assert ATTENTION_BACKENDS == tuple(BACKENDS) == ("flash_varlen", "torch_varlen", "flex", "sdpa")
    assert choose_backend("auto", _query()).name == expected


def test_auto_skips_inexact_backends(monkeypatch):
    _usable(monkeypatch, "flash_varlen", "torch_varlen")
    monkeypatch.setitem(BACKENDS, "flash_varlen", dataclasses.replace(BACKENDS["flash_varlen"], exact=False))
    assert choose_backend("auto", _query()).name == "torch_varlen"


def test_kernel_reasons_come_from_the_kernel_table(monkeypatch):
    """The varlen backends ask train.attention.varlen_kernels.KERNELS at call time (one source of truth)."""
    monkeypatch.setitem(KERNELS, "torch_varlen", dataclasses.replace(KERNELS["torch_varlen"], reasons=lambda q, d: []))
    assert choose_backend("auto", _query()).name == "torch_varlen"


@pytest.mark.parametrize("name,reason", [("flash_varlen", "CUDA"), ("torch_varlen", "CUDA"), ("flex", "CUDA")])
def test_named_backend_that_cannot_run_raises_its_reasons(name, reason):
    with pytest.raises(ConfigError, match=rf"attn_backend={name} cannot run on cpu.*{reason}.*attn_backend=auto"):
        choose_backend(name, _query())


def test_dropout_is_a_reason_for_kernels_without_dropout(monkeypatch):
    q, dropout = _query(), AttentionFeatures(dropout=0.1)
    assert any("dropout" in r for r in BACKENDS["flex"].reasons(q, dropout))
    assert any("dropout" in r for r in BACKENDS["torch_varlen"].reasons(q, dropout))
    assert choose_backend("auto", q, dropout).name == "sdpa"


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        choose_backend("xformers", _query())


# ---------------------------------------------------------------------------------------------- layouts in the trainer
def _stand_in(name: str, calls: list):
    """A CUDA kernel simulated on CPU: checks the varlen layout it is given, then runs the SDPA loop."""

    def fn(q, k, v, bounds, scale, features, sinks):
        assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == bounds.host_cu_q[-1]
        assert q.shape[1] % k.shape[1] == 0 and q.shape[2] == k.shape[2] == v.shape[2]
        assert bounds.cu_q.dtype == torch.int32 and bounds.cu_q.device == q.device
        calls.append((tuple(q.shape), tuple(k.shape), bounds.host_cu_q))
        return varlen_kernels._sdpa_loop(q, k, v, bounds, scale, features, sinks)

    return VarlenKernel(name, lambda q, features: [], fn)


def _one_step(tmp_path, tag, rows, **cfg_values):
    from train.config.sections import load_config
    from train.trainer import Trainer

    data = tmp_path / "data"
    if not data.exists():
        write_packed(data, rows)
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        save_tiny_model(model_dir)
    cfg = write_config(tmp_path / f"{tag}.yaml", data_path=str(data), model_path=str(model_dir),
                       output_dir=str(tmp_path / f"out_{tag}"), lr=1e-3, max_grad_norm=0.0, loss_chunk_size=8,
                       plot=False, max_steps=1, grad_accum=2, self_check=False, **cfg_values)
    trainer = Trainer(load_config(cfg), console=lambda *_: None)
    grads = {}
    trainer.grad_hook = lambda tr: grads.update(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    )
    record = trainer.train_step(trainer.sampler.plan(0))
    return trainer, record, grads


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend,kernel", [("torch_varlen", "torch_varlen"), ("flash_varlen", "flash_attn")])
def test_trainer_through_a_simulated_cuda_kernel_equals_sdpa(tmp_path, monkeypatch, backend, kernel):
    rows = random_rows(11, 2)
    _, ref, ref_grads = _one_step(tmp_path, "sdpa", rows, attn_backend="sdpa")
    calls = []
    monkeypatch.setitem(KERNELS, kernel, _stand_in(kernel, calls))
    trainer, got, grads = _one_step(tmp_path, backend, rows, attn_backend="auto" if backend == "flash_varlen" else backend)
    assert trainer.plan.attention.train.for_layer(NO_FEATURES).name == backend  # auto picks flash_varlen first when it can run
    n_layers = trainer.lm.config.num_hidden_layers
    assert len(calls) == 2 * n_layers  # one call per layer per micro-batch (2 micro-batches)
    (q_shape, k_shape, cu), lengths = calls[0], [sum(len(s["input_ids"]) for s in r) for r in rows]
    assert q_shape == (cu[-1], 4, 16) and k_shape == (cu[-1], 2, 16) and cu[-1] in lengths
    assert got["loss"] == ref["loss"] and got["category_loss"] == ref["category_loss"]
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- no host sync per layer
class _SyncCounter:
    METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch, fail: bool):
        self.count = 0
        for method in self.METHODS:
            real = getattr(torch.Tensor, method)

            def spy(self_tensor, *args, _real=real, _method=method):
                if fail:
                    raise AssertionError(f"host sync inside the attention function: Tensor.{_method}")
                self.count += 1
                return _real(self_tensor, *args)

            monkeypatch.setattr(torch.Tensor, method, spy)


@pytest.mark.parametrize("backend", ["sdpa", "torch_varlen"])
def test_attention_function_never_reads_tensors_on_the_host(monkeypatch, backend):
    monkeypatch.setitem(KERNELS, "torch_varlen", _stand_in("torch_varlen", []))
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    ctx = AttentionContext.for_micro_batch(torch.tensor([0, 5, 12, 13], dtype=torch.int32), "cpu",
                                           LayerKernels(every=BACKENDS[backend]))
    module = torch.nn.Module().eval()
    with monkeypatch.context() as guarded:
        _SyncCounter(guarded, fail=True)
        for _ in range(3):  # every layer of a micro-batch
            out, _ = packsft_attention(module, q, k, v, None, scaling=0.3, packsft=ctx)
    ref = varlen_kernels._sdpa_loop(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), ctx.bounds,
                                    0.3)
    torch.testing.assert_close(out[0], ref)


def test_host_reads_of_a_forward_do_not_grow_with_layers(monkeypatch):
    """Whatever transformers reads on the host per forward, the attention adds nothing per layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    counts = []
    for n_layers in (1, 3):
        cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=n_layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = Qwen2ForCausalLM._from_config(cfg, attn_implementation="packsft", dtype=torch.float32).eval()
        ids, pos = torch.randint(0, 97, (1, 12)), torch.tensor([[0, 1, 2, 3, 4, *range(7)]])
        ctx = AttentionContext.for_micro_batch(torch.tensor([0, 5, 12], dtype=torch.int32), "cpu",
                                               LayerKernels(every=BACKENDS["sdpa"]))
        with monkeypatch.context() as m:
            counter = _SyncCounter(m, fail=False)
            model.model(input_ids=ids, position_ids=pos, use_cache=False, packsft=ctx)
        counts.append(counter.count)
    assert counts[0] == counts[1], counts


# ---------------------------------------------------------------------------------------------- flex
@pytest.mark.parametrize("total,padded", [(1, 128), (128, 128), (129, 256), (4000, 4096), (32700, 32768),
                                          (32769, 36864), (131000, 131072)])
def test_flex_buckets(total, padded):
    assert flex_bucket_length(total) == padded
    granule = max(128, (1 << (total - 1).bit_length()) // 16)
    assert padded % granule == 0 and 0 <= padded - total < granule
    if total >= 16 * 128:  # beyond the minimum granule: at most 1/16 of the next power of two padded
        assert (padded - total) / total <= 1 / 8


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_document_mask_matches_sdpa_loop_on_cpu(monkeypatch):
    """Forward only (FlexAttention's backward is CUDA-only here), eager flex and an uncompiled mask: the mask
    (same sequence, causal, padding in its own document) and the padding/slicing."""
    from torch.nn.attention.flex_attention import flex_attention

    built = []
    real_builder = attention.document_block_mask
    monkeypatch.setattr(attention, "document_block_mask", lambda *a: built.append(a[1]) or real_builder(*a))
    torch.manual_seed(0)
    cu = [0, 5, 12, 13, 40]
    q, k, v = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    ctx = AttentionContext.for_micro_batch(torch.tensor(cu, dtype=torch.int32), "cpu",
                                           LayerKernels(every=BACKENDS["flex"]))
    outs = [flex_document_attention(q, k, v, ctx, 0.3, flex_fn=flex_attention, compile_mask=False) for _ in range(2)]
    assert built == [128]  # one mask per micro-batch, at the bucketed length
    ref = varlen_kernels._sdpa_loop(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), ctx.bounds,
                                    0.3)
    assert outs[0].shape == (1, 40, 4, 8)
    torch.testing.assert_close(outs[0][0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def example_packed(tmp_path_factory) -> str:
    """Real packed rows: the embedded example (chat, math, code, tool records, 2K rows) through the pipeline."""
    from benchmarks.bench_train_gpu import build_packed

    return str(build_packed(tmp_path_factory.mktemp("example_data"), 2048, fixtures=None, smoke=True))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_varlen", "flex", "flash_varlen"])
def test_backend_losses_equal_sdpa_on_gpu(tmp_path, example_packed, backend):
    """Four bf16 trainer steps per backend (the example's tiny Qwen2, real packed rows) against the SDPA loop:
    losses equal within bf16 tolerance."""
    probe = torch.empty((1, 1, 0, 1), device="cuda", dtype=torch.bfloat16)
    if reasons := BACKENDS[backend].reasons(probe, NO_FEATURES):
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    from tests._train_helpers import ROOT
    from train.config.sections import load_config
    from train.trainer import Trainer

    losses = {}
    for name in ("sdpa", backend):
        cfg = write_config(tmp_path / f"{name}.yaml", data_path=example_packed,
                           model_config=str(ROOT / "configs/model/tiny_qwen2.json"),
                           output_dir=str(tmp_path / f"out_{name}"), lr=1e-3, bf16=True, plot=False, max_steps=4,
                           attn_backend=name)
        trainer = Trainer(load_config(cfg), console=lambda *_: None)
        assert trainer.plan.attention.train.for_layer(NO_FEATURES).name == name
        losses[name] = [trainer.train_step(trainer.sampler.plan(s))["loss"] for s in range(4)]
    np.testing.assert_allclose(losses[backend], losses["sdpa"], rtol=2e-2)
