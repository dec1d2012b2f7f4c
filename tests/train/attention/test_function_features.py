"""Per-layer attention features (sliding window, logit softcapping, attention sinks, scaling, dropout): transformers'
own eager attention on each sequence alone against the packed `packsft` path (mistral, gemma2, gpt-oss), the
kernels against a dense reference with bottom-right alignment, keyword-argument checking, backend resolution by
feature, sequence parallelism (in process and a 2-process gloo run) and, on a GPU, the fused backends."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import train.attention.function as attention
from tests._kernels import varlen_attention
from tests._sp_features_worker import SOFTCAP, TINY, WINDOW, tiny_model
from tests._sp_worker import spawned_results
from train.attention import sequence_parallel
from train.attention.function import BACKENDS, AttentionContext, LayerKernels, flex_document_attention, packsft_attention
from train.plan.attention import SPLayout, choose_backend, layer_kinds, packed_kernels, plan_attention, ring_kernel
from train.config.backend_names import ATTENTION_BACKENDS
from train.config.sections import ModelSection, ParallelSection
from train.distributed import Mesh
from train.attention.sequence_parallel import SP_BACKENDS, shard_batch
from train.attention.structured import structure_feature_problems
from train.attention.varlen_kernels import NO_FEATURES, AttentionFeatures, visible_keys
from train.row import Row
from common.config import ConfigError
from data.shards.dataset import Structure

LENGTHS = (7, 11, 5, 9)
RTOL = 1e-5


def _cu(lengths) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _loss_and_grads(model, logits: torch.Tensor, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------- models end to end
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_packed_sdpa_equals_transformers_eager_per_sequence(family):
    """One packed row of 4 sequences through attn_backend=sdpa against the same model's eager attention on each
    sequence alone: logits and every parameter's gradient (sinks included) within 1e-5 relative."""
    model = tiny_model(family).train()
    cu = _cu(LENGTHS)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (1, cu[-1]), generator=gen)
    weights = torch.randn(1, cu[-1], 128, generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    ctx = AttentionContext.for_micro_batch(torch.tensor(cu, dtype=torch.int32), "cpu",
                                           LayerKernels(every=BACKENDS["sdpa"]))
    packed = model(input_ids=ids, position_ids=positions, use_cache=False, packsft=ctx).logits
    got, got_grads = _loss_and_grads(model, packed, weights)

    model.set_attn_implementation("eager")
    alone = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(cu[:-1], cu[1:])], dim=1)
    want, want_grads = _loss_and_grads(model, alone, weights)

    assert _relative(got, want) < RTOL
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert _relative(got_grads[name], grad) < RTOL, name
    if family == "gpt_oss":
        assert any(name.endswith("sinks") and grad.abs().max() > 0 for name, grad in got_grads.items())


