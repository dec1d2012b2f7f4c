"""Tiled MLP (train/model/patches/tiled_mlp.py), one of the long-row options without sequence parallelism: it trains
exactly what the plain path trains, for every tileable family, with accumulation, LoRA, checkpointing and the MoE
router's aux loss; the trainer with both long-row options (tiled MLP and activation offload) trains the same steps, and
the config checks of both. Activation offload: test_offload.py beside this file; what the memory plan knows of both:
tests/train/plan/test_memory_long_rows.py.

Every exactness test runs the same weights and row twice, tiled and not, in fp32 on the CPU, and compares the loss and
every parameter's gradient (1e-6 relative to the largest gradient: the tiles' parameter gradients are sums in another
order). Each also checks that the tiled path really ran in several tiles, so a wiring that silently skipped them fails.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")
import train.model.patches.tiled_mlp as tiled_mlp
from common.config import ConfigError
from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from tests.model_zoo import VOCAB, tiny_config
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.families import FAMILIES
from train.model.support import UnsupportedModelError
from train.model.moe import RouterAux
from train.model.packed import PackedCausalLM
from train.model.patches.tiled_mlp import TiledCall, describe_tiling, install_tiled_mlp, tiling_plan

pytestmark = pytest.mark.usefixtures("one_thread")
EXACT = [model_type for model_type, spec in sorted(FAMILIES.items())  # causal LMs (composites: their text decoder)
         if spec.status == "exact" and not spec.text_family and not spec.composite_only]
TILEABLE = [m for m in EXACT if FAMILIES[m].untileable_mlp is None]
UNTILEABLE = [m for m in EXACT if FAMILIES[m].untileable_mlp is not None]
LENGTHS = (7, 11, 5, 9)  # one packed row of 32 tokens
TILE = 5  # tokens: 7 tiles, the last one short
RTOL = 1e-6

SDPA_KERNELS = LayerKernels(every=BACKENDS["sdpa"])  # every layer through the SDPA loop


def _lm(config, seed: int = 0):
    torch.manual_seed(seed)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._from_config(config, attn_implementation="packsft",
                                                                  dtype=torch.float32)


def _row(seed: int = 1, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (sum(lengths),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    weights = torch.rand(len(ids), generator=gen) / len(ids)
    return ids, positions, cu, weights


def _loss_and_grads(model: PackedCausalLM, rows, router_aux: bool = False):
    """The summed loss of `rows` (micro-batches accumulated into one backward each) and every gradient."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for ids, positions, cu, weights in rows:
        attn = AttentionContext.for_micro_batch(cu, torch.device("cpu"), SDPA_KERNELS)
        out = model(ids[None], positions[None], torch.roll(ids, -1), weights, torch.zeros(len(ids), dtype=torch.long),
                    attn)
        loss = out[0] + (out[3] if router_aux else 0.0)
        loss.backward()
        total += float(loss)
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, ref, what: str, rtol: float = RTOL):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert abs(loss - ref_loss) <= rtol * abs(ref_loss), f"{what}: loss {loss} vs {ref_loss}"
    assert grads.keys() == ref_grads.keys(), what
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref_grad in ref_grads.items():
        err = float((grads[name] - ref_grad).abs().max()) / scale
        assert err <= rtol, f"{what}: gradient of {name} off by {err:.2e} of the largest gradient"


