"""train.model.loss: the chunked lm-head + cross-entropy equals the unchunked computation, values and gradients."""
import copy

import numpy as np
import pytest
import torch

from train.steps.batch import IGNORE_INDEX, make_batch, step_totals
import train.model.loss
from train.model.loss import LMHead, chunk_ce_grad, eager_chunk_ce_grad, weighted_lm_loss

REDUCTIONS = ("token", "turn", "sample")
VOCAB, HIDDEN, N_CAT = 96, 16, 4


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def packed_micro_batch(reduction, seed=0):
    """One micro-batch of 2 rows, 3 sequences, multi-turn, 20 loss tokens (of 31), with the step weights of a
    step that also holds a second micro-batch (so the weights do not sum to 1 here)."""
    rng = np.random.default_rng(seed)

    def seq(segments):
        ids, labels, cats, turns, turn = [], [], [], [], 0
        for n, trained, cat in segments:
            x = rng.integers(0, VOCAB, size=n)
            ids.append(x)
            cats.append(np.full(n, cat))
            turn += trained
            labels.append(x if trained else np.full(n, IGNORE_INDEX))
            turns.append(np.full(n, turn if trained else 0))
        return {k: np.concatenate(v) for k, v in
                dict(input_ids=ids, labels=labels, category_ids=cats, turn_ids=turns).items()}

    def row(seqs):
        r = {k: np.concatenate([s[k] for s in seqs]) for k in seqs[0]}
        r["seq_lens"] = np.array([len(s["input_ids"]) for s in seqs])
        return r

    rows = [
        row([seq([(2, False, 1), (5, True, 1), (2, False, 1), (4, True, 3)]), seq([(3, False, 2), (6, True, 2)])]),
        row([seq([(4, False, 0), (5, True, 0)])]),
        row([seq([(2, False, 1), (7, True, 1)])]),  # the other micro-batch of the step
    ]

    class Meta:
        row_n_loss_tokens = np.array([15, 5, 7])
        row_n_trained_turns = np.array([3, 1, 1])
        row_n_samples = np.array([2, 1, 1])

    totals = step_totals(Meta, [0, 1, 2])
    return make_batch(rows[:2], totals, reduction)


