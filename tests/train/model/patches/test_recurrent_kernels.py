"""The boundary-restarting sequence kernels (train/model/patches/recurrent_kernels.py) and the memory they save.

- Each kernel on a packed row equals transformers' torch reference run on each sequence alone (outputs and the
  gradients of every input, fp32), for rows of one sequence, of sequences that cross chunk boundaries or start on
  one, of one-token sequences, with strong decays; the reference on the whole row differs (the comparison sees a
  leak).
- On CUDA the fused kernels get the row's boundaries (`seq_idx` / `cu_seqlens`): checked with stand-ins for the
  fused functions, since no GPU runs this suite.
- A tiny Granite 4 hybrid with its default Mamba sizes (a row that exhausted the machine's memory before the one-call
  forms) trains on one 4,096-token row of 60 sequences in a bounded amount of memory.
"""
import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from tests.conftest import ROOT
from train.model.patches import recurrent_kernels as kernels
from train.row import Row

TOLERANCE = 1e-5
CHUNK = 8
# lengths of the packed sequences, against chunks of 8: one sequence; sequences across chunk boundaries, one starting
# on a chunk boundary (at 16), one-token ones, a row that is not a multiple of the chunk; only one-token sequences
ROWS = {
    "one sequence": (29,),
    "mixed": (5, 1, 10, 9, 3, 17, 1, 30, 2),
    "one-token sequences": (1,) * 11,
}


def row_of(lengths) -> Row:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return Row.build(offsets)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def outputs_and_grads(function, inputs: list[torch.Tensor], weights: torch.Tensor | None = None):
    """function(*inputs) -> output; (output, gradients of every floating input) of sum(output * weights)."""
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    output = function(*inputs)
    if weights is None:
        weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(7))
    (output * weights).sum().backward()
    return output.detach(), [x.grad for x in inputs if x.grad is not None], weights


def check_against_each_alone(packed, reference, inputs, token_dims, row: Row, output_dim: int) -> None:
    """packed(*inputs) == reference on each sequence's slice of the inputs (token_dims: each input's token
    dimension, None for a weight), concatenated; gradients too. And reference(*inputs) on the whole row differs."""
    output, grads, weights = outputs_and_grads(packed, inputs)

    def each_alone(*inputs):
        pieces = [
            reference(*[x if dim is None else x.narrow(dim, lo, hi - lo) for x, dim in zip(inputs, token_dims)])
            for lo, hi in zip(row.offsets[:-1], row.offsets[1:])
        ]
        return torch.cat(pieces, dim=output_dim)

    expected, expected_grads, _ = outputs_and_grads(each_alone, inputs, weights)
    assert relative_error(output, expected) < TOLERANCE
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert relative_error(grad, expected_grad) < TOLERANCE
    if row.count > 1:
        assert relative_error(outputs_and_grads(reference, inputs, weights)[0], expected) > 1e-3


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rand(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("lengths", ROWS.values(), ids=ROWS)
@pytest.mark.parametrize("width, bias, activation", [(4, True, "silu"), (2, False, None), (7, True, None)])
def test_causal_conv1d_restarts_at_each_sequence(lengths, width, bias, activation):
    row = row_of(lengths)
    dim = 6
    inputs = [randn(1, dim, row.total, seed=1), randn(dim, width, seed=2)] + ([randn(dim, seed=3)] if bias else [])

    def packed(x, weight, bias=None):
        return kernels.causal_conv1d(x, weight, bias, activation, row=row)

    def reference(x, weight, bias=None):
        return granite.causal_conv1d_fn(x, weight, bias, activation=activation)

    check_against_each_alone(packed, reference, inputs, [2, None, None], row, output_dim=2)


@pytest.mark.parametrize("lengths", ROWS.values(), ids=ROWS)
def test_mamba2_chunk_scan_restarts_at_each_sequence(lengths):
    row = row_of(lengths)
    heads, head_dim, groups, state = 4, 3, 2, 5
    T = row.total
    inputs = [
        randn(1, T, heads, head_dim, seed=1), randn(1, T, heads, seed=2),
        -torch.arange(1.0, heads + 1) * 4,  # A: strong decays, as the default Granite 4 / Mamba2 initialization
        randn(1, T, groups, state, seed=3), randn(1, T, groups, state, seed=4), randn(heads, seed=5),
        randn(heads, seed=6),
    ]

    def packed(x, dt, A, B, C, D, dt_bias):
        return kernels.mamba2_chunk_scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True, row=row)

    def reference(x, dt, A, B, C, D, dt_bias):
        return granite.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True)

    check_against_each_alone(packed, reference, inputs, [1, 1, None, 1, 1, None, None], row, output_dim=1)


