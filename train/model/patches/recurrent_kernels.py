"""The sequence kernels of the recurrent mixers, restarted at every packed sequence in one call over the whole row.

Each function stands in for the transformers kernel of the same role (the module-level function a mixer's forward
calls by name: `causal_conv1d_fn`, `mamba2_chunk_scan`, `torch_chunk_gated_delta_rule`,
`chunk_kimi_delta_attention`), takes the same arguments plus the row's boundaries (`row`), and returns what that
kernel returns for the whole row as if each packed sequence had been run alone: zero initial state, its own
convolution padding. Memory and time go by tokens; a sequence costs no padding chunk and no call of its own.

On CUDA, where the fused kernels are installed, they run with their own boundary arguments: causal-conv1d's
`causal_conv1d_fn(seq_idx=)` (widths 2-4), mamba-ssm's `mamba_chunk_scan_combined(seq_idx=)`, flash-linear-
attention's `chunk_gated_delta_rule(cu_seqlens=)` and `chunk_kda(cu_seqlens=)`. Everywhere else (CPU, or no such
package) the torch forms below run: transformers' torch references with the restart written in.
- Short causal convolution: every sequence is preceded by width - 1 zeros (one gather), so no tap crosses a boundary.
- Chunked scans (Mamba2's SSD, the gated delta rule, KDA): the row is cut into the model's chunks regardless of the
  boundaries, and four masks restart the state: two positions of a chunk interact only within one sequence (the
  intra-chunk decay matrix, hence a block-diagonal UT transform for the delta rules); a chunk's end state collects
  only the sequence the chunk ends in; the state carried from chunk to chunk is dropped where the sequence at the
  chunk ends changes; a token reads the carried state only if it belongs to the sequence the previous chunk ended in.
The result equals transformers' reference on each sequence alone up to float rounding (the chunks are cut at other
places), which tests/train/model/patches/test_recurrent.py checks per kernel and per model family.
"""
from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from train.row import Row

# the fused kernels: module path -> function name
FUSED_CONV = "causal_conv1d.causal_conv1d_fn"
FUSED_MAMBA2 = "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined"
FUSED_GATED_DELTA = "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
FUSED_KDA = "fla.ops.kda.chunk_kda"


@functools.cache
def _importable(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # not installed, or a build that does not load here: the torch form runs
        return None


def fused_kernel(path: str, tensor: torch.Tensor):
    """The installed fused kernel `path` when `tensor` is on CUDA, else None."""
    return _importable(path) if tensor.device.type == "cuda" else None


def _no_state(**arguments) -> None:
    """Packed training runs without a cache: no initial state comes in and no final state is asked for."""
    given = [name for name, value in arguments.items() if value is not None and value is not False]
    if given:
        raise ValueError(f"packed boundaries set, but the mixer passed {', '.join(given)} (a cache): packed rows "
                         "train with use_cache=False")


def causal_conv1d(hidden_states, weight, bias=None, activation=None, *, row: Row, **kwargs):
    """transformers' `causal_conv1d_fn` ([1, dim, T] -> [1, dim, T], depthwise, `weight` [dim, width]) restarted at
    each packed sequence."""
    _no_state(initial_states=kwargs.get("initial_states"), return_final_states=kwargs.get("return_final_states"))
    width = weight.shape[-1]
    fused = fused_kernel(FUSED_CONV, hidden_states)
    if fused is not None and 2 <= width <= 4 and activation in (None, "silu", "swish"):
        if hidden_states.stride(1) != 1:  # its seq_idx path takes the channel-last layout
            hidden_states = hidden_states.transpose(1, 2).contiguous().transpose(1, 2)
        seq_idx = row.seq_idx(hidden_states.device)[None]
        return fused(hidden_states, weight, bias, seq_idx=seq_idx, activation=activation)
    from transformers.activations import ACT2FN

    gather, keep = row.conv_indices(width, hidden_states.device)
    spread = F.pad(hidden_states.to(weight.dtype), (1, 0)).index_select(2, gather)
    out = F.conv1d(spread, weight.unsqueeze(1), bias, groups=hidden_states.shape[1]).index_select(2, keep)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [..., n, n]: out[..., i, j] = x[..., j+1] + ... + x[..., i] for j <= i, -inf above (as
    transformers' Mamba2 `segment_sum`: a cumulative sum of masked copies, no differences of large sums)."""
    n = x.size(-1)
    x = x[..., None].expand(*x.size(), n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device)), -torch.inf)


