"""The prefix-tree builder of `stepwise: tree` (data/shards/prefix_tree.py) on its own: every sample is a root-to-leaf
path of the tree (tokens and positions), the tree trains exactly the (context, target) pairs the samples train, as
many times, and a labelled token always follows its parent (the flat shift of the trainer stays right)."""
from __future__ import annotations

import numpy as np
import pytest

from data.shards.prefix_tree import (IGNORE_INDEX, PrefixTree, TreeError, build_trees, check_flat_labels,
                                     tree_parents, tree_positions, validate_spans)


def sample(ids, trained_from, category=1):
    """A sample whose tokens from index `trained_from` on are trained (one turn)."""
    ids = np.asarray(ids, dtype=np.int32)
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
    labels[trained_from:] = ids[trained_from:]
    turns = np.zeros(len(ids), dtype=np.int16)
    turns[trained_from:] = 1
    return {"input_ids": ids, "labels": labels, "category_ids": np.full(len(ids), category, dtype=np.int16),
            "turn_ids": turns}


def paths(arrays):
    """Root-to-leaf token-index paths of a flattened tree."""
    parent = tree_parents(arrays["tree_spans"])
    has_child = np.zeros(len(parent), dtype=bool)
    has_child[parent[parent >= 0]] = True
    out = []
    for leaf in np.flatnonzero(~has_child):
        chain, x = [], int(leaf)
        while x >= 0:
            chain.append(x)
            x = int(parent[x])
        out.append(chain[::-1])
    return out


def trained_pairs_of_samples(samples):
    """Multiset of (context tokens, target, category, turn-in-sample) over every trained target of the samples."""
    out = []
    for s in samples:
        for t in np.flatnonzero(s["labels"] != IGNORE_INDEX):
            out.append((tuple(s["input_ids"][:t].tolist()), int(s["labels"][t]), int(s["category_ids"][t])))
    return sorted(out)


def trained_pairs_of_tree(arrays):
    parent = tree_parents(arrays["tree_spans"])
    out = []
    for t in np.flatnonzero(arrays["labels"] != IGNORE_INDEX):
        chain, x = [], int(parent[t])
        while x >= 0:
            chain.append(x)
            x = int(parent[x])
        out.append((tuple(arrays["input_ids"][chain[::-1]].tolist()), int(arrays["labels"][t]),
                    int(arrays["category_ids"][t])))
    return sorted(out)


CASES = {
    # turn 1's reasoning dropped when re-rendered (branches diverge), then a pure extension of sample 2
    "diverging": [sample([1, 2, 3, 4, 5, 9], 3), sample([1, 2, 3, 5, 9, 6, 7, 8, 9], 6, category=2),
                  sample([1, 2, 3, 5, 9, 6, 7, 8, 9, 6, 3, 3, 9], 10)],
    # a chain: every sample extends the previous one (a template that re-renders nothing)
    "chain": [sample([1, 2, 3, 4], 2), sample([1, 2, 3, 4, 5, 6], 4), sample([1, 2, 3, 4, 5, 6, 7, 8], 6)],
    # the same sample twice: its target trained twice, as the samples expansion trains it
    "duplicate": [sample([1, 2, 3, 4], 2), sample([1, 2, 3, 4], 2)],
    # different first tokens (left-truncated samples): a forest in one sequence
    "forest": [sample([1, 2, 3], 1), sample([7, 2, 3, 4], 3)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_holds_every_sample_and_trains_what_they_train(case):
    samples = CASES[case]
    tree = PrefixTree()
    for s in samples:
        tree.insert(s)
    arrays = tree.arrays()
    assert tree.n_samples == len(samples) and tree.sample_tokens == sum(len(s["input_ids"]) for s in samples)
    validate_spans(arrays["tree_spans"])
    check_flat_labels(arrays["labels"], arrays["tree_spans"])
    positions = tree_positions(arrays["tree_spans"])
    got = sorted(tuple(arrays["input_ids"][p].tolist()) for p in paths(arrays))
    assert got == sorted(tuple(s["input_ids"].tolist()) for s in samples)
    for p in paths(arrays):
        np.testing.assert_array_equal(positions[p], np.arange(len(p)))  # positions: those of the sample
    assert trained_pairs_of_tree(arrays) == trained_pairs_of_samples(samples)
    # one turn id per trained sample, numbered 1.. in order
    assert sorted(set(arrays["turn_ids"][arrays["labels"] != IGNORE_INDEX].tolist())) == list(
        range(1, len(samples) + 1))
    assert not arrays["turn_ids"][arrays["labels"] == IGNORE_INDEX].any()
    assert len(arrays["input_ids"]) <= sum(len(s["input_ids"]) for s in samples)


def test_shared_prefix_is_stored_once():
    samples = CASES["diverging"]
    arrays = build_trees(samples)[0].arrays()
    # shared [1, 2, 3] once; sample 1's tail [4, 5, 9] (its 3 a repeated branch token); samples 2 and 3 share
    # [3, 5, 9, 6, 7, 8] and branch at their last shared 9 (one repeated token each)
    assert len(arrays["input_ids"]) == 3 + 4 + 6 + 1 + 4
    assert arrays["input_ids"][:3].tolist() == [1, 2, 3]


def test_trees_are_cut_between_samples_at_max_length():
    samples = CASES["chain"]
    whole = build_trees(samples)
    assert len(whole) == 1 and len(whole[0]) == 8 + 2  # the chain, one repeated token per branch point
    cut = build_trees(samples, max_length=8)
    assert [t.n_samples for t in cut] == [2, 1]
    assert [len(t) for t in cut] == [7, 8]


@pytest.mark.parametrize("spans, message", [([0, 1], "at least itself"), ([3, 1], "runs past"),
                                            ([4, 2, 2, 1], "past its parent")])
def test_bad_spans_are_refused(spans, message):
    with pytest.raises(TreeError, match=message):
        validate_spans(np.asarray(spans))


def test_a_label_after_a_foreign_branch_is_refused():
    spans = np.asarray([3, 1, 1])  # tokens 1 and 2 are both children of 0: token 2 does not follow its parent
    labels = np.asarray([IGNORE_INDEX, IGNORE_INDEX, 5])
    with pytest.raises(TreeError, match="parent is token 0"):
        check_flat_labels(labels, spans)


def test_the_numpy_prefix_search_builds_the_walks_tree():
    """The fast path (shared prefix by array comparison) and the token-by-token walk build the same tree."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        base = rng.integers(0, 5, size=30)
        samples = []
        for _ in range(int(rng.integers(2, 7))):
            cut = int(rng.integers(1, 30))
            tail = rng.integers(0, 5, size=int(rng.integers(1, 8)))
            ids = np.concatenate([base[:cut], tail])
            samples.append(sample(ids, cut if cut > 0 else 1))
        fast, walked = PrefixTree(), PrefixTree(split=True)
        for s in samples:
            assert fast.cost(s) == walked.cost(s)
            fast.insert(s)
            walked.insert(s)
        a, b = fast.arrays(), walked.arrays()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        assert trained_pairs_of_tree(a) == trained_pairs_of_samples(samples)
