"""Varlen kernels: the SDPA reference against a dense masked product, the torch probe, CUDA kernels vs reference."""
import pytest
import torch

from tests._kernels import varlen_attention
from train.plan.attention import choose_varlen_kernel
from train.attention.varlen_kernels import KERNELS, NO_FEATURES, AttentionFeatures, torch_varlen_api
from train.row import Row


def _dense_reference(q, k, v, cu_q, cu_k, scale):
    """One masked product over all tokens: key j is visible to query i iff same sequence and bottom-right causal."""
    seq_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), torch.tensor(cu_q).diff())
    seq_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), torch.tensor(cu_k).diff())
    pos_q = torch.arange(len(seq_q)) - torch.tensor(cu_q)[seq_q]
    pos_k = torch.arange(len(seq_k)) - torch.tensor(cu_k)[seq_k]
    offset = (torch.tensor(cu_k).diff() - torch.tensor(cu_q).diff())[seq_q]
    visible = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None] + offset[:, None])
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "cu_q,cu_k",
    [([0, 5, 12, 13], None), ([0, 3, 7, 7, 9], [0, 6, 10, 12, 15])],  # causal; extra keys (SP tail) and an empty query span
)
def test_sdpa_loop_matches_dense_masked_attention(cu_q, cu_k):
    torch.manual_seed(0)
    tq, tk = cu_q[-1], (cu_k or cu_q)[-1]
    q, k, v = torch.randn(tq, 4, 8), torch.randn(tk, 2, 8), torch.randn(tk, 2, 8)
    bounds = Row.build(cu_q, cu_k)
    out = varlen_attention("sdpa_loop", q, k, v, bounds, scale=0.3)
    torch.testing.assert_close(out, _dense_reference(q, k, v, cu_q, cu_k or cu_q, 0.3), rtol=1e-5, atol=1e-6)


def test_bounds_reject_fewer_keys_than_queries():
    with pytest.raises(ValueError, match="at least as many keys"):
        Row.build([0, 4], [0, 3])


def test_cuda_kernels_give_reasons_on_cpu():
    q = torch.randn(4, 2, 8)
    for name in ("flash_attn", "torch_varlen"):
        assert any("CUDA" in r for r in KERNELS[name].reasons(q, NO_FEATURES))
    assert any("dropout" in r for r in KERNELS["torch_varlen"].reasons(q, AttentionFeatures(dropout=0.1)))
    assert choose_varlen_kernel(q) is KERNELS["sdpa_loop"]  # the gather backend's kernel here


def test_torch_varlen_probe_reads_this_torch():
    api = torch_varlen_api()
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        assert api.problem and api.fn is None
        return
    assert api.problem is None and api.causal_kwargs in ({"window_size": (-1, 0)}, {"is_causal": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["torch_varlen", "flash_attn"])
@pytest.mark.parametrize("cu_q,cu_k", [([0, 300, 1000, 1001, 2048], None), ([0, 100, 356, 700], [0, 400, 656, 1200])])
def test_cuda_kernel_matches_reference(name, cu_q, cu_k):
    q0 = torch.randn(cu_q[-1], 14, 64, device="cuda")
    if reasons := KERNELS[name].reasons(q0.bfloat16(), NO_FEATURES):
        pytest.skip(f"{name}: " + "; ".join(reasons))
    tk = (cu_k or cu_q)[-1]
    q, k, v = (t.bfloat16().requires_grad_() for t in (q0, torch.randn(tk, 2, 64, device="cuda"), torch.randn(tk, 2, 64, device="cuda")))
    bounds = Row.build(cu_q, cu_k, device="cuda")
    out = varlen_attention(name, q, k, v, bounds, scale=0.125)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = varlen_attention("sdpa_loop", *ref_inputs, bounds, scale=0.125)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    grad = torch.randn_like(ref)
    out.float().backward(grad)
    ref.backward(grad)
    for got, want in zip((q, k, v), ref_inputs):
        torch.testing.assert_close(got.grad.float(), want.grad, rtol=5e-2, atol=5e-2)
