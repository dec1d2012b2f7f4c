"""Every family the table calls exact trains one step through the CLI's start-up, exactly as transformers' own
unpacked forward.

tests/train/test_families.py checks the packed model (`PackedCausalLM` on given kernels) against transformers;
this file runs what `sh train.sh` runs for one process: `train.trainer.Trainer` from a config (the preflight's model
config, the family gate, the model built by `build_lm`, the attention plan, the memory plan of activation
checkpointing, the start-up self-check, the engine and its optimizer) and then one optimizer step of the sampler's
plan, on a packed row shaped like the rows users pack: 56 sequences of mixed lengths (2 to 31 tokens: shorter than
the tiny configs' Mamba chunk of 8 and than every convolution window of 4, and longer than the sliding windows of 4),
with prompts and trained turns. The step's loss and the gradient the engine holds before its update are compared
with transformers' own `*ForCausalLM` (a composite: its `*ForConditionalGeneration`) built from the same config with
eager attention, in training mode, loaded with the trainer's initial weights and run on each sequence alone: loss
within 1e-6, all gradients together within 1e-6 (the norm of the difference over the norm), and each parameter's
within 1e-4 of its largest entry (fp32: the start-up self-check's tolerance; a per-head scalar such as a delta
rule's A_log sums its gradient over every token, and its rounding shows there first, up to 3e-5).

One packed data directory serves the whole module; each family is one start-up (a tiny random-init model from
tests/model_zoo.py's config, written as the run's `model_config`). The Mamba2 one-call families also run a row of
50 sequences inside one chunk; the latent-attention families (value heads smaller than query / key heads) also run
through a kernel that, as flash-attn's, takes one head size.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._train_helpers import one_thread, synthetic_sequence, write_config, write_packed  # noqa: F401
from tests.model_zoo import tiny_composite_config, tiny_config
from train.families import FAMILIES

EXACT = [t for t, spec in sorted(FAMILIES.items()) if spec.status == "exact" and not spec.composite_only]
RECURRENT = [t for t in EXACT if FAMILIES[t].mixers]  # composites run their text family's mixers
# one packed row: 56 sequences of 13 lengths, 2 to 31 tokens, in an order that mixes short and long (612 tokens)
ROW_LENGTHS = [(2, 3, 5, 7, 9, 13, 17, 24, 31, 4, 6, 11, 2, 19)[(5 * i) % 14] for i in range(56)]
# a row that fits in one Mamba2 chunk of 256 (transformers' default for Falcon-H1): 50 sequences of 2 to 8 tokens
SHORT_ROW_LENGTHS = [(2, 3, 4, 5, 6, 7, 8)[(3 * i) % 7] for i in range(50)]
ONE_CHUNK = 256
LOSS_BAR, GRAD_BAR, PARAMETER_BAR = 1e-6, 1e-6, 1e-4

pytestmark = pytest.mark.usefixtures("one_thread")


def _row(lengths: list[int]) -> list[dict]:
    rng = np.random.default_rng(43)
    return [synthetic_sequence(rng, n, 1 if n < 10 else 1 + i % 3, 1 + i % 2) for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def packed_row(tmp_path_factory):
    """The packed data directory (one row of ROW_LENGTHS) and its sequences."""
    row = _row(ROW_LENGTHS)
    return write_packed(tmp_path_factory.mktemp("family_startup") / "packed", [row]), row


@pytest.fixture(scope="module")
def short_row(tmp_path_factory):
    """The packed data directory of one row of SHORT_ROW_LENGTHS, and its sequences."""
    row = _row(SHORT_ROW_LENGTHS)
    return write_packed(tmp_path_factory.mktemp("family_startup_short") / "packed", [row]), row


def _model_config(model_type: str):
    spec = FAMILIES[model_type]
    return tiny_composite_config(model_type) if spec.text_family else tiny_config(model_type)


def _reference_class(config):
    """transformers' own class of the model: the composite's (the multimodal-LM mapping, which holds the image and
    the audio composites), else the causal LM's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MULTIMODAL_LM_MAPPING

    mapping = MODEL_FOR_MULTIMODAL_LM_MAPPING if FAMILIES[config.model_type].text_family \
        else MODEL_FOR_CAUSAL_LM_MAPPING
    return mapping[type(config)]