def _segment_cumsum(x: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    """Cumulative sums over the positions of each chunk (x [..., c, l, d]) that restart at each sequence start
    (`same` [c, l, l]). A sum never runs through an earlier sequence of the chunk, so the difference of two of them
    (a decay between two tokens) is as precise as in the sequence alone."""
    within = same & torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
    return within.to(x.dtype) @ x


def _masked_exp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(x) where `mask`, 0 elsewhere: masked before the exp, since a decay between tokens of different sequences
    (sums restarted in between) can be large and positive."""
    return x.masked_fill(~mask, -torch.inf).exp()


def _chunk_masks(ids: torch.Tensor):
    """From the chunked sequence ids [c, l]: (same [c, l, l]: both positions in one sequence; to_end [c, l]: the
    token is in the sequence its chunk ends in; carried [c, l]: the token is in the sequence the previous chunk
    ended in; ends [c + 1]: -1 then the sequence each chunk ends in)."""
    ends = F.pad(ids[:, -1], (1, 0), value=-1)
    return ids[:, :, None] == ids[:, None, :], ids == ids[:, -1:], ids == ends[:-1, None], ends


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                      dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, *, row: Row,
                      z=None, **kwargs):
    """transformers' Mamba2 `mamba2_chunk_scan` (the SSD chunked scan: x [1, T, heads, head_dim], dt [1, T, heads],
    A [heads], B and C [1, T, groups, state]) restarted at each packed sequence."""
    _no_state(initial_states=initial_states, return_final_states=return_final_states, z=z)
    fused = fused_kernel(FUSED_MAMBA2, hidden_states)
    if fused is not None:
        return fused(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                     dt_limit=dt_limit, seq_idx=row.seq_idx(hidden_states.device)[None])
    _, length, heads, head_dim = hidden_states.shape
    groups, state = B.shape[2], B.shape[3]
    per_group = heads // groups
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    pad = -length % chunk_size

    def chunked(x):  # [1, T, ...] -> [1, c, l, ...], zero padded
        x = F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad))
        return x.view(1, -1, chunk_size, *x.shape[2:])

    x = hidden_states.float()
    D_residual = D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad)) if D is not None else None
    x = chunked(x * dt[..., None].float())  # b c l h p
    A = chunked(A.to(x.dtype) * dt.float()).permute(0, 3, 1, 2)  # b h c l
    B, C = chunked(B.float()), chunked(C.float())  # b c l g n: heads share their group's B and C, never repeated
    same, to_end, carried, ends = _chunk_masks(row.chunk_ids(chunk_size, x.device))
    A_cumsum = _segment_cumsum(A[..., None], same)[..., 0]

    # 1. within each chunk, pairs of one sequence: (b, h, c, l, s) decays times (b, c, l, s, g) scores
    L = torch.exp(_segment_sum(A).masked_fill(~same, -torch.inf))
    G = torch.einsum("bclgn,bcsgn->bgcls", C, B)
    M = (L.view(1, groups, per_group, *L.shape[2:]) * G[:, :, None]).view(L.shape)
    Y_diag = torch.einsum("bhcls,bcshp->bclhp", M, x)

    # 2. each chunk's end state, from the tokens of the sequence it ends in
    decay_states = _masked_exp(A_cumsum[..., -1:] - A_cumsum, to_end)
    x_decayed = (x * decay_states.permute(0, 2, 3, 1)[..., None]).view(*x.shape[:3], groups, per_group, head_dim)
    states = torch.einsum("bclgn,bclgrp->bcgrpn", B, x_decayed).reshape(1, -1, heads, head_dim, state)

    # 3. the state at each chunk start: end states carried on while the sequence at the chunk ends stays the same
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = _segment_sum(F.pad(A_cumsum[..., -1], (1, 0))).masked_fill(ends[:, None] != ends[None, :], -torch.inf)
    states = torch.einsum("bhcz,bzhpn->bchpn", torch.exp(decay_chunk), states)[:, :-1]

    # 4. the carried state read by the tokens of the sequence the previous chunk ended in
    state_decay_out = _masked_exp(A_cumsum, carried)
    C_times_states = torch.einsum(
        "bclgn,bcgrpn->bclgrp", C, states.view(*states.shape[:2], groups, per_group, head_dim, state))
    Y_off = C_times_states.reshape(x.shape) * state_decay_out.permute(0, 2, 3, 1)[..., None]

    output = (Y_diag + Y_off).reshape(1, -1, heads, head_dim)
    if D_residual is not None:
        output = output + D_residual
    # contiguous, as transformers' own scan returns it: its mixers `view` the output (Falcon-H1: `scan_output.view(
    # batch, seq_len, -1)`), and a row of one chunk leaves einsum's strides here, which no view can merge
    return output[:, :length].contiguous()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """flash-linear-attention's l2 normalization, as transformers' delta-rule references write it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, *, row: Row, **kwargs):
    """transformers' `torch_chunk_gated_delta_rule` (q, k [1, T, k_heads, dk], v [1, T, v_heads, dv], g and beta
    [1, T, v_heads]) restarted at each packed sequence; returns (output, None)."""
    _no_state(initial_state=initial_state, output_final_state=output_final_state)
    fused = fused_kernel(FUSED_GATED_DELTA, query)
    if fused is not None:
        output, _ = fused(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          cu_seqlens=row.cu_seqlens(query.device))
        return output, None
    initial_dtype = query.dtype
    length, k_heads, k_dim = key.shape[1:]
    v_heads, v_dim = value.shape[-2:]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, g = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = -length % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(1, v_heads, -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    same, to_end, carried, ends = _chunk_masks(row.chunk_ids(chunk_size, query.device))
    g = _segment_cumsum(g.reshape(1, v_heads, -1, chunk_size, 1), same)[..., 0]
    keep_state = ends[1:] == ends[:-1]  # [c]: the chunk ends in the sequence the previous one ended in

    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pairwise_decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper | ~same, -torch.inf).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay  # block diagonal: one block per sequence
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, k_beta * _masked_exp(g, carried).unsqueeze(-1), upper=False, unitriangular=True)
    query = query * _masked_exp(g, carried).unsqueeze(-1)
    key = key * _masked_exp(g[..., -1:] - g, to_end).unsqueeze(-1)
    chunk_decay = _masked_exp(g[..., -1], keep_state)[..., None, None]

    state = torch.zeros(1, v_heads, k_dim, v_dim, dtype=new_values.dtype, device=new_values.device)
    outputs = []
    for i in range(g.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(query[:, :, i] @ state + intra_chunk_attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    output = torch.cat(outputs, dim=2)[:, :, :length]
    return output.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format), None


# elements of one block of KDA's per-channel decay tensor [heads, chunks, chunk, chunk, k_dim]: 16 MiB in fp32, under
# glibc's largest mmap threshold (32 MiB), so blocks reuse the heap; blocks of 32 MiB are mapped and faulted in afresh
# at each allocation (measured before the backward rebuilt them: 9.4 s vs 5.1 s per step at 4,096 tokens, one thread)
KDA_BLOCK_ELEMENTS = 1 << 22


def _kda_intra_chunk(query, key, k_beta, g, masked):
    """KDA's pairwise products within each chunk (q, k, k_beta, g [1, heads, c, l, dk], `masked` [c, l, l]: pairs
    that do not interact): (-sum_d k_beta_i k_j exp(g_i - g_j), sum_d q_i k_j exp(g_i - g_j)), each [1, heads, c, l, l].
    The decay has a channel axis, [heads, c, l, l, dk], dk times the size of the products: it is built a block of chunks
    at a time (KDA_BLOCK_ELEMENTS) and rebuilt in the backward (the same operations again), so no tensor of that
    shape outlives its block."""
    heads, chunks, length, k_dim = g.shape[1:]
    block = max(1, KDA_BLOCK_ELEMENTS // (heads * length * length * k_dim))
    ut_system, attn_intra = [], []
    for start in range(0, chunks, block):
        part = slice(start, start + block)
        ut_part, intra_part = checkpoint(_kda_intra_block, query[:, :, part], key[:, :, part], k_beta[:, :, part],
                                         g[:, :, part], masked[part], use_reentrant=False)
        ut_system.append(ut_part)
        attn_intra.append(intra_part)
    return torch.cat(ut_system, dim=2), torch.cat(attn_intra, dim=2)


def _kda_intra_block(query, key, k_beta, g, masked):
    """`_kda_intra_chunk` on one block of chunks; exp(g_i - g_j) k_j is shared by both products."""
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(masked[..., None], -torch.inf).exp()
    decayed_key = decay * key.unsqueeze(-3)
    return -(k_beta.unsqueeze(-2) * decayed_key).sum(dim=-1), (query.unsqueeze(-2) * decayed_key).sum(dim=-1)


def chunk_kimi_delta_attention(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False, *, row: Row, **kwargs):
    """transformers' `chunk_kimi_delta_attention` (KDA: the gated delta rule with a decay per key channel, q, k and
    g [1, T, heads, dk], v [1, T, heads, dv], beta [1, T, heads]) restarted at each packed sequence; returns
    (output, None)."""
    _no_state(initial_state=initial_state, output_final_state=output_final_state)
    fused = fused_kernel(FUSED_KDA, query)
    if fused is not None:
        output, _ = fused(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          cu_seqlens=row.cu_seqlens(query.device))
        return output, None
    initial_dtype = query.dtype
    query, key, value, beta, g = [
        x.transpose(1, 2).contiguous().to(torch.float32) for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    heads, length, k_dim = key.shape[1:]
    v_dim = value.shape[-1]
    pad = -length % chunk_size
    query = F.pad(query, (0, 0, 0, pad)) * (1 / query.shape[-1] ** 0.5)
    key, value, g = (F.pad(x, (0, 0, 0, pad)) for x in (key, value, g))
    beta = F.pad(beta, (0, pad))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, g, k_beta, v_beta = [
        x.reshape(1, heads, -1, chunk_size, x.shape[-1]) for x in (query, key, g, k_beta, v_beta)
    ]
    same, to_end, carried, ends = _chunk_masks(row.chunk_ids(chunk_size, query.device))
    g = _segment_cumsum(g, same)
    keep_state = ends[1:] == ends[:-1]

    upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device), diagonal=1)
    diagonal_and_upper = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device))
    ut_system, attn_intra = _kda_intra_chunk(query, key, k_beta, g, upper | ~same)
    attn = ut_system.masked_fill(diagonal_and_upper, 0)
    for i in range(1, chunk_size):  # (I + strictly lower)^-1 by forward substitution, block diagonal as attn is
        row_i = attn[..., i, :i].clone()
        attn[..., i, :i] = row_i + (row_i.unsqueeze(-1) * attn[..., :i, :i].clone()).sum(-2)
    attn = attn + torch.eye(chunk_size, dtype=attn.dtype, device=attn.device)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * _masked_exp(g, carried[..., None]))
    query = query * _masked_exp(g, carried[..., None])
    key = key * _masked_exp(g[..., -1:, :] - g, to_end[..., None])
    chunk_decay = _masked_exp(g[..., -1, :], keep_state[:, None]).unsqueeze(-1)

    state = torch.zeros(1, heads, k_dim, v_dim, dtype=value.dtype, device=value.device)
    outputs = []
    # unbind, not indexing: the backward of x[:, :, i] would fill a zero tensor of x's size for every chunk
    for q_i, k_i, v_i, k_cumdecay_i, attn_intra_i, chunk_decay_i in zip(
            *(x.unbind(2) for x in (query, key, value, k_cumdecay, attn_intra, chunk_decay))):
        v_new = v_i - k_cumdecay_i @ state
        outputs.append(q_i @ state + attn_intra_i @ v_new)
        state = state * chunk_decay_i + k_i.transpose(-1, -2) @ v_new
    output = torch.cat(outputs, dim=2)[:, :, :length]
    return output.transpose(1, 2).contiguous().to(initial_dtype), None
