"""Parallel-thinking attention over packed rows: the mask is built on the fly from per-token ids, never stored.

Query q may attend to key k iff they are in the same packed sequence, k comes at or before q in token order
(NOT by position id: paths share positions), and not (both are in paths of the same block and the paths
differ). With all block/path ids zero this is the ordinary block-diagonal causal mask of a packed row, so the
SDPA backend and the sequence-parallel ``torch`` backend (local queries against gathered keys) share it.
Stepwise prefix trees (data/shards/prefix_tree.py) add per-key subtree spans: a key is visible only to queries in
its subtree (k <= q < k + span), i.e. a tree token attends to its ancestors and itself.
The ids come from `data.shards.parallel_thinking` (see its docstring for which tokens belong to which path).

CPU path: `structured_sdpa` with the boolean mask of `build_mask`, or `structured_sdpa_by_sequence`, the same
one packed sequence at a time without the Lq x Lk mask (the faster choice for rows of several sequences).
GPU path: `flex_structured_attention`, FlexAttention with a `mask_mod` over the same ids (FlexAttention's
backward is GPU-only in torch 2.13, so it falls back to SDPA off CUDA).

benchmarks/bench_structured_attention.py times mask building and the paths' forward + backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# rows per chunk are chosen so one chunk's temporaries stay near this many elements (cache-friendly)
_CHUNK_ELEMENTS = 1 << 22


def structure_feature_problems(features, sequence_parallel: bool = False) -> list[str]:
    """Why the Parallel-R1 mask paths cannot run layers with these `AttentionFeatures`: window, softcap and sinks
    are not implemented on the structured mask, nor attention dropout outside sequence parallelism (whose SDPA
    with the mask applies it)."""
    missing = features.names()
    if features.dropout > 0 and not sequence_parallel:
        missing.append(f"attention dropout {features.dropout}")
    if not missing:
        return []
    return [f"structure mode (Parallel-R1 mask) does not implement {', '.join(missing)}"]


def _as_long(x) -> torch.Tensor:
    return torch.as_tensor(x).to(torch.int64).reshape(-1)


def _sibling_groups(seq: torch.Tensor, block: torch.Tensor, path: torch.Tensor, outside: int) -> torch.Tensor:
    """(sequence, block) key for path tokens; `outside` (negative, different for q and k) for the others."""
    return torch.where(path > 0, seq * 65536 + block, torch.full_like(seq, outside))


def build_mask(q_seq, q_block, q_path, q_index=None, k_seq=None, k_block=None, k_path=None, k_index=None,
               k_span=None) -> torch.Tensor:
    """Boolean mask [Lq, Lk], True where the query may attend to the key.

    Inputs are 1-D (tensors or arrays): packed-sequence id, block id, path id and token index (order in the
    row) of each query and each key. `build_mask(seq, block, path)` is the whole row attending to itself
    (indices 0..L-1, keys = queries). The mask is on the device of `q_seq`.

    When the keys are in token order and each sequence is one run of keys (a packed row, or the gathered keys
    of sequence parallelism) the mask is filled by rectangles and triangles per run of queries, a few memsets
    instead of elementwise comparisons over Lq x Lk; any other layout takes the elementwise definition.

    `k_span` (stepwise prefix trees, data/shards/prefix_tree.py): per key the size of its subtree in token order,
    0 for no limit; a key with a span is visible only to queries with index < key index + span (its descendants).
    With keys = queries it defaults to the queries' own spans only when given as `k_span`.
    """
    q_seq, q_block, q_path = map(_as_long, (q_seq, q_block, q_path))
    device = q_seq.device
    q_index = torch.arange(len(q_seq), device=device) if q_index is None else _as_long(q_index).to(device)
    keys = (k_seq, k_block, k_path, k_index)
    if all(t is None for t in keys):
        k_seq, k_block, k_path, k_index = q_seq, q_block, q_path, q_index
    elif any(t is None for t in keys):
        raise ValueError("build_mask: give all four key id arrays or none (keys = queries)")
    else:
        k_seq, k_block, k_path, k_index = (_as_long(t).to(device) for t in keys)
    q_block, q_path = q_block.to(device), q_path.to(device)
    lq, lk = len(q_seq), len(k_seq)
    for name, t, n in (("q_block", q_block, lq), ("q_path", q_path, lq), ("q_index", q_index, lq),
                       ("k_block", k_block, lk), ("k_path", k_path, lk), ("k_index", k_index, lk)):
        if len(t) != n:
            raise ValueError(f"build_mask: {name} has {len(t)} entries, expected {n}")
    if lq == 0 or lk == 0:
        return torch.zeros(lq, lk, dtype=torch.bool, device=device)
    seq_runs = _runs(k_seq)
    if bool((k_index[1:] > k_index[:-1]).all()) and len(torch.unique(k_seq[seq_runs[0]])) == len(seq_runs[0]):
        mask = _mask_by_runs(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index, seq_runs)
    else:
        mask = _mask_elementwise(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index)
    if k_span is not None:
        k_span = _as_long(k_span).to(device)
        if len(k_span) != lk:
            raise ValueError(f"build_mask: k_span has {len(k_span)} entries, expected {lk}")
        mask &= _tree_visible(q_index, k_index, k_span)
    return mask


def _tree_visible(q_index: torch.Tensor, k_index: torch.Tensor, k_span: torch.Tensor) -> torch.Tensor:
    """[Lq, Lk]: the query lies in the key's subtree (or the key has no span)."""
    end = torch.where(k_span > 0, k_index + k_span, torch.full_like(k_index, torch.iinfo(torch.int64).max))
    return q_index[:, None] < end[None, :]