def test_layer_kinds_read_from_the_modules():
    """The kinds of attention layer (features without dropout, in order of first appearance) and their layer
    counts; the largest dropout of a kind's layers comes with it."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    assert layer_kinds(tiny_model("mistral")) == ((AttentionFeatures(sliding_window=WINDOW), 2),)
    assert layer_kinds(tiny_model("gemma2")) == ((AttentionFeatures(sliding_window=WINDOW, softcap=SOFTCAP), 1),
                                                 (AttentionFeatures(softcap=SOFTCAP), 1))
    assert layer_kinds(tiny_model("gpt_oss")) == ((AttentionFeatures(sliding_window=WINDOW, has_sinks=True), 1),
                                                  (AttentionFeatures(has_sinks=True), 1))
    # qwen2's config carries a sliding_window that its layers do not use (use_sliding_window=False)
    qwen2 = AutoModelForCausalLM.from_config(Qwen2Config(**{**TINY, "attention_dropout": 0.1}, sliding_window=WINDOW),
                                             attn_implementation="packsft")
    assert layer_kinds(qwen2) == ((AttentionFeatures(dropout=0.1), 2),)


# ---------------------------------------------------------------------------------------------- kernels
def test_window_counts_keys_as_transformers_masks_do():
    """visible_keys (bottom-right aligned) is transformers' sliding-window causal mask with the queries as the tail
    of the keys (its kv-cache offset)."""
    from transformers.masking_utils import add_offsets_to_mask_function, sliding_window_causal_mask_function

    for n_queries, n_keys, window in [(9, 9, 4), (5, 12, 4), (6, 6, 1), (4, 10, 20)]:
        hf = add_offsets_to_mask_function(sliding_window_causal_mask_function(window), n_keys - n_queries, 0)
        want = hf(0, 0, torch.arange(n_queries)[:, None], torch.arange(n_keys)[None, :])
        assert torch.equal(visible_keys(n_queries, n_keys, window, "cpu"), want), (n_queries, n_keys, window)


def _dense_reference(q, k, v, cu_q, cu_k, scale, features: AttentionFeatures, sinks):
    """The whole packed row as one masked product: same sequence, bottom-right causal, window from the query's
    aligned position; softcap on the scaled scores; the sink as one more logit per head."""
    seq_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), torch.tensor(cu_q).diff())
    seq_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), torch.tensor(cu_k).diff())
    offset = (torch.tensor(cu_k).diff() - torch.tensor(cu_q).diff())[seq_q]
    aligned_q = (torch.arange(len(seq_q)) - torch.tensor(cu_q)[seq_q] + offset)[:, None]
    pos_k = (torch.arange(len(seq_k)) - torch.tensor(cu_k)[seq_k])[None, :]
    visible = (seq_q[:, None] == seq_k[None, :]) & (pos_k <= aligned_q)
    if features.sliding_window is not None:
        visible &= pos_k > aligned_q - features.sliding_window
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if features.softcap is not None:
        scores = features.softcap * torch.tanh(scores / features.softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, v)


FEATURE_CASES = [
    pytest.param(AttentionFeatures(sliding_window=3), id="window"),
    pytest.param(AttentionFeatures(sliding_window=1), id="window1"),
    pytest.param(AttentionFeatures(softcap=0.7), id="softcap"),
    pytest.param(AttentionFeatures(has_sinks=True), id="sinks"),
    pytest.param(AttentionFeatures(sliding_window=4, softcap=0.7, has_sinks=True), id="all"),
]


@pytest.mark.parametrize("features", FEATURE_CASES)
@pytest.mark.parametrize("cu_q,cu_k", [([0, 7, 18, 23, 32], None), ([0, 3, 7, 7, 9], [0, 6, 10, 12, 15])])
def test_sdpa_loop_features_match_dense_reference(features, cu_q, cu_k):
    """Forward and the gradients of q, k, v and the sinks, including sequences with extra keys (the SP tail)."""
    torch.manual_seed(0)
    cu_k = cu_k or cu_q
    q = torch.randn(cu_q[-1], 4, 8, requires_grad=True)
    k, v = (torch.randn(cu_k[-1], 2, 8, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, requires_grad=True) if features.has_sinks else None
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    out = varlen_attention("sdpa_loop", q, k, v, Row.build(cu_q, cu_k), 0.5, features, sinks)
    ref = _dense_reference(q, k, v, cu_q, cu_k, 0.5, features, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _library_convention(q, k, v, cu_q, cu_k, scale, window_size, softcap):
    """Causal attention as flash-attn and torch's varlen_attn document their arguments: query i (aligned position
    a = i + Lk - Lq) sees keys a - window_size[0] ..= a (left -1: no limit; causal caps the right side at a);
    softcap 0 = none."""
    seq_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), torch.tensor(cu_q).diff())
    seq_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), torch.tensor(cu_k).diff())
    offset = (torch.tensor(cu_k).diff() - torch.tensor(cu_q).diff())[seq_q]
    aligned = (torch.arange(len(seq_q)) - torch.tensor(cu_q)[seq_q] + offset)[:, None]
    pos_k = (torch.arange(len(seq_k)) - torch.tensor(cu_k)[seq_k])[None, :]
    left = window_size[0]
    visible = (seq_q[:, None] == seq_k[None, :]) & (pos_k <= aligned)
    if left >= 0:
        visible &= pos_k >= aligned - left
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("kernel", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("features", [AttentionFeatures(sliding_window=3), AttentionFeatures(softcap=0.7),
                                      AttentionFeatures(sliding_window=1, softcap=0.7)], ids=str)
def test_fused_kernels_translate_features_into_their_library_conventions(monkeypatch, kernel, features):
    """flash-attn and varlen_attn replaced by CPU stand-ins that compute what their documented arguments mean: the
    window W reaches them as window_size=(W-1, 0) and the softcap as softcap, with bottom-right alignment."""
    import sys
    import types

    from train.attention import varlen_kernels

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0):
        assert causal and dropout_p == 0.0
        calls.append(window_size)
        return _library_convention(q, k, v, cu_q.tolist(), cu_k.tolist(), softmax_scale, window_size, softcap)

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size[1] == 0  # causal
        calls.append(window_size)
        return _library_convention(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, window_size, 0.0)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    fake_api = varlen_kernels._TorchVarlenAPI(varlen_attn, {"window_size": (-1, 0)}, True, None)
    monkeypatch.setattr(varlen_kernels, "torch_varlen_api", lambda: fake_api)
    if kernel == "torch_varlen" and features.softcap is not None:
        assert any("softcap" in r for r in varlen_kernels.KERNELS[kernel].reasons(torch.empty(0), features))
        return
    torch.manual_seed(0)
    cu_q, cu_k = [0, 3, 10, 10, 16], [0, 6, 14, 16, 22]
    q, k, v = torch.randn(cu_q[-1], 4, 8), torch.randn(cu_k[-1], 2, 8), torch.randn(cu_k[-1], 2, 8)
    bounds = Row.build(cu_q, cu_k)
    out = varlen_kernels.KERNELS[kernel].fn(q, k, v, bounds, 0.5, features, None)
    want = varlen_attention("sdpa_loop", q, k, v, bounds, 0.5, features)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    window = features.sliding_window
    if window is not None:
        assert calls == [(window - 1, 0)]
    else:  # flash-attn: its default (causal caps the right side); varlen_attn: its causal window
        assert calls == [(-1, -1) if kernel == "flash_attn" else (-1, 0)]


def test_features_change_the_result():
    """Guards the cases above: each feature changes what plain causal attention gives."""
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    bounds = Row.build([0, 20])
    plain = varlen_attention("sdpa_loop", q, k, v, bounds, 0.5)
    for features in (AttentionFeatures(sliding_window=4), AttentionFeatures(softcap=0.7)):
        assert not torch.allclose(varlen_attention("sdpa_loop", q, k, v, bounds, 0.5, features), plain)
    sinks = AttentionFeatures(has_sinks=True)
    assert not torch.allclose(varlen_attention("sdpa_loop", q, k, v, bounds, 0.5, sinks, torch.zeros(4)), plain)


def test_features_are_validated():
    for bad in (dict(sliding_window=0), dict(sliding_window=2.5), dict(softcap=0.0), dict(dropout=1.0)):
        with pytest.raises(ValueError):
            AttentionFeatures(**bad)
    q = torch.randn(5, 4, 8)
    with pytest.raises(ValueError, match="has_sinks"):
        varlen_attention("sdpa_loop", q, q, q, Row.build([0, 5]), None, AttentionFeatures(has_sinks=True))


# ---------------------------------------------------------------------------------------------- keyword arguments
def _call(**kwargs):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    ctx = AttentionContext.for_micro_batch(torch.tensor([0, 5, 12], dtype=torch.int32), "cpu",
                                           LayerKernels(every=BACKENDS["sdpa"]))
    return packsft_attention(torch.nn.Module().eval(), q, k, v, None, packsft=ctx, **kwargs)[0], ctx


def test_unknown_keyword_argument_is_an_error_naming_it():
    with pytest.raises(TypeError, match="'chunk_size'"):
        _call(scaling=0.3, chunk_size=4)


@pytest.mark.parametrize("name,value", [("is_causal", False), ("output_attentions", True), ("head_mask", 1),
                                        ("cu_seq_lens_q", torch.tensor([0, 12]))])
def test_known_keyword_argument_with_a_value_that_cannot_be_ignored(name, value):
    with pytest.raises(ValueError, match=name):
        _call(**{name: value})


def test_ignorable_keyword_arguments_pass():
    out, _ = _call(position_ids=torch.arange(12)[None], use_cache=False, is_causal=True, output_attentions=False,
                   head_mask=None, output_router_logits=False, output_hidden_states=True, num_items_in_batch=7)
    assert out.shape == (1, 12, 4, 8)


def test_sinks_must_be_one_per_query_head():
    with pytest.raises(ValueError, match="one logit per query head"):
        _call(s_aux=torch.zeros(2))


def test_each_kind_of_layer_runs_the_kernel_planned_for_it(monkeypatch):
    """gemma2 alternates windowed and full layers: `auto` plans a kernel per kind (chosen with the kind's training
    dropout), and a layer runs its kind's kernel in training and in eval, with no choice at the call."""
    calls, sdpa = [], BACKENDS["sdpa"]

    def spy(name):
        return lambda *args: calls.append(name) or sdpa.fn(*args)

    def flex_reasons(query, features):  # as if flex ran here, but for windows
        return ["no window"] if features.sliding_window else []

    monkeypatch.setitem(BACKENDS, "flex", dataclasses.replace(BACKENDS["flex"], fn=spy("flex"), reasons=flex_reasons))
    monkeypatch.setitem(BACKENDS, "sdpa", dataclasses.replace(sdpa, fn=spy("sdpa")))
    kinds = [AttentionFeatures(dropout=0.1, sliding_window=3), AttentionFeatures(dropout=0.1)]
    kernels = packed_kernels("auto", _query(), kinds)
    assert [kernel.name for _, kernel in kernels.by_kind] == ["sdpa", "flex"]
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    ctx = AttentionContext.for_micro_batch(torch.tensor([0, 5, 12], dtype=torch.int32), "cpu", kernels)
    for module in (torch.nn.Module().train(), torch.nn.Module().eval()):
        for window in (None, 3, None):
            packsft_attention(module, q, k, v, None, packsft=ctx, sliding_window=window, dropout=0.1)
    assert calls == ["flex", "sdpa", "flex"] * 2
    assert packed_kernels("sdpa", _query(), kinds) == LayerKernels(every=BACKENDS["sdpa"])  # a named backend: all


