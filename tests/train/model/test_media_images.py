"""Image conversations in the trainer (train/model/media.py): packed rows of LLaMA-Factory's demo records, through the real
Qwen2.5-VL processor, train exactly as transformers' composite forward on each record alone with its pixel_values
(loss and every gradient, tower trained or frozen, under gradient accumulation; data and sequence parallelism in
two gloo processes), and the families without an exact image path are refused before any weight loads.

Run in .venv-vision (the processor imports torchvision): `.venv-vision/bin/python -m pytest -m vision ...`."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import _vision_inputs as vi

pytestmark = pytest.mark.vision

LOSS_TOL, GRAD_TOL = 2e-6, 3e-5


@pytest.fixture(scope="module")
def recs():
    torch.set_num_threads(1)
    return vi.records()


@pytest.mark.parametrize("model_type,freeze_tower,split", [
    ("qwen2_5_vl", False, [6]), ("qwen2_5_vl", True, [6]), ("qwen2_5_vl", False, [2, 4]), ("qwen2_5_vl", True, [2, 4]),
    ("qwen2_vl", False, [6]),
    # the Qwen2.5-VL processor's pixel rows through a tower of 14-pixel patches, deepstack features at both layers
    ("qwen3_vl", False, [6]), ("qwen3_vl_moe", False, [2, 4]),
], ids=lambda v: "tower-frozen" if v is True else "tower-trained" if v is False else
    ("one-micro-batch" if v == [6] else "accumulated") if isinstance(v, list) else v)
def test_packed_images_equal_the_composite_per_record(recs, model_type, freeze_tower, split):
    """Six records (seven images) in one packed row, or two micro-batches accumulated with the step's weights."""
    model = vi.tiny_vl_model(model_type, freeze_tower=freeze_tower)
    total = vi.n_targets(recs)
    want_loss, want = vi.reference(model, recs, total)
    bounds = [0, *torch.tensor(split).cumsum(0).tolist()]
    batches = [vi.micro_batch(recs[a:b], total) for a, b in zip(bounds[:-1], bounds[1:])]
    loss, got = vi.packed_step(model, batches)
    assert abs(loss - want_loss) / want_loss <= LOSS_TOL
    assert vi.grad_error(got, want) <= GRAD_TOL
    towers = [name for name in want if ".visual." in name]
    assert (not towers) if freeze_tower else towers  # a trained tower's gradients are among those compared


def test_positions_are_the_composites_own_per_record(recs):
    """The row's M-RoPE positions restart at each packed sequence and equal the composite's get_rope_index on each
    record alone (with the processor's mm_token_type_ids); image tokens get 2-D grid positions."""
    model = vi.tiny_vl_model()
    batch = vi.micro_batch(recs[:3], 1)
    row = model.row_media(batch)
    body = model.lm.model
    cu = batch.cu_seqlens.tolist()
    for r, (a, b) in zip(recs[:3], zip(cu[:-1], cu[1:])):
        want, _ = body.get_rope_index(r["input_ids"][None], mm_token_type_ids=r["mm_token_type_ids"][None],
                                      image_grid_thw=r["image_grid_thw"])
        assert torch.equal(row.positions[:, a:b], want[:, 0])
    image = row.feature_index >= 0
    assert not torch.equal(row.positions[1][image], row.positions[2][image])  # height and width differ in an image
    assert torch.equal(row.feature_index[image], torch.arange(int(image.sum())))


def test_mismatched_images_are_an_error(recs):
    model = vi.tiny_vl_model()
    batch = vi.micro_batch(recs[:2], 1)
    del batch.media.items[-1]  # one image fewer than its tokens
    with pytest.raises(ValueError, match=r"the rows hold 32 image tokens, the 2 image items give \[10, 10\]"):
        model.row_media(batch)


def test_micro_batch_without_images_runs_the_tower_on_a_blank_image(recs):
    """A text-only micro-batch of an image run: the tower still runs (every rank runs the same modules: ZeRO-3), its
    gradients are exactly zero, and the loss is the text path's."""
    model = vi.tiny_vl_model()
    text = {k: v for k, v in recs[0].items()}
    text["input_ids"] = text["input_ids"].masked_fill(text["input_ids"] == vi.IMAGE_TOKEN, 7)
    batch = vi.micro_batch([text], 100)
    batch = dataclasses.replace(batch, media=None)
    loss, grads = vi.packed_step(model, [batch])
    towers = {n: g for n, g in grads.items() if ".visual." in n}
    assert towers and all(float(g.abs().max()) == 0.0 for g in towers.values())
    model.media = None  # the text path
    text_loss, _ = vi.packed_step(model, [dataclasses.replace(batch, media=None)])
    assert loss == pytest.approx(text_loss, rel=1e-6)


@pytest.mark.multiprocess
def test_data_and_sequence_parallel_images_equal_one_process(recs, tmp_path):
    """dp = 2 (three records per rank) and sp = 2 (one row of three records over both ranks, an image straddling the
    boundary), tower trained and frozen: the summed loss and gradients of the single-process packed step."""
    from tests._sp_worker import spawned_results
    from tests._vision_worker import worker

    vi.save_records(recs, tmp_path / "records.safetensors")  # the workers read it there
    results = spawned_results(worker, 2, tmp_path)
    assert results.pop("sp2/straddle") is True
    assert set(results) == {"dp2/trained", "dp2/frozen", "sp2/trained", "sp2/frozen"}
    for name, errors in results.items():
        assert errors["loss"] <= LOSS_TOL and errors["grad"] <= GRAD_TOL, (name, errors)


def test_self_check_compares_image_sequences_with_the_composite(recs):
    """The start-up self-check's inputs (whole sequences of a micro-batch, each with its images) and its comparison
    through the tower: packed = the composite's own forward with pixel_values (train/model/self_check.py)."""
    from train.attention.function import BACKENDS, LayerKernels
    from train.model.self_check import compare_packed_with_reference

    model = vi.tiny_vl_model()
    batch = vi.micro_batch(recs[:3], 1)
    seqs, media = model.media.sequences(batch, max_tokens=100)
    assert [s.numel() for s in seqs] == [83, 75]  # record 2 (125 tokens) is longer than max_tokens
    for seq, items, r in zip(seqs, media, recs):
        assert torch.equal(seq, r["input_ids"])
        assert torch.equal(torch.cat([i["image_grid_thw"] for _, i in items.items]), r["image_grid_thw"])
        assert torch.equal(torch.cat([i["pixel_values"] for _, i in items.items]), r["pixel_values"])
    result = compare_packed_with_reference(model, seqs, LayerKernels(every=BACKENDS["sdpa"]), media=media)
    assert result.ok and result.loss_error <= LOSS_TOL and result.grad_error <= GRAD_TOL, result.describe()
