"""The subtree rule of stepwise prefix trees in the structured kernels (train/attention/structured.py): the mask is
"a token sees its ancestors and itself", and attention over a packed row of trees equals plain causal attention
over each root-to-leaf path on its own; sequence parallelism refuses tree rows."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.shards.prefix_tree import PrefixTree, tree_parents
from train.attention.structured import build_mask, structured_sdpa_by_sequence
from data.shards.dataset import Structure


def random_tree(rng, n_samples: int) -> dict:
    base = rng.integers(0, 4, size=12)
    tree = PrefixTree()
    for _ in range(n_samples):
        cut = int(rng.integers(1, 12))
        ids = np.concatenate([base[:cut], rng.integers(0, 4, size=int(rng.integers(1, 6)))]).astype(np.int32)
        labels = np.full(len(ids), -100, dtype=np.int32)
        labels[cut:] = ids[cut:]
        tree.insert({"input_ids": ids, "labels": labels, "category_ids": np.ones(len(ids), np.int16),
                     "turn_ids": (labels != -100).astype(np.int16)})
    return tree.arrays()


@pytest.fixture(scope="module")
def row():
    """Two trees packed in one row, with their spans, parents and the row's sequence ids."""
    rng = np.random.default_rng(1)
    trees = [random_tree(rng, 4), random_tree(rng, 3)]
    spans = np.concatenate([t["tree_spans"] for t in trees]).astype(np.int64)
    seq = np.concatenate([np.full(len(t["tree_spans"]), k) for k, t in enumerate(trees)])
    offsets = np.cumsum([0] + [len(t["tree_spans"]) for t in trees])
    parents = np.concatenate([np.where(p >= 0, p + o, -1) for p, o in
                              zip((tree_parents(t["tree_spans"]) for t in trees), offsets)])
    return spans, seq, parents


def ancestors(parents: np.ndarray, q: int) -> set[int]:
    out, x = set(), q
    while x >= 0:
        out.add(x)
        x = int(parents[x])
    return out


def test_mask_is_ancestors_and_self(row):
    spans, seq, parents = row
    n = len(spans)
    zeros = np.zeros(n, dtype=np.int64)
    mask = build_mask(seq, zeros, zeros, np.arange(n), seq, zeros, zeros, np.arange(n), spans).numpy()
    expected = np.zeros((n, n), dtype=bool)
    for q in range(n):
        expected[q, sorted(ancestors(parents, q))] = True
    np.testing.assert_array_equal(mask, expected)


def test_attention_over_trees_equals_causal_attention_per_path(row):
    spans, seq, parents = row
    n = len(spans)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, dtype=torch.float64) for h in (4, 2, 2))
    zeros = np.zeros(n, dtype=np.int64)
    out = structured_sdpa_by_sequence(q, k, v, seq, zeros, zeros, np.arange(n), seq, zeros, zeros, np.arange(n),
                                      None, k_span=spans)  # [1, n, 4, 8]
    has_child = np.zeros(n, dtype=bool)
    has_child[parents[parents >= 0]] = True
    for leaf in np.flatnonzero(~has_child):
        path = sorted(ancestors(parents, int(leaf)))
        idx = torch.tensor(path)
        ref = F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True,
                                             enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out[:, idx], ref, rtol=1e-12, atol=1e-12)


def test_sequence_parallelism_refuses_tree_rows():
    from train.plan.attention import TREE_SP_REFUSAL, AttentionPlan

    plan = AttentionPlan(kinds=(), packed=None, train=None, requested="sdpa", structure=Structure.TREE, layout=object(),
                         ring_backend="torch", ulysses=None, mesh=types.SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(ValueError, match="sequence_parallel_size: 1"):
        plan.context(None)
    assert "stepwise: samples" in TREE_SP_REFUSAL


def _tree_ids(row):
    spans, seq, _ = row
    zeros = np.zeros(len(spans), dtype=np.int64)
    return spans, (seq, zeros, zeros, np.arange(len(spans)))


def test_flex_mask_mod_of_tree_rows_is_the_mask(row):
    """The FlexAttention mask_mod (CUDA's path) over tree spans == build_mask (the SDPA path's), every query against
    every key, including queries of a slice (as a micro-batch's local rows see all keys)."""
    from train.attention.structured import structure_mask_mod

    spans, ids = _tree_ids(row)
    n = len(spans)
    rows = np.r_[2:n - 3]
    mask_mod = structure_mask_mod(*(t[rows] for t in ids), *ids, k_span=spans)
    q_idx, kv_idx = torch.arange(len(rows))[:, None], torch.arange(n)[None, :]
    assert torch.equal(mask_mod(0, 0, q_idx, kv_idx), build_mask(*ids, *ids, spans)[rows])


@pytest.mark.gpu
def test_flex_attention_over_trees_equals_causal_attention_per_path_on_gpu():
    """Tree rows on CUDA (FlexAttention, compiled, its block mask from the spans) == causal SDPA over each
    root-to-leaf path alone, forward and backward, over several of FlexAttention's 128-token blocks."""
    from train.attention.structured import flex_structured_attention

    rng = np.random.default_rng(3)
    trees = [random_tree(rng, 6) for _ in range(40)]
    spans = np.concatenate([t["tree_spans"] for t in trees]).astype(np.int64)
    seq = np.concatenate([np.full(len(t["tree_spans"]), k) for k, t in enumerate(trees)])
    offsets = np.cumsum([0] + [len(t["tree_spans"]) for t in trees])
    parents = np.concatenate([np.where(p >= 0, p + o, -1) for p, o in
                              zip((tree_parents(t["tree_spans"]) for t in trees), offsets)])
    n = len(spans)
    assert n > 4 * 128
    zeros, index = np.zeros(n, dtype=np.int64), np.arange(n)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 64, device="cuda", requires_grad=True) for h in (4, 2, 2))
    out = flex_structured_attention(q, k, v, seq, zeros, zeros, index, seq, zeros, zeros, index, 0.125,
                                    k_span=spans)  # [1, n, 4, 64]
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    has_child = np.zeros(n, dtype=bool)
    has_child[parents[parents >= 0]] = True
    ref = torch.zeros_like(out)
    for leaf in np.flatnonzero(~has_child):  # each token's output is that of any path through it
        idx = torch.tensor(sorted(ancestors(parents, int(leaf))), device="cuda")
        ref[:, idx] = F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True,
                                                     scale=0.125, enable_gqa=True).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)  # a leaking or missing key: O(1)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-2, rtol=1e-3)