def test_dropout_is_zero_outside_training():
    out, _ = _call(dropout=0.5, scaling=0.3)
    ref, _ = _call(scaling=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- backend resolution
def _query():
    return torch.empty((1, 1, 0, 1))


@pytest.fixture
def only_feature_reasons(monkeypatch):
    """Each backend keeps only the reasons the features cause (as if this CPU were a GPU with every kernel)."""
    for name in ATTENTION_BACKENDS:
        real = BACKENDS[name].reasons

        def feature_reasons(query, features, real=real):
            return [r for r in real(query, features) if r not in real(query, NO_FEATURES)]

        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(BACKENDS[name], reasons=feature_reasons))


@pytest.mark.parametrize("features,expected", [
    (AttentionFeatures(sliding_window=8), "flash_varlen"),
    (AttentionFeatures(softcap=30.0, sliding_window=8), "flash_varlen"),
    (AttentionFeatures(has_sinks=True), "flex"),
    (AttentionFeatures(has_sinks=True, sliding_window=8, softcap=30.0), "flex"),
    (AttentionFeatures(has_sinks=True, dropout=0.1), "sdpa"),
])
def test_auto_falls_through_to_a_backend_that_expresses_the_features(only_feature_reasons, features, expected):
    assert choose_backend("auto", _query(), features).name == expected


