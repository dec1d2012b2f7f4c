"""Prefix trees of stepwise samples (`stepwise: tree`): K token sequences stored once, shared prefixes computed once.

`stepwise: samples` turns a conversation with K trained assistant turns into K sequences, sequence k being the chat
template's own rendering of the messages up to assistant turn k with loss on turn k only. `stepwise: tree` stores
those same K sequences as one token trie, found on the token ids (never assumed from the messages: where a template
re-renders an earlier turn, e.g. drops its reasoning, the branches diverge there).

Layout (one packed sequence): the trie's nodes in depth-first pre-order, each node one token. Per token the shards
store `tree_spans`: the size of the subtree rooted at that token (itself included), so the tokens of a subtree are
contiguous and token k is an ancestor of (or is) token q iff ``k <= q < k + span[k]``. That is the attention rule:
a token attends to its ancestors and itself only. Its position id is its depth (the number of its strict ancestors),
so a branch's positions continue from its branch point and every root-to-leaf path carries exactly the positions of
its sample. Spans are relative to the token, so concatenating (packing) sequences keeps them valid.

Loss. The trainer predicts the label of flat token t+1 from token t (`train.steps.batch.shift_targets`). A node is
keyed by (its token, the NEXT token of the sample, or the end): two samples share a node only if they agree on its
context (the path to it) and on what it predicts, so each node has one target (its children all carry the same
token, the target); its label sits on its first child, which follows it in pre-order. The other children (the
branch's first token repeated once per branch) carry no label. So a branch costs one repeated token, and the flat
shift stays right: a token whose flat predecessor is not its parent never carries a label.

A target trained in sample s has the same logits in every sample through that node (same context), so the tree may
train it once with weight = the number of samples that train it. Weights are kept to 0/1 here by sharing a node only
when at most one of the samples sharing it trains its target: two samples that both train the same target take
separate branches from there, so the target appears (and is trained) once per sample that trains it. The tree's
loss, per-category and per-turn loss and every count then equal the `samples` expansion's exactly. (Stepwise samples
never train the same target twice: sample k trains only its last turn, which no other sample holds at the same
place; the rule only matters for degenerate inputs such as duplicated samples.)

Category and turn ids follow the `samples` rows: a labelled token carries the category of the sample that trains
it and a turn id numbering the samples' trained turns 1.. in order; an unlabelled token carries the category of the
first sample through it and turn id 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100
TREE_FIELDS = ("input_ids", "labels", "category_ids", "turn_ids")
_END = -1  # the "next token" of a sample's last token


class TreeError(ValueError):
    """Per-token tree spans that do not describe a depth-first pre-order tree."""


@dataclass
class PrefixTree:
    """A token trie built by inserting samples (`insert`), flattened by `arrays`.

    Nodes are numbered in insertion order; `children[p]` maps a child's key (token, next token) to the node ids
    with that key (more than one only when the trained-twice rule split them, see the module doc)."""

    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)  # the node's target (next token) is trained
    target_category: list[int] = field(default_factory=list)  # of the sample that trains the target
    target_turn: list[int] = field(default_factory=list)
    category: list[int] = field(default_factory=list)  # of the first sample through the node
    children: list[dict] = field(default_factory=list)
    roots: dict = field(default_factory=dict)
    n_samples: int = 0
    sample_tokens: int = 0  # tokens of the samples inserted (what `stepwise: samples` stores)
    turns: int = 0  # trained turns numbered so far
    # per inserted sample (ids, its node at each depth): the fast path finds the shared prefix with numpy
    paths: list = field(default_factory=list)
    split: bool = False  # a node was split by the trained-twice rule: insert by walking the trie

    def __len__(self) -> int:
        return len(self.tokens)

    def _walk(self, sample: dict):
        """Yield (depth, existing node or None, key, trains) along the sample's path: the shared nodes first, then
        (node None) the ones that insertion creates; `trains`: the sample trains the node's target."""
        ids = np.asarray(sample["input_ids"])
        labels = np.asarray(sample["labels"])
        n = len(ids)
        level = self.roots
        for d in range(n):
            nxt = int(ids[d + 1]) if d + 1 < n else _END
            trains = d + 1 < n and labels[d + 1] != IGNORE_INDEX
            key = (int(ids[d]), nxt)
            node = None
            if level is not None:
                for candidate in level.get(key, ()):
                    if not (trains and self.trained[candidate]):
                        node = candidate
                        break
            yield d, node, key, trains
            level = None if node is None else self.children[node]  # after a new node, every later one is new

    def _shared(self, ids: np.ndarray, trains: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(depths shared with the trie, the trie's nodes at those depths), from the inserted sample with the longest
        common prefix; None when the walk must decide (a split node, or a target both would train)."""
        if self.split:
            return None
        best, nodes = 0, None
        for other, path in self.paths:
            m = min(len(ids), len(other))
            differ = np.flatnonzero(ids[:m] != other[:m])
            lcp = int(differ[0]) if len(differ) else m
            # node d is shared when the tokens agree through d + 1 (or both samples end at d)
            shared = lcp if lcp == len(ids) == len(other) else max(lcp - 1, 0)
            if shared > best:
                best, nodes = shared, path[:shared]
        if best and any(self.trained[int(nodes[d])] for d in np.flatnonzero(trains[:best])):
            return None
        return best, nodes if nodes is not None else np.zeros(0, dtype=np.int64)

    @staticmethod
    def _trains(ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Per depth: the sample trains that node's target (the next token)."""
        trains = np.zeros(len(ids), dtype=bool)
        trains[:-1] = labels[1:] != IGNORE_INDEX
        return trains

    def cost(self, sample: dict) -> int:
        """How many nodes inserting `sample` would add."""
        ids = np.asarray(sample["input_ids"])
        shared = self._shared(ids, self._trains(ids, np.asarray(sample["labels"])))
        if shared is not None:
            return len(ids) - shared[0]
        return sum(1 for _, node, _, _ in self._walk(sample) if node is None)

    def insert(self, sample: dict) -> int:
        """Add one sample (a mapping with `TREE_FIELDS` arrays, one sequence); returns the nodes it added."""
        ids = np.asarray(sample["input_ids"])
        labels = np.asarray(sample["labels"])
        cats = np.asarray(sample["category_ids"])
        turns = np.asarray(sample["turn_ids"])
        if len(ids) == 0:
            raise TreeError("an empty sample")
        if labels[0] != IGNORE_INDEX:
            raise TreeError("a sample's first token carries a label (nothing predicts it)")
        turn_base = self.turns
        added = 0
        parent = -1
        n = len(ids)
        trains_at = self._trains(ids, labels)
        shared = self._shared(ids, trains_at)
        if shared is not None:  # the shared prefix found with numpy, then only the new nodes one by one
            depth, nodes = shared
            steps = [(d, int(nodes[d]), None, bool(trains_at[d])) for d in np.flatnonzero(trains_at[:depth])]
            parent = int(nodes[depth - 1]) if depth else -1
            steps += [(d, None, (int(ids[d]), int(ids[d + 1]) if d + 1 < n else _END), bool(trains_at[d]))
                      for d in range(depth, n)]
        else:
            steps = list(self._walk(sample))
            nodes = np.zeros(0, dtype=np.int64)
            depth = 0
        path = np.empty(n, dtype=np.int64)
        path[:depth] = nodes
        for d, node, key, trains in steps:
            if node is None:
                node = len(self.tokens)
                self.tokens.append(key[0])
                self.parent.append(parent)
                self.trained.append(False)
                self.target_category.append(0)
                self.target_turn.append(0)
                self.category.append(int(cats[d]))
                self.children.append({})
                siblings = self.roots if parent < 0 else self.children[parent]
                same_key = siblings.setdefault(key, [])
                self.split = self.split or bool(same_key)  # a second node of one key: walk from now on
                same_key.append(node)
                added += 1
            if trains:
                if self.trained[node]:
                    raise TreeError("internal: a node's target trained twice")  # `_shared` / `_walk` prevent it
                self.trained[node] = True
                self.target_category[node] = int(cats[d + 1])
                self.target_turn[node] = turn_base + int(turns[d + 1])
            if d >= depth:
                path[d] = node
                parent = node
        self.paths.append((ids, path))
        self.turns = turn_base + int(turns.max(initial=0))
        self.n_samples += 1
        self.sample_tokens += len(ids)
        return added

    def arrays(self) -> dict[str, np.ndarray]:
        """The tree as one sequence: `TREE_FIELDS` plus `tree_spans`, in depth-first pre-order (children in
        insertion order)."""
        n = len(self.tokens)
        order = np.empty(n, dtype=np.int64)
        span = np.zeros(n, dtype=np.int64)
        first_child = np.zeros(n, dtype=bool)
        k = 0
        roots = [node for nodes in self.roots.values() for node in nodes]
        stack = [(node, False) for node in reversed(roots)]  # roots are nobody's child: never labelled
        exits: list[int] = []
        while stack:
            node, is_first = stack.pop()
            if node < 0:  # an exit marker: the subtree of ~node is done
                node = ~node
                span[node] = k - exits.pop()
                continue
            order[k] = node
            first_child[node] = is_first
            exits.append(k)
            k += 1
            stack.append((~node, False))
            kids = [c for nodes in self.children[node].values() for c in nodes]
            for j in range(len(kids) - 1, -1, -1):
                stack.append((kids[j], j == 0))
        tokens = np.asarray(self.tokens, dtype=np.int64)
        parent = np.asarray(self.parent, dtype=np.int64)
        trained = np.asarray(self.trained, dtype=bool)
        labelled = first_child & (parent >= 0)
        labelled[labelled] = trained[parent[labelled]]
        labels = np.where(labelled, tokens, IGNORE_INDEX)
        safe_parent = np.maximum(parent, 0)
        cats = np.where(labelled, np.asarray(self.target_category)[safe_parent], np.asarray(self.category))
        turns = np.where(labelled, np.asarray(self.target_turn)[safe_parent], 0)
        return {"input_ids": tokens[order].astype(np.int32), "labels": labels[order].astype(np.int32),
                "category_ids": cats[order].astype(np.int16), "turn_ids": turns[order].astype(np.int16),
                "tree_spans": span[order].astype(np.int32)}


def build_trees(samples: list[dict], max_length: int | None = None) -> list[PrefixTree]:
    """The samples (in order) as prefix trees of at most `max_length` tokens each: a sample goes into the current
    tree unless that would make it longer than `max_length`, then it starts the next tree (a cut between samples,
    i.e. at a branch boundary, never inside one). A sample longer than `max_length` on its own is the caller's to
    refuse (it would be a tree of its own)."""
    trees: list[PrefixTree] = []
    current = PrefixTree()
    for sample in samples:
        if max_length is not None and len(current) and len(current) + current.cost(sample) > max_length:
            trees.append(current)
            current = PrefixTree()
        current.insert(sample)
    if len(current):
        trees.append(current)
    return trees


def validate_spans(spans: np.ndarray) -> None:
    """Raise TreeError unless `spans` (one sequence) is a depth-first pre-order forest: every span >= 1, within
    the sequence, and every subtree nested in its parent's."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1)
    n = len(spans)
    if n == 0:
        return
    if (spans < 1).any():
        raise TreeError(f"tree span {int(spans[spans < 1][0])} at token {int(np.flatnonzero(spans < 1)[0])} "
                        "(a token's subtree holds at least itself)")
    ends = np.arange(n) + spans
    if (ends > n).any():
        t = int(np.flatnonzero(ends > n)[0])
        raise TreeError(f"token {t}'s subtree (span {int(spans[t])}) runs past the sequence's {n} tokens")
    stack: list[int] = []
    for t in range(n):
        while stack and stack[-1] <= t:
            stack.pop()
        if stack and ends[t] > stack[-1]:
            raise TreeError(f"token {t}'s subtree ends at {int(ends[t])}, past its parent's end {stack[-1]}")
        stack.append(int(ends[t]))


def tree_positions(spans: np.ndarray) -> np.ndarray:
    """int64 position ids of one tree sequence: each token's depth (validated)."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1)
    validate_spans(spans)
    n = len(spans)
    depth = np.zeros(n, dtype=np.int64)
    ends: list[int] = []
    for t in range(n):
        while ends and ends[-1] <= t:
            ends.pop()
        depth[t] = len(ends)
        ends.append(t + int(spans[t]))
    return depth


def tree_parents(spans: np.ndarray) -> np.ndarray:
    """Each token's parent index in one tree sequence (-1 for a root)."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1)
    n = len(spans)
    parent = np.full(n, -1, dtype=np.int64)
    stack: list[int] = []
    for t in range(n):
        while stack and stack[-1] + spans[stack[-1]] <= t:
            stack.pop()
        parent[t] = stack[-1] if stack else -1
        stack.append(t)
    return parent


def check_flat_labels(labels: np.ndarray, spans: np.ndarray) -> None:
    """Raise TreeError if a labelled token's flat predecessor is not its parent (the shifted loss would pair it
    with another branch's logits)."""
    parent = tree_parents(spans)
    labelled = np.flatnonzero(np.asarray(labels) != IGNORE_INDEX)
    bad = labelled[parent[labelled] != labelled - 1]
    if len(bad):
        raise TreeError(f"token {int(bad[0])} carries a label but its parent is token {int(parent[bad[0]])}, "
                        f"not the token before it")