@pytest.mark.parametrize("lengths", ROWS.values(), ids=ROWS)
def test_gated_delta_rule_restarts_at_each_sequence(lengths):
    row = row_of(lengths)
    k_heads, v_heads, k_dim, v_dim = 2, 4, 8, 6
    T = row.total
    inputs = [
        randn(1, T, k_heads, k_dim, seed=1), randn(1, T, k_heads, k_dim, seed=2), randn(1, T, v_heads, v_dim, seed=3),
        -16 * rand(1, T, v_heads, seed=4),  # g: strong decays (A up to 16, as the models initialize it)
        rand(1, T, v_heads, seed=5),
    ]

    def packed(*inputs):
        return kernels.chunk_gated_delta_rule(*inputs, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True, row=row)[0]

    def reference(*inputs):
        return qwen3_next.torch_chunk_gated_delta_rule(*inputs, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)[0]

    check_against_each_alone(packed, reference, inputs, [1] * 5, row, output_dim=1)


@pytest.mark.parametrize("lengths", ROWS.values(), ids=ROWS)
@pytest.mark.parametrize("block_chunks", [None, 1, 3], ids=["one block", "blocks of 1 chunk", "blocks of 3 chunks"])
def test_kimi_delta_attention_restarts_at_each_sequence(lengths, block_chunks, monkeypatch):
    row = row_of(lengths)
    heads, k_dim, v_dim = 3, 8, 6
    if block_chunks is not None:  # the decay tensor built a block of chunks at a time, as on rows of real length
        monkeypatch.setattr(kernels, "KDA_BLOCK_ELEMENTS", block_chunks * heads * CHUNK * CHUNK * k_dim)
    T = row.total
    inputs = [
        randn(1, T, heads, k_dim, seed=1), randn(1, T, heads, k_dim, seed=2), randn(1, T, heads, v_dim, seed=3),
        -16 * rand(1, T, heads, k_dim, seed=4), rand(1, T, heads, seed=5),
    ]

    def packed(*inputs):
        return kernels.chunk_kimi_delta_attention(*inputs, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True,
                                                  row=row)[0]

    def reference(*inputs):
        return kimi.chunk_kimi_delta_attention(*inputs, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True)[0]

    check_against_each_alone(packed, reference, inputs, [1] * 5, row, output_dim=1)


def test_packed_training_refuses_recurrent_state():
    row = row_of((3, 4))
    x = randn(1, 7, 2, 2, seed=1)
    with pytest.raises(ValueError, match="initial_states"):
        kernels.mamba2_chunk_scan(x, randn(1, 7, 2, seed=2), -torch.ones(2), randn(1, 7, 1, 3, seed=3),
                                  randn(1, 7, 1, 3, seed=4), CHUNK, initial_states=torch.zeros(1, 2, 2, 3), row=row)
    with pytest.raises(ValueError, match="output_final_state"):
        kernels.chunk_gated_delta_rule(x, x, x, -rand(1, 7, 2, seed=5), rand(1, 7, 2, seed=6),
                                       output_final_state=True, row=row)