def random_inputs(batch, dtype=torch.float32, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = batch.targets.shape[0]
    hidden = torch.randn(n, HIDDEN, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(VOCAB, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b


def run(batch, hidden, weight, bias, chunk_size, **options):
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    out = weighted_lm_loss(hidden, weight, batch.targets, batch.weights, batch.target_categories, N_CAT,
                           chunk_size, lm_head_bias=bias, **options)
    out[0].backward()
    grads = [None if t is None else t.grad.clone() for t in (hidden, weight, bias)]
    return [o.detach() for o in out], grads


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("chunk_size", [1, 5, 7, 10_000])  # 20 loss tokens: 5 divides, 7 does not
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_unchunked(reduction, chunk_size, bias):
    batch = packed_micro_batch(reduction)
    assert batch.n_loss_tokens == 20
    hidden, weight, b = random_inputs(batch, bias=bias)
    (ref_sum, ref_cat, ref_cnt), ref_grads = run(batch, hidden, weight, b, None)
    (got_sum, got_cat, got_cnt), got_grads = run(batch, hidden, weight, b, chunk_size)
    assert rel_err(got_sum, ref_sum) < 1e-6
    assert rel_err(got_cat, ref_cat) < 1e-6 and torch.equal(got_cnt, ref_cnt)
    for got, ref in zip(got_grads, ref_grads):
        if ref is not None:
            assert rel_err(got, ref) < 1e-5
    # grads at positions without a target are exactly zero
    assert torch.count_nonzero(got_grads[0][batch.targets == IGNORE_INDEX]) == 0


HEADS = {"plain": LMHead(), "scale": LMHead(scale=0.37), "softcap": LMHead(softcap=3.0),
         "scale+softcap": LMHead(scale=2.5, softcap=4.0)}


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_chunk_expression_equals_in_place_loop(head, bias):
    """chunk_ce_grad (what torch.compile fuses) and eager_chunk_ce_grad (in place) compute the same ce, gradient and
    bias gradient for every head transform."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, VOCAB, generator=g) * 4
    targets = torch.randint(0, VOCAB, (9,), generator=g)
    row_scale = torch.rand(9, generator=g)
    b = torch.randn(VOCAB, generator=g) if bias else None
    h = HEADS[head]
    fused = chunk_ce_grad(logits, targets, row_scale, b, h.scale, h.softcap, True, bias)
    eager = eager_chunk_ce_grad(logits.clone(), targets, row_scale, b, h.scale, h.softcap, True, bias)
    for got, ref in zip(fused, eager):
        if ref is None:
            assert got is None
        else:
            assert rel_err(got, ref) < 1e-6
    ce_only = chunk_ce_grad(logits, targets, row_scale, b, h.scale, h.softcap, False, False)
    assert ce_only[1] is None and rel_err(ce_only[0], eager[0]) < 1e-6


@pytest.mark.parametrize("chunk_size", [5, 7])
def test_fused_loss_equals_reference(monkeypatch, chunk_size):
    """fused=True: the compiled chunk function (graph-captured here with aot_eager: the CPU has no fast inductor
    build in the suite's budget; the gpu test below runs inductor) gives the reference loss, categories and
    gradients, over chunks of two sizes (dynamic shapes)."""
    monkeypatch.setattr(train.model.loss, "_compiled_chunk_ce_grad",
                        torch.compile(chunk_ce_grad, dynamic=True, backend="aot_eager"))
    batch = packed_micro_batch("turn")
    hidden, weight, b = random_inputs(batch, bias=True)
    (ref_sum, ref_cat, ref_cnt), ref_grads = run(batch, hidden, weight, b, None)
    (got_sum, got_cat, got_cnt), got_grads = run(batch, hidden, weight, b, chunk_size, fused=True)
    assert rel_err(got_sum, ref_sum) < 1e-6
    assert rel_err(got_cat, ref_cat) < 1e-6 and torch.equal(got_cnt, ref_cnt)
    for got, ref in zip(got_grads, ref_grads):
        assert rel_err(got, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("head", ["plain", "scale+softcap"])
def test_fused_loss_equals_eager_chunks_on_gpu(head):
    """Inductor's fused chunk on CUDA in bf16 (a 32K vocabulary, chunks of 1,000): the loss equal to the eager
    chunked loss within fp32 rounding, the gradients within bf16 rounding of the same values."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, vocab, hid = 2500, 32000, 256
    hidden = torch.randn(n, hid, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hid, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    targets[::7] = IGNORE_INDEX
    weights = torch.rand(n, device="cuda", generator=g)
    cats = torch.zeros(n, dtype=torch.long, device="cuda")
    results = []
    for fused in (False, True):
        hidden.grad = weight.grad = None
        out = weighted_lm_loss(hidden, weight, targets, weights, cats, 1, 1000, head=HEADS[head], fused=fused)
        out[0].backward()
        results.append((out[0].detach(), hidden.grad.clone(), weight.grad.clone()))
    (ref_loss, ref_gh, ref_gw), (loss, gh, gw) = results
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(gh, ref_gh) < 1e-2 and rel_err(gw, ref_gw) < 1e-2


def test_reference_matches_definition():
    """The unchunked path itself: sum_t w_t * (logsumexp(logits_t) - logits_t[target_t]), per-category sums."""
    batch = packed_micro_batch("turn")
    hidden, weight, _ = random_inputs(batch)
    out = weighted_lm_loss(hidden, weight, batch.targets, batch.weights, batch.target_categories, N_CAT, 0)
    logits = (hidden @ weight.t()).double()
    valid = batch.targets != IGNORE_INDEX
    t = batch.targets[valid]
    ce = (torch.logsumexp(logits[valid], -1) - logits[valid].gather(1, t[:, None]).squeeze(1)).detach()
    assert out[0].detach().item() == pytest.approx(float((ce * batch.weights[valid].double()).sum()), rel=1e-6)
    cats = batch.target_categories[valid]
    for c in range(N_CAT):
        assert out[1][c].item() == pytest.approx(float(ce[cats == c].sum()), rel=1e-6, abs=1e-9)
        assert out[2][c].item() == int((cats == c).sum())
    assert out[2].tolist() == [5, 5, 6, 4]


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_no_loss_tokens_gives_exact_zeros(chunk_size):
    batch = packed_micro_batch("sample")
    targets = torch.full_like(batch.targets, IGNORE_INDEX)
    weights = torch.zeros_like(batch.weights)
    hidden, weight, _ = random_inputs(batch)
    s, cat, cnt = weighted_lm_loss(hidden, weight, targets, weights, batch.target_categories, N_CAT, chunk_size)
    s.backward()
    assert s.item() == 0.0 and torch.count_nonzero(cat) == 0 and torch.count_nonzero(cnt) == 0
    for g in (hidden.grad, weight.grad):
        assert torch.isfinite(g).all() and torch.count_nonzero(g) == 0


def test_backward_scales_with_the_incoming_gradient():
    """The trainer multiplies the loss by the world size: saved gradients must be scaled, not reused as is."""
    batch = packed_micro_batch("token")
    hidden, weight, _ = random_inputs(batch)
    _, ref_grads = run(batch, hidden, weight, None, 6)
    hidden.grad = weight.grad = None
    s, _, _ = weighted_lm_loss(hidden, weight, batch.targets, batch.weights, batch.target_categories, N_CAT, 6)
    (s * 3.0).backward()
    assert rel_err(hidden.grad, 3 * ref_grads[0]) < 1e-6 and rel_err(weight.grad, 3 * ref_grads[1]) < 1e-6
    s, _, _ = weighted_lm_loss(hidden, weight, batch.targets, batch.weights, batch.target_categories, N_CAT, 6)
    s.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):  # saved gradients were scaled in place: no silent reuse
        s.backward()


def test_frozen_head_saves_no_weight_gradient():
    """LoRA freezes the lm head: no fp32 [V, H] gradient is computed or kept, the hidden gradient is unchanged
    (and a frozen hidden with a trained head keeps no [T, H] buffer)."""
    batch = packed_micro_batch("token")
    hidden, weight, bias = random_inputs(batch, bias=True)
    _, ref_grads = run(batch, hidden, weight, bias, 6)
    saved = []

    def loss_saving_shapes(h, w, b):
        def pack(t):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            s, _, _ = weighted_lm_loss(h, w, batch.targets, batch.weights, batch.target_categories, N_CAT, 6,
                                       lm_head_bias=b)
        return s

    hidden.grad = None
    loss_saving_shapes(hidden, weight.detach(), bias.detach()).backward()
    assert saved == [tuple(hidden.shape)]  # grad_hidden only: no [V, H] / [V] fp32 buffers
    assert rel_err(hidden.grad, ref_grads[0]) < 1e-6
    saved.clear()
    weight.grad = None
    loss_saving_shapes(hidden.detach(), weight, bias.detach()).backward()
    assert saved == [(VOCAB, HIDDEN)] and rel_err(weight.grad, ref_grads[1]) < 1e-6


def test_no_grad_mode_computes_values_only():
    batch = packed_micro_batch("token")
    hidden, weight, _ = random_inputs(batch)
    with torch.no_grad():
        s, cat, _ = weighted_lm_loss(hidden, weight, batch.targets, batch.weights, batch.target_categories,
                                     N_CAT, 3)
        ref, ref_cat, _ = weighted_lm_loss(hidden, weight, batch.targets, batch.weights,
                                           batch.target_categories, N_CAT, None)
    assert not s.requires_grad and rel_err(s, ref) < 1e-6 and rel_err(cat, ref_cat) < 1e-6


def test_bf16_inputs_close_to_fp32():
    batch = packed_micro_batch("token")
    h32, w32, _ = random_inputs(batch)
    (ref, _, _), (gh32, gw32, _) = run(batch, h32, w32, None, None)
    h16 = h32.detach().bfloat16().requires_grad_()
    w16 = w32.detach().bfloat16().requires_grad_()
    (got, _, _), (gh16, gw16, _) = run(batch, h16, w16, None, 8)
    assert got.dtype == torch.float32 and gh16.dtype == torch.bfloat16 and gw16.dtype == torch.bfloat16
    assert rel_err(got, ref) < 2e-2 and rel_err(gh16, gh32) < 3e-2 and rel_err(gw16, gw32) < 3e-2


def test_autocast_runs_matmuls_in_autocast_dtype():
    """fp32 weights under bf16 autocast (the trainer's GPU mode without DeepSpeed): like F.linear would."""
    batch = packed_micro_batch("sample")
    hidden, weight, bias = random_inputs(batch, bias=True)
    results = {}
    for chunk_size in (None, 6):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[chunk_size] = run(batch, hidden, weight, bias, chunk_size)
    (ref, _, _), ref_grads = results[None]
    (got, _, _), got_grads = results[6]
    assert all(g.dtype == torch.float32 for g in got_grads)
    assert rel_err(got, ref) < 1e-2
    for g, r in zip(got_grads, ref_grads):
        assert rel_err(g, r) < 2e-2
    (exact, _, _), _ = run(batch, hidden, weight, bias, 6)
    assert rel_err(got, exact) > 1e-6  # the matmuls did run in bf16


def test_bad_inputs_are_clear_errors():
    batch = packed_micro_batch("token")
    hidden, weight, _ = random_inputs(batch)
    t, w, c = batch.targets, batch.weights, batch.target_categories
    with pytest.raises(ValueError, match="category"):
        weighted_lm_loss(hidden, weight, t, w, c, 2, 4)
    with pytest.raises(ValueError, match="targets must lie"):
        weighted_lm_loss(hidden, weight[:10], t, w, c, N_CAT, 4)
    with pytest.raises(ValueError, match=r"weights must be"):
        weighted_lm_loss(hidden, weight, t, w[:-1], c, N_CAT, 4)


# ---------------------------------------------------------------- whole model: every parameter's gradient
def tiny_qwen2(tie):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def models():
    return {tie: tiny_qwen2(tie) for tie in (False, True)}


def model_step(model, batch, chunk_size, seq):
    """Loss of one unpacked sequence `seq` (slice of the batch) from the model's hidden states, then backward."""
    model.zero_grad(set_to_none=True)
    ids = batch.input_ids[:, seq]
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    s, _, _ = weighted_lm_loss(hidden[0], model.lm_head.weight, batch.targets[seq], batch.weights[seq],
                               batch.target_categories[seq], N_CAT, chunk_size)
    s.backward()
    return s.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_model_gradients_chunked_equal_unchunked(models, tie, reduction):
    model = models[tie]
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = packed_micro_batch(reduction)
    seq = slice(0, 13)  # the first packed sequence alone (default attention, no packing)
    ref, ref_grads = model_step(model, batch, None, seq)
    got, got_grads = model_step(model, batch, 4, seq)  # 9 loss tokens: 4 does not divide
    assert rel_err(got, ref) < 1e-6
    assert ref_grads.keys() == got_grads.keys() and len(ref_grads) > 10
    for name in ref_grads:
        assert rel_err(got_grads[name], ref_grads[name]) < 1e-5, name
    # and the parameter updates of one optimizer step (SGD: AdamW's first step g/(|g|+eps) would amplify float
    # noise in near-zero gradients, which says nothing about the loss)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    updates = []
    for chunk_size in (None, 4):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.01)
        model_step(m, batch, chunk_size, seq)
        opt.step()
        updates.append({n: p.detach() - before[n] for n, p in m.named_parameters()})
    for name in before:
        assert rel_err(updates[1][name], updates[0][name]) < 1e-5, name


def test_token_reduction_of_one_sequence_equals_hf_loss(models):
    """Independent reference: a single sequence's token-reduced loss is transformers' own causal-LM loss."""
    model = models[True]
    batch = packed_micro_batch("token")
    seq = slice(0, 13)
    n = int((batch.targets[seq] != IGNORE_INDEX).sum())
    weights = (batch.targets[seq] != IGNORE_INDEX).float() / n
    labels = torch.full((1, 13), IGNORE_INDEX)
    labels[0, 1:] = batch.targets[seq][:-1]
    with torch.no_grad():
        hf = model(input_ids=batch.input_ids[:, seq], labels=labels, use_cache=False).loss
        hidden = model.model(input_ids=batch.input_ids[:, seq], use_cache=False).last_hidden_state
        ours, _, _ = weighted_lm_loss(hidden[0], model.lm_head.weight, batch.targets[seq], weights,
                                      batch.target_categories[seq], N_CAT, 3)
    assert ours.item() == pytest.approx(hf.item(), rel=1e-5)


def test_memory_benchmark_search_finds_longest_fitting_row(monkeypatch):
    """benchmarks/bench_memory.py: binary search over multiples of the step against the measured peak."""
    bench = pytest.importorskip("benchmarks.bench_memory")
    probed = []

    def fake_measure(spec, timeout):
        probed.append(spec["length"])
        if spec["length"] > 40_000:
            return {"oom": True, "error": "out of memory"}
        return {"peak_bytes": spec["length"] * 100, "tokens_per_s": 1.0, "seconds": 1.0}

    monkeypatch.setattr(bench, "measure", fake_measure)
    best, res = bench.longest_fitting({"length": 0}, budget_bytes=2_500_000, step=4096, max_len=65536, timeout=1,
                                      log=lambda msg: None)
    assert best == 24576 and res["peak_bytes"] == 2_457_600  # 28672 tokens would peak at 2.87 MB
    assert len(probed) <= 5
    assert bench.longest_fitting({"length": 0}, 10, 4096, 65536, 1, lambda msg: None)[0] == 0