def test_auto_skips_torch_varlen_for_softcap(monkeypatch, only_feature_reasons):
    monkeypatch.setitem(BACKENDS, "flash_varlen", dataclasses.replace(BACKENDS["flash_varlen"],
                                                                      reasons=lambda q, f: ["not installed"]))
    assert choose_backend("auto", _query(), AttentionFeatures(sliding_window=8)).name == "torch_varlen"
    assert choose_backend("auto", _query(), AttentionFeatures(softcap=30.0)).name == "flex"


@pytest.mark.parametrize("name,features,reason", [
    ("flash_varlen", AttentionFeatures(has_sinks=True), "attention sinks"),
    ("torch_varlen", AttentionFeatures(softcap=30.0), "softcap"),
    ("torch_varlen", AttentionFeatures(has_sinks=True), "attention sinks"),
])
def test_named_backend_refuses_naming_the_feature(only_feature_reasons, name, features, reason):
    with pytest.raises(ConfigError, match=rf"attn_backend={name} cannot run.*{reason}"):
        choose_backend(name, _query(), features)


def _plan(lm, sp_backend="auto", ulysses_size=None, sp_size=None, structure=Structure.NONE):
    """The attention plan of `lm` on CPU fp32, without sequence parallelism when `sp_size` is None (no process
    group: the SP kernels are only chosen here, not run)."""
    layout = None if sp_size is None else SPLayout(sp_size, ulysses_size or 1, "set by the test")
    mesh = Mesh(1, 0, 1, 0, sp_size or 1, 0, None, None, torch.device("cpu"), ulysses_size or 1)
    parallel = ParallelSection(sequence_parallel_size=sp_size or 1, sp_backend=sp_backend)
    return plan_attention(ModelSection(), parallel, layout, mesh, lm, structure)