@pytest.fixture
def tile_calls(monkeypatch):
    """How many tiled calls ran (forward) and how many tiles each cut."""
    calls = []
    apply = TiledCall.apply

    def counting(run, tile, n_tiled, rows, *tensors):
        calls.append(-(-rows.shape[0] // tile))
        return apply(run, tile, n_tiled, rows, *tensors)

    monkeypatch.setattr(TiledCall, "apply", counting)
    return calls


def _compare(config, tile_calls, rows=None, wrap=None, router_aux=None, rtol=RTOL, what=""):
    """(untiled, tiled) of the same weights; asserts the tiled path cut the row into several tiles."""
    rows = rows or [_row()]
    results = []
    for tiled in (False, True):
        lm = _lm(config)
        if tiled:
            install_tiled_mlp(lm, TILE)
        if wrap is not None:
            lm = wrap(lm)
        model = PackedCausalLM(lm, chunk_size=5, num_categories=1, router_aux=router_aux)
        before = len(tile_calls)
        results.append(_loss_and_grads(model, rows, router_aux is not None))
        if tiled:
            assert len(tile_calls) > before and min(tile_calls[before:]) > 1, "the tiled path did not run in tiles"
        else:
            assert len(tile_calls) == before
    _assert_same(results[1], results[0], what or config.model_type, rtol)


# ---------------------------------------------------------------------------------------------- tiled MLP
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen2_moe", "mixtral"])
def test_tiled_equals_untiled(model_type, tile_calls):
    _compare(tiny_config(model_type), tile_calls)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen2_moe"])
def test_tiled_equals_untiled_with_accumulation(model_type, tile_calls):
    """Two micro-batches accumulated into the same gradients."""
    _compare(tiny_config(model_type), tile_calls, rows=[_row(1), _row(2, (13, 3, 8))])


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_tiled_equals_untiled_with_lora(model_type, tile_calls):
    """LoRA adapters inside the tiled modules (dense projections; the experts' router and attention elsewhere)."""
    from peft import LoraConfig, get_peft_model

    def lora(lm):
        torch.manual_seed(3)
        model = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj",
                                                                                  "up_proj", "down_proj", "gate"]))
        for name, p in model.named_parameters():  # non-zero B, so the adapters change the MLP's output
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        return model

    _compare(tiny_config(model_type), tile_calls, wrap=lora)


@pytest.mark.parametrize("model_type", ["qwen2", "mixtral"])
def test_tiled_equals_untiled_under_checkpointing(model_type, tile_calls):
    def checkpointed(lm):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return lm

    _compare(tiny_config(model_type), tile_calls, wrap=checkpointed)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_moe_router_aux_loss_stays_exact(model_type, tile_calls):
    """Only the experts are tiled: the router runs once over the row, so the load-balancing loss (value and router
    gradient) is the untiled one."""
    config = tiny_config(model_type, output_router_logits=True)
    aux = RouterAux(config.num_experts if model_type == "qwen2_moe" else config.num_local_experts,
                    config.num_experts_per_tok, coef=0.5)
    _compare(config, tile_calls, router_aux=aux)
    assert set(tiling_plan(_lm(config)).values()) == {"experts"}


@pytest.mark.parametrize("model_type", TILEABLE)
def test_every_tileable_family_is_exact(model_type, tile_calls):
    """Every exact family the table does not mark untileable runs its feed-forwards in tiles exactly (1e-5: the
    sweep includes fp32 reductions of other shapes, e.g. xIELU activations)."""
    _compare(tiny_config(model_type), tile_calls, rtol=1e-5)


@pytest.mark.parametrize("model_type", UNTILEABLE)
def test_untileable_families_are_refused(model_type, monkeypatch):
    """The table's mark is the refusal's text, and the structure alone refuses too (the mark is not stale)."""
    spec = FAMILIES[model_type]
    lm = _lm(tiny_config(model_type))
    with pytest.raises(UnsupportedModelError, match="tiled_mlp") as err:
        install_tiled_mlp(lm, TILE)
    assert spec.untileable_mlp in str(err.value)
    monkeypatch.setitem(FAMILIES, model_type, dataclasses.replace(spec, untileable_mlp=None))
    with pytest.raises(UnsupportedModelError, match="tiled_mlp"):
        tiling_plan(lm)


def test_state_dict_names_stay_the_models():
    config = tiny_config("qwen2_moe")
    plain, tiled = _lm(config), _lm(config)
    install_tiled_mlp(tiled, TILE)
    assert list(tiled.state_dict()) == list(plain.state_dict())
    assert describe_tiling(tiled) == "tiled MLP (experts, 2 modules, 5-token tiles)"