def _unpacked_reference(config, weights: dict, row: list[dict]):
    """transformers' own model of `config` (eager attention, in training mode as the trainer's, the trainer's
    initial `weights`) on each sequence alone: (loss of the step: the trained tokens' cross-entropy summed over the
    sequences over their count, gradients by parameter name). Sequences of one length run as one batch (no padding:
    each is still alone in its batch row)."""
    reference = _reference_class(config)._from_config(copy.deepcopy(config), attn_implementation="eager",
                                                      dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and not set(missing) & set(dict(reference.named_parameters())), (missing, unexpected)
    reference.train()
    ids, targets = [], []
    for seq in row:
        target = np.full(len(seq["labels"]), -100, dtype=np.int64)
        target[:-1] = seq["labels"][1:]
        ids.append(seq["input_ids"].astype(np.int64))
        targets.append(target)
    n_targets = int(sum((t != -100).sum() for t in targets))
    total = 0.0
    for length in sorted({len(i) for i in ids}):
        same = [k for k, i in enumerate(ids) if len(i) == length]
        logits = reference(input_ids=torch.from_numpy(np.stack([ids[k] for k in same])), use_cache=False).logits
        target = torch.from_numpy(np.stack([targets[k] for k in same]))
        total = total + F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum") / n_targets
    total.backward()
    return float(total.detach()), {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}


def run_one_step(model_type: str, data, tmp_path, config=None, **values):
    """Trainer start-up + one step on `data` for the tiny config of `model_type` (or `config`): (trainer, the
    step's record, the gradients before the update by the lm's parameter names, the initial weights)."""
    from train.config.sections import load_config
    from train.trainer import Trainer

    config = config if config is not None else _model_config(model_type)
    config.to_json_file(tmp_path / "model.json")
    run = write_config(tmp_path / "run.yaml", model_config=str(tmp_path / "model.json"), data_path=str(data),
                       output_dir=str(tmp_path / "out"), max_steps=1, grad_accum=1, micro_batch_rows=1, lr=1e-3,
                       max_grad_norm=0.0, loss_chunk_size=64, plot=False, output_router_logits=False, **values)
    lines = []
    trainer = Trainer(load_config(run), console=lines.append)
    assert any(line.startswith("self-check: packed = unpacked") for line in lines), lines
    weights = {name: t.detach().clone() for name, t in trainer.lm.state_dict().items()}
    grads = {}
    trainer.grad_hook = lambda tr: grads.update(
        {n.removeprefix("lm."): p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None})
    record = trainer.train_step(trainer.sampler.plan(0))
    return trainer, record, grads, weights


def gradient_errors(grads: dict, reference: dict) -> tuple[float, float, str]:
    """(the relative norm of the difference of all gradients together, the worst per-parameter difference relative
    to the parameter's largest entry (floor: 1e-3 of the model's largest), that parameter)."""
    scale = max(float(g.abs().max()) for g in reference.values())
    per_parameter = {name: float((grads[name] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale)
                     for name, g in reference.items()}
    worst = max(per_parameter, key=per_parameter.get)
    together = math.sqrt(sum(float((grads[n] - g).double().square().sum()) for n, g in reference.items())) / \
        math.sqrt(sum(float(g.double().square().sum()) for g in reference.values()))
    return together, per_parameter[worst], worst


def assert_step_matches_reference(trainer, record, grads, weights, row, what: str) -> None:
    loss, reference = _unpacked_reference(trainer.run.checked.model_config, weights, row)
    assert sorted(grads) == sorted(reference), f"{what}: {sorted(set(grads) ^ set(reference))}"
    together, worst_error, worst = gradient_errors(grads, reference)
    assert abs(record["loss"] - loss) <= LOSS_BAR * abs(loss), f"{what}: loss {record['loss']!r} vs unpacked {loss!r}"
    assert together <= GRAD_BAR, f"{what}: the gradients differ by {together:.1e} (relative norm)"
    assert worst_error <= PARAMETER_BAR, f"{what}: gradient of {worst} differs by {worst_error:.1e} (relative)"


@pytest.mark.parametrize("model_type", EXACT)
def test_exact_family_one_step_through_the_trainer(model_type, packed_row, tmp_path):
    data, row = packed_row
    trainer, record, grads, weights = run_one_step(model_type, data, tmp_path)
    assert record["tokens"] == sum(ROW_LENGTHS) and len(row) == len(ROW_LENGTHS)
    assert_step_matches_reference(trainer, record, grads, weights, row, model_type)


# the recurrent families whose mixers run a packed row in one call through the chunked Mamba2 scan
# (train/model/patches/recurrent.py ONE_CALL), each with the config key of its chunk size
MAMBA2_CHUNK_KEYS = {"falcon_h1": "mamba_chunk_size", "granitemoehybrid": "mamba_chunk_size",
                     "bamba": "mamba_chunk_size", "nemotron_h": "chunk_size", "zamba2": "chunk_size",
                     "mamba2": "chunk_size"}
# convolution windows and chunk sizes of the recurrent mixers, as their configs name them
CONVOLUTION_KEYS = ("conv_kernel", "mamba_d_conv", "conv_L_cache", "linear_conv_kernel_dim", "short_conv_kernel_size",
                    "mamba_conv_kernel", "conv1d_width")
CHUNK_KEYS = ("mamba_chunk_size", "chunk_size", "block_size")


def test_the_row_is_shaped_like_users_rows():
    """At least 50 sequences of mixed lengths, some shorter than every recurrent family's convolution window and
    chunk, some longer (so both the restarts inside a chunk and the states carried across chunks are exercised)."""
    assert len(ROW_LENGTHS) >= 50 and len(set(ROW_LENGTHS)) >= 10
    shortest, longest = min(ROW_LENGTHS), max(ROW_LENGTHS)
    checked = 0
    for model_type in RECURRENT:
        config = _model_config(model_type).get_text_config()
        for key in CONVOLUTION_KEYS + CHUNK_KEYS:
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 1:
                assert shortest < value, (model_type, key, value)
                checked += 1
                if key in CHUNK_KEYS:
                    assert longest > value, (model_type, key, value)
    assert checked >= len(MAMBA2_CHUNK_KEYS) * 2


def test_every_mamba2_one_call_family_is_listed():
    from train.model.patches.recurrent import MAMBA2, ONE_CALL

    one_call = {name for name, kernels in ONE_CALL.items() if kernels == MAMBA2}
    exact = {m for t in EXACT for m in FAMILIES[t].mixers}
    listed = {m for t in MAMBA2_CHUNK_KEYS for m in FAMILIES[t].mixers}
    assert one_call & exact == listed, "MAMBA2_CHUNK_KEYS lacks a family whose mixer runs the one-call Mamba2 scan"


@pytest.mark.parametrize("model_type", sorted(MAMBA2_CHUNK_KEYS))
def test_mamba2_family_row_within_one_chunk(model_type, short_row, tmp_path):
    """A row of 50 short sequences inside one chunk of 256 tokens (transformers' default chunks are 128-256 tokens):
    the one-call scan returned a tensor Falcon-H1's mixer could not `view` (issue 46)."""
    data, row = short_row
    config = tiny_config(model_type, **{MAMBA2_CHUNK_KEYS[model_type]: ONE_CHUNK})
    assert len(SHORT_ROW_LENGTHS) >= 50 and sum(SHORT_ROW_LENGTHS) <= ONE_CHUNK
    trainer, record, grads, weights = run_one_step(model_type, data, tmp_path, config=config)
    from train.model.patches.recurrent import SequenceRestart

    wrappers = [m for m in trainer.lm.modules() if isinstance(m, SequenceRestart)]
    assert wrappers and all(m.one_call for m in wrappers), "the mixers run once per sequence"
    assert_step_matches_reference(trainer, record, grads, weights, row, f"{model_type}, one chunk")


MLA_FAMILIES = ("deepseek_v3", "glm4_moe_lite", "minicpm3")


@pytest.mark.parametrize("model_type", MLA_FAMILIES)
def test_latent_attention_through_a_kernel_of_one_head_size(model_type, packed_row, tmp_path, monkeypatch):
    """Multi-head latent attention's value heads (16 here) are smaller than its query / key heads (8 + 8 + the
    padding to one size): through `attn_backend: flash_varlen` with flash-attn's constraint (q, k and v of one head
    size) simulated on the CPU, the step still equals transformers' unpacked forward."""
    from train.attention import varlen_kernels
    from train.attention.varlen_kernels import KERNELS, VarlenKernel

    config = tiny_config(model_type, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    calls = []

    def one_head_size(q, k, v, bounds, scale, features, sinks):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], (q.shape, k.shape, v.shape)
        calls.append(q.shape[-1])
        return varlen_kernels._sdpa_loop(q, k, v, bounds, scale, features, sinks)

    monkeypatch.setitem(KERNELS, "flash_attn", VarlenKernel("flash_attn", lambda q, features: [], one_head_size))
    data, row = packed_row
    trainer, record, grads, weights = run_one_step(model_type, data, tmp_path, config=config,
                                                   attn_backend="flash_varlen")
    assert trainer.plan.attention.train.every.name == "flash_varlen" and set(calls) == {24}
    assert_step_matches_reference(trainer, record, grads, weights, row, f"{model_type} through flash_varlen")