class FusedStandIn:
    """Records how a fused kernel is called and answers with the torch form's result."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.answer


def test_fused_kernels_get_the_boundaries(monkeypatch):
    row = row_of((3, 1, 5))
    seq_idx = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 2]], dtype=torch.int32)
    x = randn(1, 9, 4, seed=1).transpose(1, 2)  # [1, dim, T], channel-last as the mixers' views are
    weight, bias = randn(4, 4, seed=2), randn(4, seed=3)
    expected = kernels.causal_conv1d(x, weight, bias, "silu", row=row)
    fused = {path: FusedStandIn(answer) for path, answer in [
        (kernels.FUSED_CONV, expected), (kernels.FUSED_MAMBA2, "ssd"), (kernels.FUSED_GATED_DELTA, ("gdn", "state")),
        (kernels.FUSED_KDA, ("kda", "state")),
    ]}
    monkeypatch.setattr(kernels, "fused_kernel", lambda path, tensor: fused[path])

    assert kernels.causal_conv1d(x, weight, bias, "silu", row=row) is expected
    (x_in, weight_in, bias_in), arguments = fused[kernels.FUSED_CONV].calls[0]
    assert x_in.stride(1) == 1 and torch.equal(x_in, x) and weight_in is weight and bias_in is bias
    assert torch.equal(arguments.pop("seq_idx"), seq_idx) and arguments == {"activation": "silu"}
    assert kernels.causal_conv1d(x, randn(4, 7, seed=4), None, row=row).shape == x.shape  # width 7: torch form
    assert len(fused[kernels.FUSED_CONV].calls) == 1

    ssd_inputs = (randn(1, 9, 2, 3, seed=5), randn(1, 9, 2, seed=6), -torch.ones(2), randn(1, 9, 1, 4, seed=7),
                  randn(1, 9, 1, 4, seed=8))
    assert kernels.mamba2_chunk_scan(*ssd_inputs, CHUNK, D=torch.ones(2), dt_softplus=True, row=row) == "ssd"
    args, arguments = fused[kernels.FUSED_MAMBA2].calls[0]
    assert args == (*ssd_inputs, CHUNK) and torch.equal(arguments.pop("seq_idx"), seq_idx)
    assert arguments["dt_softplus"] and torch.equal(arguments["D"], torch.ones(2))

    q = randn(1, 9, 2, 4, seed=9)
    for kernel, path in [(kernels.chunk_gated_delta_rule, kernels.FUSED_GATED_DELTA),
                         (kernels.chunk_kimi_delta_attention, kernels.FUSED_KDA)]:
        output, state = kernel(q, q, q, -rand(1, 9, 2, seed=10), rand(1, 9, 2, seed=11),
                               use_qk_l2norm_in_kernel=True, row=row)
        assert output in ("gdn", "kda") and state is None
        _, arguments = fused[path].calls[0]
        assert arguments["cu_seqlens"].tolist() == [0, 3, 4, 9] and arguments["cu_seqlens"].dtype == torch.int64
        assert arguments["use_qk_l2norm_in_kernel"]


def test_fused_kernels_only_on_cuda():
    assert kernels.fused_kernel(kernels.FUSED_MAMBA2, torch.zeros(1)) is None


# the issue's case; measured on the 2-core development VM: the per-sequence path (one mixer call per sequence, as
# before the one-call forms) grows the resident set by 11.9 GiB in 82 s, the one-call path by 2.7 GiB in 10 s
ISSUE_ROW = (4096, 60)
RSS_BOUND_MIB = 4096
ADDRESS_SPACE_LIMIT = 8 << 30  # a regression fails with an allocation error here instead of exhausting the machine


def test_long_row_of_many_sequences_trains_in_bounded_memory():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests._recurrent_memory_worker", *map(str, ISSUE_ROW)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rss_growth_mib"] < RSS_BOUND_MIB, result
    assert torch.isfinite(torch.tensor(result["loss"]))