def test_short_rows_skip_the_tiles(tile_calls):
    lm = _lm(tiny_config("qwen2"))
    install_tiled_mlp(lm, 64)
    _loss_and_grads(PackedCausalLM(lm, chunk_size=5, num_categories=1), [_row()])
    assert tile_calls == []


def test_dropout_inside_a_tile_replays_its_mask(tile_calls):
    """A random MLP (LoRA dropout): backward's recomputation must draw the forward's masks, tile by tile, so the
    gradient is that of the forward's value: checked by central differences along a random direction (the same RNG
    seed before each forward). A recomputation with fresh masks gives another gradient."""
    from peft import LoraConfig, get_peft_model

    def lora_dropout(lm):
        torch.manual_seed(3)
        model = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["gate_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        return model

    config = tiny_config("qwen2")
    lm = _lm(config)
    install_tiled_mlp(lm, TILE)
    model = PackedCausalLM(lora_dropout(lm), chunk_size=5, num_categories=1)
    name, weight = next((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    torch.manual_seed(7)
    _, grads = _loss_and_grads(model, [_row()])
    assert tile_calls and min(tile_calls) > 1
    direction = torch.randn_like(weight)
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            weight.add_(sign * 1e-2 * direction)
            torch.manual_seed(7)
            ids, positions, cu, weights = _row()
            attn = AttentionContext.for_micro_batch(cu, torch.device("cpu"), SDPA_KERNELS)
            values.append(float(model(ids[None], positions[None], torch.roll(ids, -1), weights,
                                      torch.zeros(len(ids), dtype=torch.long), attn)[0]))
            weight.sub_(sign * 1e-2 * direction)
    numeric = (values[0] - values[1]) / 2e-2
    assert numeric == pytest.approx(float((grads[name] * direction).sum()), rel=3e-3)


# ---------------------------------------------------------------------------------------------- trainer and config
def _config(tmp_path, name, **values):
    from train.config.sections import load_config

    data = tmp_path / "data"
    if not data.exists():
        write_packed(data, random_rows(5, 2))
        save_tiny_model(tmp_path / "model")
    path = write_config(tmp_path / f"{name}.yaml", data_path=str(data), model_path=str(tmp_path / "model"),
                        output_dir=str(tmp_path / f"out_{name}"), max_steps=2, lr=1e-3, max_grad_norm=0.0,
                        loss_chunk_size=8, plot=False, self_check=False, **values)
    return load_config(path)


def test_trainer_with_both_options_trains_the_same_steps(tmp_path, tile_calls):
    from train.trainer import Trainer

    plain = Trainer(_config(tmp_path, "plain", gradient_checkpointing=True), console=lambda *_: None).train()
    lines = []
    both = Trainer(_config(tmp_path, "both", tiled_mlp=True, tiled_mlp_tile=4, activation_offload=True),
                   console=lambda *_: None)
    both._console_write = lines.append
    assert both.plan.memory.checkpointing  # auto turned on by activation_offload
    records = both.train()
    assert tile_calls and min(tile_calls) > 1
    for got, ref in zip(records, plain, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
    start = next(line for line in lines if line.startswith("training"))
    assert "tiled MLP (dense, 2 modules, 4-token tiles)" in start
    assert "activation_offload" in start and "offloaded to host memory" in start


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="activation_offload.*gradient_checkpointing"):
        _config(tmp_path, "a", activation_offload=True, gradient_checkpointing=False).validate()
    with pytest.raises(ConfigError, match="tiled_mlp_tile must be >= 1"):
        _config(tmp_path, "b", tiled_mlp=True, tiled_mlp_tile=0).validate()
    with pytest.raises(ConfigError, match="tiled_mlp.*deepspeed.stage.*use distributed_backend=fsdp2"):
        _config(tmp_path, "c", tiled_mlp=True, deepspeed={"stage": 3}).validate()
    _config(tmp_path, "d", tiled_mlp=True, distributed_backend="fsdp2").validate()  # sharded weights, tiled MLPs