def _runs(*keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends) of the maximal runs of equal consecutive values of all `keys` together."""
    n = len(keys[0])
    change = torch.zeros(n, dtype=torch.bool, device=keys[0].device)
    change[0] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    starts = torch.nonzero(change).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n], device=starts.device)])
    return starts, ends


def _mask_by_runs(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index, seq_runs) -> torch.Tensor:
    lq, lk = len(q_seq), len(k_seq)
    device = q_seq.device
    seq_start, seq_end = seq_runs
    seq_of_run = k_seq[seq_start]
    # key columns [lo, hi) visible to each query before the sibling rule: its sequence's run, up to itself
    order = torch.argsort(seq_of_run)
    slot = torch.searchsorted(seq_of_run[order], q_seq).clamp(max=len(order) - 1)
    run = order[slot]
    present = seq_of_run[run] == q_seq
    lo = torch.where(present, seq_start[run], 0)
    hi = torch.minimum(torch.searchsorted(k_index, q_index, right=True), seq_end[run])
    hi = torch.where(present, torch.maximum(hi, lo), 0)
    # runs of queries whose rows are a rectangle [lo, h0) plus a staircase (hi grows by one per row)
    q_group = _sibling_groups(q_seq, q_block, q_path, -1)
    step = torch.ones(lq, dtype=torch.bool, device=device)
    step[1:] = hi[1:] != hi[:-1] + 1
    starts, ends = _runs(q_seq, q_group, q_path, lo, step.cumsum(0))
    # key columns of every path run, by (sequence, block) group, for the sibling rule
    k_group = _sibling_groups(k_seq, k_block, k_path, -2)
    path_runs: dict[int, list[tuple[int, int, int]]] = {}
    if bool((k_path > 0).any()) and bool((q_path > 0).any()):
        k_starts, k_ends = _runs(k_group, k_path)
        run_info = zip(k_starts.tolist(), k_ends.tolist(), k_group[k_starts].tolist(), k_path[k_starts].tolist())
        for a, b, g, p in run_info:
            if p > 0:
                path_runs.setdefault(g, []).append((p, a, b))
    mask = torch.zeros(lq, lk, dtype=torch.bool, device=device)
    arange = torch.arange(min(lq, 1024), device=device)
    rows = zip(starts.tolist(), ends.tolist(), lo[starts].tolist(), hi[starts].tolist(),
               q_group[starts].tolist(), q_path[starts].tolist())
    for r0, r1, col_lo, h0, group, path in rows:
        m = r1 - r0
        mask[r0:r1, col_lo:h0] = True
        if m > 1:  # row j of the run also sees the j keys after h0
            stair = mask[r0:r1, h0:h0 + m - 1]
            if m < 1024:  # tril_ has a large fixed cost per call on CPU; a comparison is cheaper on small stairs
                torch.lt(arange[None, :m - 1], arange[:m, None], out=stair)
            else:
                stair.fill_(True)
                stair.tril_(-1)
        for other, a, b in path_runs.get(group, ()):
            if other != path:
                mask[r0:r1, a:b] = False
    return mask


def _mask_elementwise(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index) -> torch.Tensor:
    """The definition, in row chunks so the peak memory is the mask plus a few MB."""
    lq, lk = len(q_seq), len(k_seq)
    q_group = _sibling_groups(q_seq, q_block, q_path, -1)
    k_group = _sibling_groups(k_seq, k_block, k_path, -2)
    mask = torch.empty(lq, lk, dtype=torch.bool, device=q_seq.device)
    rows = max(1, _CHUNK_ELEMENTS // lk)
    for r0 in range(0, lq, rows):
        r = slice(r0, min(lq, r0 + rows))
        out = mask[r]
        torch.eq(q_seq[r, None], k_seq[None, :], out=out)
        out &= k_index[None, :] <= q_index[r, None]
        sibling = torch.eq(q_group[r, None], k_group[None, :])
        sibling &= q_path[r, None] != k_path[None, :]
        out &= ~sibling
    return mask


def structured_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """SDPA with a boolean [Lq, Lk] mask. query [B, Hq, Lq, D], key/value [B, Hkv, Lk, D] (Hq a multiple of
    Hkv, grouped-query attention); returns [B, Lq, Hq, D] like a transformers attention function."""
    enable_gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask.to(query.device), dropout_p=dropout, scale=scaling, enable_gqa=enable_gqa
    )
    return out.transpose(1, 2).contiguous()


def structured_sdpa_by_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index,
                                scaling: float | None, k_span=None) -> torch.Tensor:
    """`structured_sdpa` one packed sequence at a time: the same result without the Lq x Lk mask.

    A packed row's mask is block-diagonal, so attention per sequence (its queries against its keys) skips the
    cross-sequence blocks: memory sum(Ls^2) instead of L^2 for the masks and the scores, and as much less
    compute. Layouts as in `structured_sdpa`; a sequence's queries may come in several runs (zigzag shards).
    """
    q_seq, q_block, q_path, q_index = map(_as_long, (q_seq, q_block, q_path, q_index))
    k_seq, k_block, k_path, k_index = (_as_long(t).to(q_seq.device) for t in (k_seq, k_block, k_path, k_index))
    k_span = None if k_span is None else _as_long(k_span).to(q_seq.device)
    if len(q_seq) == 0:
        return query.new_empty(query.shape[0], 0, query.shape[1], value.shape[-1])
    starts, ends = _runs(q_seq)
    outputs = []
    for r0, r1, s in zip(starts.tolist(), ends.tolist(), q_seq[starts].tolist()):
        cols = torch.nonzero(k_seq == s).flatten()
        if len(cols) == 0:
            raise ValueError(f"structured_sdpa_by_sequence: the queries of sequence {s} have no keys")
        if int(cols[-1] - cols[0]) + 1 == len(cols):  # one run of keys: a view, no copy
            c = slice(int(cols[0]), int(cols[-1]) + 1)
            k, v, kb, kp, ki = key[:, :, c], value[:, :, c], k_block[c], k_path[c], k_index[c]
            ks = None if k_span is None else k_span[c]
        else:
            k, v = key.index_select(2, cols.to(key.device)), value.index_select(2, cols.to(value.device))
            kb, kp, ki = k_block[cols], k_path[cols], k_index[cols]
            ks = None if k_span is None else k_span[cols]
        q_run = slice(r0, r1)
        mask = build_mask(q_seq[q_run], q_block[q_run], q_path[q_run], q_index[q_run],
                          torch.full_like(ki, s), kb, kp, ki, ks)
        outputs.append(structured_sdpa(query[:, :, q_run], k, v, mask, scaling))
    return torch.cat(outputs, dim=1)


def structure_mask_mod(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index, k_span=None):
    """FlexAttention `mask_mod(b, h, q_idx, kv_idx)` equal to `build_mask` over the same ids (one device)."""
    q_seq, q_block, q_path, q_index = map(_as_long, (q_seq, q_block, q_path, q_index))
    device = q_seq.device
    k_seq, k_block, k_path, k_index = (_as_long(t).to(device) for t in (k_seq, k_block, k_path, k_index))
    q_group = _sibling_groups(q_seq, q_block, q_path, -1)
    k_group = _sibling_groups(k_seq, k_block, k_path, -2)
    k_end = None
    if k_span is not None:
        k_span = _as_long(k_span).to(device)
        k_end = torch.where(k_span > 0, k_index + k_span, torch.full_like(k_index, torch.iinfo(torch.int64).max))

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (q_seq[q_idx] == k_seq[kv_idx]) & (k_index[kv_idx] <= q_index[q_idx])
        sibling = (q_group[q_idx] == k_group[kv_idx]) & (q_path[q_idx] != k_path[kv_idx])
        if k_end is not None:
            visible = visible & (q_index[q_idx] < k_end[kv_idx])
        return visible & ~sibling

    return mask_mod


_compiled_flex = None


def structured_block_mask(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index,
                          q_len: int, kv_len: int, device: torch.device, k_span=None):
    """FlexAttention's BlockMask of the structured mask (CUDA). The same for every layer of a forward: build it
    once per micro-batch (train.attention.function.AttentionContext caches it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = [_as_long(t).to(device) for t in (q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index)]
    span = None if k_span is None else _as_long(k_span).to(device)
    return create_block_mask(structure_mask_mod(*ids, span), B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device,
                             _compile=True)


def flex_structured_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index,
                              scaling: float | None, block_mask=None, k_span=None) -> torch.Tensor:
    """FlexAttention with the structured mask on CUDA (same layouts as `structured_sdpa`); SDPA elsewhere.
    `block_mask`: the `structured_block_mask` of these ids, when the caller has it already."""
    if query.device.type != "cuda":
        mask = build_mask(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index, k_span
                          ).to(query.device)
        return structured_sdpa(query, key, value, mask, scaling)
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    if block_mask is None:
        block_mask = structured_block_mask(q_seq, q_block, q_path, q_index, k_seq, k_block, k_path, k_index,
                                           query.shape[2], key.shape[2], query.device, k_span)
    out = _compiled_flex(query, key, value, block_mask=block_mask, scale=scaling,
                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()