@pytest.fixture
def ring_flash_attn_usable(monkeypatch):
    """ring-flash-attn's backends report no reasons (as on a GPU with it installed; their kernels are not run)."""
    for name in ("llama3", "zigzag"):
        monkeypatch.setitem(SP_BACKENDS, name, dataclasses.replace(SP_BACKENDS[name], reasons=lambda half: []))


def test_the_plan_reads_the_model_features(only_feature_reasons, ring_flash_attn_usable):
    """The plan reads the model's features: gpt-oss's sinks rule out flash_varlen, a ring-flash-attn sp backend is
    refused before the first step, and the torch gather backend (and Ulysses around the packed path) express them."""
    lm = tiny_model("gpt_oss")
    assert {kernel.name for _, kernel in _plan(lm).train.by_kind} == {"flex"}
    # the ring alone; the ring across the Ulysses groups, named or (sp_backend ulysses) chosen as auto does
    for sp_backend, ulysses in (("llama3", None), ("llama3", 2), ("ulysses", 2)):
        with pytest.raises(ConfigError, match="sp_backend='llama3'.*attention sinks"):
            _plan(lm, sp_backend, ulysses, sp_size=4)
    gather = _plan(lm, "torch", sp_size=4)
    assert [kernel.name for _, kernel in gather.train.by_kind] == ["all-gathered K/V, one sdpa_loop varlen call"] * 2
    pure = _plan(lm, "ulysses", 4, sp_size=4)
    assert pure.ulysses.local == pure.packed and {k.name for _, k in pure.packed.by_kind} == {"flex"}
    assert pure.train.every.name == "ulysses 4"
    hybrid = _plan(lm, "torch", 2, sp_size=4)
    assert hybrid.ring_backend == "torch" and hybrid.ulysses.local == gather.train


def test_the_plan_describes_what_each_kind_runs():
    lm = tiny_model("gemma2")
    assert _plan(lm).describe() == ("attention: sdpa on 1 layer: sliding_window=4, softcap=1.0; 1 layer: "
                                    "softcap=1.0 (attn_backend=auto); no sequence parallelism")
    described = _plan(lm, "torch", sp_size=2).describe()
    assert described.startswith("attention: sequence parallelism torch 2 (set by the test): all-gathered K/V, "
                                "one sdpa_loop varlen call on 1 layer: sliding_window=4, softcap=1.0; 1 layer:")
    described = _plan(lm, "ulysses", 2, sp_size=4).describe()
    assert described.startswith("attention: sequence parallelism hybrid ulysses 2 x torch 2 (set by the test): "
                                "all-to-all of heads, then across the Ulysses groups all-gathered K/V")


def test_sdpa_expresses_everything():
    everything = AttentionFeatures(dropout=0.1, sliding_window=4, softcap=30.0, has_sinks=True)
    assert choose_backend("sdpa", _query(), everything).name == "sdpa"


