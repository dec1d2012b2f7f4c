"""train/row.py: one `Row` per micro-batch (its sequences' boundaries on host and device, the index tensors derived
from them built once), the object the varlen kernels, the per-sequence rope and the recurrent mixers all read."""
from __future__ import annotations

import pytest
import torch

import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")
from tests.train.model.patches.test_recurrent import tiny_model
from tests.train.model.patches.test_rope import _model as rope_model
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.model.packed import PackedCausalLM
from train.row import Row


def test_a_row_holds_both_sides_and_builds_each_index_once():
    row = Row.build([0, 3, 3, 7])  # an empty sequence is a valid attention row
    assert row.host_cu_q == row.host_cu_k == row.offsets == (0, 3, 3, 7) and (row.max_q, row.max_k) == (4, 4)
    assert row.cu_q.dtype == torch.int32 and row.cu_q.tolist() == [0, 3, 3, 7] and row.cu_k is row.cu_q
    assert (row.total, row.count) == (7, 3)
    assert row.seq_idx("cpu").tolist() == [0, 0, 0, 2, 2, 2, 2]
    assert row.seq_idx("cpu") is row.seq_idx("cpu")  # cached: every layer of the micro-batch reads the same tensor
    assert row.cu_seqlens("cpu").dtype == torch.int64 and row.cu_seqlens("cpu").tolist() == [0, 3, 3, 7]
    assert row.chunk_ids(4, "cpu").tolist() == [[0, 0, 0, 2], [2, 2, 2, 3]]  # the padding: a sequence of its own
    gather, keep = row.conv_indices(2, "cpu")
    assert gather.tolist() == [0, 1, 2, 3, 0, 0, 4, 5, 6, 7] and keep.tolist() == [0, 1, 2, 5, 6, 7, 8]
    keys = Row.build([0, 2, 5], [0, 4, 9])  # sequence parallelism: more keys than queries
    assert (keys.max_q, keys.max_k, keys.cu_k.tolist()) == (3, 5, [0, 4, 9])
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        Row.build([0, 4], [0, 3])
    moved = row.to("cpu")
    assert moved.host_cu_q is row.host_cu_q and torch.equal(moved.cu_q, row.cu_q)


def _forward(model: PackedCausalLM, lengths: list[int]) -> AttentionContext:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    attn = AttentionContext.for_micro_batch(cu, "cpu", LayerKernels(every=BACKENDS["sdpa"]))
    total = sum(lengths)
    ids = torch.randint(0, 100, (1, total))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    model(ids, positions, ids[0], torch.ones(total), torch.zeros(total, dtype=torch.long), attn)
    return attn


@pytest.mark.parametrize("which", ["recurrent", "rope"])
def test_the_forward_hands_the_micro_batch_row_to_the_model_patches(which):
    """The patches transformers calls without our arguments read the micro-batch's own Row (the context's), not a
    copy of its offsets: the recurrent mixers' cached indices are the ones the attention kernels' row holds."""
    lm = tiny_model("qwen3_next") if which == "recurrent" else rope_model("phi3-longrope")
    lm.set_attn_implementation("packsft")
    model = PackedCausalLM(lm, chunk_size=8, num_categories=1)
    holder = model.recurrent.boundaries if which == "recurrent" else model.ropes.row
    assert holder.row is None
    attn = _forward(model, [5, 9, 3])
    assert holder.row is attn.bounds and isinstance(attn.bounds, Row)
    if which == "recurrent":
        assert any(key[0] == "seq_idx" or key[0] == "conv" for key in attn.bounds._cache)  # the mixers used it
    again = _forward(model, [4, 4])
    assert holder.row is again.bounds  # the next micro-batch replaces it
