"""Exact loss: a packed row equals its samples run alone (token / turn / sample), a step with an empty micro-batch
equals the step without it. fp32 on CPU, tolerance 1e-5 relative."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    one_thread,
    random_rows,
    save_tiny_model,
    synthetic_sequence,
    tiny_model,
    untrained_sequence,
    write_config,
    write_packed,
)
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.steps.batch import make_batch, step_totals
from train.model.packed import PackedCausalLM

SDPA_KERNELS = LayerKernels(every=BACKENDS["sdpa"])  # every layer through the SDPA loop

RTOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


def _row_dict(seqs):
    out = {k: np.concatenate([s[k] for s in seqs]) for k in seqs[0]}
    out["seq_lens"] = np.array([len(s["input_ids"]) for s in seqs])
    return out


def _reference_loss(model, seqs, reduction):
    """Each sample alone through a standard HF forward (sdpa attention, full logits), combined per the reduction
    exactly as the definitions say (no train.steps.batch code involved)."""
    token_losses, turn_means, sample_means = [], [], []
    for s in seqs:
        ids = torch.from_numpy(s["input_ids"].astype(np.int64))[None]
        logits = model(input_ids=ids, use_cache=False).logits[0]
        labels = torch.from_numpy(s["labels"].astype(np.int64))
        turns = torch.from_numpy(s["turn_ids"].astype(np.int64))
        ce = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")
        valid = labels[1:] != -100
        if not valid.any():
            continue
        token_losses.append(ce[valid])
        sample_means.append(ce[valid].mean())
        for t in turns[1:][valid].unique():
            turn_means.append(ce[valid & (turns[1:] == t)].mean())
    if reduction == "token":
        return torch.cat(token_losses).sum() / sum(len(x) for x in token_losses)
    if reduction == "turn":
        return torch.stack(turn_means).mean()
    return torch.stack(sample_means).mean()


def _rel_close(a: torch.Tensor, b: torch.Tensor, what: str):
    scale = max(float(b.abs().max()), 1e-12)
    err = float((a - b).abs().max()) / scale
    assert err <= RTOL, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("reduction,tie,chunk", [("token", False, 7), ("turn", False, 7), ("sample", False, 7),
                                                 ("token", True, 0)])
def test_packed_row_equals_samples_alone(reduction, tie, chunk):
    rng = np.random.default_rng(1)
    seqs = [synthetic_sequence(rng, 11, 2, 1), synthetic_sequence(rng, 17, 3, 2), untrained_sequence(rng, 5),
            synthetic_sequence(rng, 9, 1, 1)]
    row = _row_dict(seqs)
    meta = {
        "row_n_loss_tokens": [sum(int((s["labels"] != -100).sum()) for s in seqs)],
        "row_n_trained_turns": [sum(len(np.unique(s["turn_ids"][s["turn_ids"] > 0])) for s in seqs)],
        "row_n_samples": [sum(int((s["labels"] != -100).any()) for s in seqs)],
    }
    batch = make_batch([row], step_totals(meta, [0]), reduction)

    packed_lm = tiny_model(tie=tie)
    model = PackedCausalLM(packed_lm, chunk_size=chunk, num_categories=3)
    attn = AttentionContext(batch.cu_seqlens, batch.max_seqlen, SDPA_KERNELS)
    loss, _, _ = model(batch.input_ids, batch.position_ids, batch.targets, batch.weights,
                       batch.target_categories, attn)
    loss.backward()

    ref_lm = tiny_model(tie=tie)
    ref_lm.config._attn_implementation = "sdpa"
    ref_lm.load_state_dict(packed_lm.state_dict())
    ref = _reference_loss(ref_lm, seqs, reduction)
    ref.backward()

    _rel_close(loss.detach(), ref.detach(), "loss")
    ref_params = dict(ref_lm.named_parameters())
    for name, p in packed_lm.named_parameters():
        _rel_close(p.grad, ref_params[name].grad, f"grad {name}")


def _trainer_grads(tmp_path, name, rows, **cfg_values):
    """One optimizer step of the real Trainer (single process); returns (log record, summed gradients)."""
    from train.config.sections import load_config
    from train.trainer import Trainer

    data = write_packed(tmp_path / f"data_{name}", rows)
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        save_tiny_model(model_dir)
    cfg = write_config(tmp_path / f"{name}.yaml", data_path=str(data), model_path=str(model_dir),
                       output_dir=str(tmp_path / f"out_{name}"), lr=1e-3, max_grad_norm=0.0, loss_chunk_size=8,
                       plot=False, **cfg_values)
    trainer = Trainer(load_config(cfg), console=lambda *_: None)
    grads = {}
    trainer.grad_hook = lambda tr: grads.update(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    )
    plan = trainer.sampler.plan(0)
    record = trainer.train_step(plan)
    return record, grads


@pytest.mark.parametrize("reduction", ["token", "turn", "sample"])
def test_micro_batch_without_loss_tokens_changes_nothing(tmp_path, reduction):
    rng = np.random.default_rng(3)
    real = [synthetic_sequence(rng, 14, 2, 1), synthetic_sequence(rng, 10, 1, 2)]
    empty = [untrained_sequence(rng, 12), untrained_sequence(rng, 7)]
    with_empty, g1 = _trainer_grads(tmp_path, "with", [real, empty], grad_accum=2, max_steps=1,
                                    loss_reduction=reduction)
    without, g2 = _trainer_grads(tmp_path, "without", [real], grad_accum=1, max_steps=1, loss_reduction=reduction)
    assert np.isfinite(with_empty["loss"]) and np.isfinite(with_empty["grad_norm"])
    assert with_empty["loss"] == pytest.approx(without["loss"], rel=RTOL)
    assert with_empty["category_loss"] == pytest.approx(without["category_loss"], rel=RTOL)
    assert g1.keys() == g2.keys()
    for name in g1:
        _rel_close(g1[name], g2[name], name)


def test_accumulation_equals_one_micro_batch(tmp_path):
    rows = random_rows(5, 2)
    accum, g_accum = _trainer_grads(tmp_path, "accum", rows, grad_accum=2, micro_batch_rows=1, max_steps=1)
    joined, g_joined = _trainer_grads(tmp_path, "joined", rows, grad_accum=1, micro_batch_rows=2, max_steps=1)
    assert accum["loss"] == pytest.approx(joined["loss"], rel=RTOL)
    assert accum["loss_tokens"] == joined["loss_tokens"]
    for name in g_accum:
        _rel_close(g_accum[name], g_joined[name], name)


def test_gradient_checkpointing_changes_nothing(tmp_path):
    rows = random_rows(9, 1)
    plain, g_plain = _trainer_grads(tmp_path, "plain", rows, max_steps=1)
    ckpt, g_ckpt = _trainer_grads(tmp_path, "ckpt", rows, max_steps=1, gradient_checkpointing=True)
    assert ckpt["loss"] == pytest.approx(plain["loss"], rel=RTOL)
    for name in g_plain:
        _rel_close(g_ckpt[name], g_plain[name], name)


def test_filler_with_more_loss_tokens_than_the_step(tmp_path):
    """The last step of an epoch (3 rows, 2 per step): its empty micro-batch runs a filler row (perm[0]) with more
    loss tokens than the step's only real row; the step must equal that row alone."""
    rng = np.random.default_rng(0)
    rows = [[synthetic_sequence(rng, 40, 2, 1)], [synthetic_sequence(rng, 40, 2, 1)],
            [synthetic_sequence(rng, 8, 1, 1)]]  # 27, 27 and 5 loss tokens
    seed = next(s for s in range(100) if np.random.default_rng([s, 0]).permutation(3)[2] == 2)
    from train.config.sections import load_config
    from train.trainer import Trainer

    data = write_packed(tmp_path / "data_filler", rows)
    model_dir = save_tiny_model(tmp_path / "model")
    cfg = write_config(tmp_path / "filler.yaml", data_path=str(data), model_path=str(model_dir),
                       output_dir=str(tmp_path / "out_filler"), lr=1e-3, max_grad_norm=0.0, loss_chunk_size=8,
                       plot=False, grad_accum=2, num_epochs=1, seed=seed)
    trainer = Trainer(load_config(cfg), console=lambda *_: None)
    grads = {}
    trainer.grad_hook = lambda tr: grads.update(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    )
    plan = trainer.sampler.plan(1)
    assert [mb.filler for mb in plan.micro_batches] == [False, True]
    filler_row = plan.micro_batches[1].rows[0]
    assert trainer.dataset.row_n_loss_tokens[filler_row] > plan.totals.n_loss_tokens
    with_filler = trainer.train_step(plan)
    alone, g_alone = _trainer_grads(tmp_path, "alone", [rows[2]], grad_accum=1, max_steps=1)
    assert with_filler["loss"] == pytest.approx(alone["loss"], rel=RTOL)
    assert grads.keys() == g_alone.keys()
    for name in grads:
        _rel_close(grads[name], g_alone[name], name)