# ---------------------------------------------------------------------------------------------- flex on CPU
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_window_softcap_sinks_match_sdpa_loop_on_cpu(monkeypatch):
    """Eager FlexAttention (its math reference) with the device check lifted, so its backward runs on CPU: the
    window mask (one BlockMask per window), the softcap score_mod and the sinks through its differentiable lse,
    forward and gradients (sinks included) against the SDPA loop."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)
    built = []
    real_builder = attention.document_block_mask
    monkeypatch.setattr(attention, "document_block_mask", lambda *a: built.append(a[4]) or real_builder(*a))
    torch.manual_seed(0)
    cu = [0, 7, 18, 23, 40]
    ctx = AttentionContext.for_micro_batch(torch.tensor(cu, dtype=torch.int32), "cpu",
                                           LayerKernels(every=BACKENDS["flex"]))
    for features in (AttentionFeatures(sliding_window=4, softcap=0.7), AttentionFeatures(has_sinks=True),
                     AttentionFeatures(sliding_window=4, softcap=0.7, has_sinks=True)):
        q = torch.randn(1, 4, 40, 8, requires_grad=True)
        k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(2))
        sinks = torch.randn(4, requires_grad=True) if features.has_sinks else None
        inputs = [t for t in (q, k, v, sinks) if t is not None]
        out = flex_document_attention(q, k, v, ctx, 0.5, flex_fn=flex.flex_attention, compile_mask=False,
                                      features=features, sinks=sinks)
        ref = varlen_attention("sdpa_loop", *(t[0].transpose(0, 1) for t in (q, k, v)), ctx.bounds, 0.5, features,
                               sinks).unsqueeze(0)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(ref)
        for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert built == [4, None]  # one mask per window, reused across layers of that kind


# ---------------------------------------------------------------------------------------------- sequence parallelism
def _token_only_batch(lengths) -> dict:
    cu = torch.tensor(_cu(lengths), dtype=torch.int32)
    return {"input_ids": torch.zeros(1, int(cu[-1]), dtype=torch.int64), "cu_seqlens": cu}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("features", FEATURE_CASES[2:] + FEATURE_CASES[:1])
def test_sp_torch_backend_features_equal_full_row(monkeypatch, layout, features):
    """The torch gather backend (as the plan gives it to a layer) for every rank of sp = 3 in one process (the
    all-gather replaced by the full row's K/V in gathered order): the varlen path (contiguous) and the mask path
    (zigzag) with window/softcap/sinks give the full row's output, and the sinks' gradients summed over ranks give
    the full row's."""
    lengths = [30, 7, 1, 44, 19]
    contexts = [shard_batch(_token_only_batch(lengths), r, 3, "torch", layout=layout)[1] for r in range(3)]
    torch.manual_seed(0)
    total = contexts[0].padded_length
    q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    sinks = torch.randn(4, requires_grad=True) if features.has_sinks else None
    ref = varlen_attention("sdpa_loop", q, k, v, Row.build(contexts[0].cu_seqlens.tolist()), 0.25, features,
                           sinks)
    grad_out = torch.randn_like(ref)
    ref_sinks_grad = torch.autograd.grad(ref, sinks, grad_out)[0] if sinks is not None else None
    sinks_grad = torch.zeros(4)
    for ctx in contexts:
        order = ctx.gathered_index  # full row in all-gather (rank-major) order
        local = ctx.local_index

        def local_gather(tensor, group, dim, local=local, order=order):
            if dim == 1:  # varlen path: [2, L, Hkv, D] of K and V stacked
                return torch.stack([k, v])[:, order]
            return torch.cat([k, v], dim=1)[order].transpose(0, 1).unsqueeze(0)  # mask path: [1, 2Hkv, T, D]

        monkeypatch.setattr(sequence_parallel._GatherSequence, "apply", local_gather)
        as_hf = lambda t: t[local].transpose(0, 1).unsqueeze(0)  # noqa: E731
        kernel = ring_kernel("torch", as_hf(q), features, structure=False)  # what the plan gives such a layer
        out = kernel.fn(as_hf(q), as_hf(k), as_hf(v), AttentionContext(ctx.cu_seqlens, ctx.max_seqlen, sp=ctx), 0.25,
                        features, sinks)
        torch.testing.assert_close(out[0], ref[local], rtol=1e-5, atol=1e-6)
        if sinks is not None:
            sinks_grad += torch.autograd.grad(out[0], sinks, grad_out[local])[0]
    if sinks is not None:
        torch.testing.assert_close(sinks_grad, ref_sinks_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["llama3", "zigzag"])
def test_ring_backends_refuse_features_before_training(ring_flash_attn_usable, backend):
    problems = SP_BACKENDS[backend].feature_problems
    assert problems(NO_FEATURES) == []
    assert problems(AttentionFeatures(dropout=0.1)) == []
    for features, named in ((AttentionFeatures(sliding_window=4), "sliding_window=4"),
                            (AttentionFeatures(softcap=30.0), "softcap=30.0"),
                            (AttentionFeatures(has_sinks=True), "attention sinks")):
        (problem,) = problems(features)
        assert named in problem and "sp_backend=torch" in problem
    everything = AttentionFeatures(sliding_window=4, softcap=30.0, has_sinks=True)
    assert SP_BACKENDS["torch"].feature_problems(everything) == []
    with pytest.raises(ConfigError, match=rf"sp_backend='{backend}'.*softcap=1.0"):  # the plan asks, at start
        _plan(tiny_model("gemma2"), backend, sp_size=2)


def test_structure_mode_refuses_features():
    assert structure_feature_problems(NO_FEATURES) == []
    (problem,) = structure_feature_problems(AttentionFeatures(has_sinks=True))
    assert "Parallel-R1" in problem and "attention sinks" in problem
    (problem,) = structure_feature_problems(AttentionFeatures(dropout=0.1))
    assert "attention dropout 0.1" in problem
    assert structure_feature_problems(AttentionFeatures(dropout=0.1), sequence_parallel=True) == []
    with pytest.raises(ConfigError, match="Parallel-R1.*attention sinks"):  # the plan asks, at start
        _plan(tiny_model("gpt_oss"), structure=Structure.PARALLEL_THINKING)
    assert _plan(tiny_model("gpt_oss").eval(), "torch", sp_size=2).train.by_kind  # no structure: planned


@pytest.fixture(scope="module")
def sp_feature_results(tmp_path_factory) -> dict:
    from tests._sp_features_worker import worker

    return spawned_results(worker, 2, tmp_path_factory.mktemp("sp_features"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_sp2_torch_backend_equals_eager_per_sequence(sp_feature_results, family, layout):
    """2 gloo processes, sp = 2, torch backend: gemma2 (softcap, alternating window) and gpt-oss (sinks, alternating
    window): step loss and every parameter's gradient (sinks included) equal transformers' eager attention run on
    each sequence alone in one process."""
    result = sp_feature_results[f"{family}/{layout}"]
    assert result["loss"] < RTOL and result["cat_sum"] < RTOL and result["grad"] < RTOL, result
    assert result["path"] == ("varlen" if layout == "contiguous" else "mask"), result


# ---------------------------------------------------------------------------------------------- GPU
GPU_FEATURES = [
    pytest.param(AttentionFeatures(sliding_window=64), id="window"),
    pytest.param(AttentionFeatures(softcap=20.0), id="softcap"),
    pytest.param(AttentionFeatures(sliding_window=64, softcap=20.0), id="window-softcap"),
    pytest.param(AttentionFeatures(sliding_window=64, has_sinks=True), id="window-sinks"),
]


def assert_close_in_norm(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    """||got - want|| / ||want|| <= tolerance: the measure for bf16 against a reference, where single elements near
    zero differ by rounding (seen on an H200: 1 of 262,144 gradient elements 0.051 off, every other within 0.05)."""
    assert torch.isfinite(got).all(), f"{what}: not finite"
    error = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
    assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance:.0e}"


@pytest.mark.gpu
@pytest.mark.parametrize("features", GPU_FEATURES)
@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen", "flex"])
def test_fused_backends_equal_sdpa_reference_on_gpu(backend, features):
    """packsft_attention through each fused backend (bf16) against the sdpa reference in fp32: output and the
    gradients of q, k, v (and sinks) within bf16 tolerance; a backend that cannot express a feature is skipped
    with its reason."""
    probe = torch.empty((1, 1, 0, 1), device="cuda", dtype=torch.bfloat16)
    if reasons := BACKENDS[backend].reasons(probe, features):
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    gen = torch.Generator(device="cuda").manual_seed(0)
    cu = [0, 300, 1000, 1001, 1500, 2048]
    shapes = [(1, 8, cu[-1], 64), (1, 2, cu[-1], 64), (1, 2, cu[-1], 64)]
    inputs = [torch.randn(s, generator=gen, device="cuda") for s in shapes]
    if features.has_sinks:
        inputs.append(torch.randn(8, generator=gen, device="cuda"))
    module = torch.nn.Module().eval()
    outputs = {}
    for name, dtype in ((backend, torch.bfloat16), ("sdpa", torch.float32)):
        leaves = [t.to(dtype).requires_grad_() for t in inputs[:3]] + [t.clone().requires_grad_() for t in inputs[3:]]
        ctx = AttentionContext.for_micro_batch(torch.tensor(cu, dtype=torch.int32), "cuda",
                                               LayerKernels(every=BACKENDS[name]))
        kwargs = dict(sliding_window=features.sliding_window, softcap=features.softcap)
        if features.has_sinks:
            kwargs["s_aux"] = leaves[3]
        out, _ = packsft_attention(module, *leaves[:3], None, scaling=0.125, packsft=ctx, **kwargs)
        out.float().square().sum().backward()
        outputs[name] = [out.float()] + [t.grad.float() for t in leaves]
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), outputs[backend], outputs["sdpa"]):
        assert_close_in_norm(got, want, 2e-2, f"{backend} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_tiny_models_auto_backend_equals_sdpa_on_gpu(family):
    """The tiny models in bf16 on CUDA with attn_backend=auto (whatever each layer resolves to) against sdpa.
    gpt_oss with every expert active: a top-k router flips experts of near-tied tokens under any change of rounding
    (seen on an H200: 1.9% of the logits off by up to 4 with top-2 of 4), which is not what this test is about."""
    overrides = {"num_experts_per_tok": 4} if family == "gpt_oss" else {}
    model = tiny_model(family, **overrides).cuda().to(torch.bfloat16).eval()
    cu = _cu([300, 700, 1, 500])
    ids = torch.randint(1, 128, (1, cu[-1]), device="cuda")
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None].cuda()
    logits = {}
    probe = torch.empty((1, 1, 0, 1), device="cuda", dtype=torch.bfloat16)
    for backend in ("auto", "sdpa"):
        kernels = packed_kernels(backend, probe, [features for features, _ in layer_kinds(model)])
        ctx = AttentionContext.for_micro_batch(torch.tensor(cu, dtype=torch.int32), "cuda", kernels)
        with torch.no_grad():
            logits[backend] = model(input_ids=ids, position_ids=positions, use_cache=False, packsft=ctx).logits.float()
    assert_close_in_norm(logits["auto"], logits["sdpa"], 2e-2, family)


def test_a_layer_that_passes_its_own_mask_is_an_error():
    """packsft registers no mask function, so transformers passes attention_mask=None; a mask that arrives anyway is
    the layer's own (doge's learned dynamic mask) and ignoring it would train another model."""
    import torch

    from train.attention.function import AttentionContext, packsft_attention

    q = torch.zeros(1, 2, 4, 8)
    ctx = AttentionContext(torch.tensor([0, 4], dtype=torch.int32), 4, LayerKernels(every=BACKENDS["sdpa"]))
    with pytest.raises(TypeError, match="got an attention_mask from Linear"):
        packsft_attention(torch.nn.Linear(1, 1), q, q, q, torch.zeros(1, 1, 4, 4), packsft=ctx)


@pytest.mark.parametrize("model_type,softcap", [("gemma2", 0.5), ("gemma3_text", None)])
def test_layer_features_read_the_softcap_the_forward_passes(model_type, softcap):
    """Gemma 3 keeps Gemma 2's attn_logit_softcapping attribute but its forward never passes it: the plan's layer
    kinds must be what packsft_attention receives, or the planned kernel is not found for the layer."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from tests.model_zoo import tiny_config

    config = tiny_config(model_type, attn_logit_softcapping=0.5)
    lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._from_config(config, attn_implementation="packsft")
    assert {f.softcap for f in attention.layer_features(lm)} == {softcap}
    seen = []
    lm.train(False)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    kernels = LayerKernels(every=dataclasses.replace(BACKENDS["sdpa"], fn=lambda q, k, v, ctx, scaling, features, sinks:
                                                     seen.append(features.softcap) or BACKENDS["sdpa"].fn(
                                                         q, k, v, ctx, scaling, features, sinks)))
    with torch.no_grad():
        lm.model(input_ids=torch.randint(3, 50, (1, 9)), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]]),
                 use_cache=False, packsft=AttentionContext(cu, 5, kernels))
    assert set(seen) == {softcap}
