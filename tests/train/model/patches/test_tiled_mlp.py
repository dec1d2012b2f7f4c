"""Long rows without sequence parallelism: tiled MLP (train/model/patches/tiled_mlp.py) and activation offload
(train/model/patches/offload.py) train exactly what the plain path trains; the memory plan knows both.

Every exactness test runs the same weights and row twice, tiled / offloaded and not, in fp32 on the CPU, and compares
the loss and every parameter's gradient (1e-6 relative to the largest gradient: the tiles' parameter gradients are
sums in another order). Each also checks that the tiled path really ran in several tiles (or that the offload hooks
packed every layer's input), so a wiring that silently skipped them fails.
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
from train.model.patches.offload import HostOffload
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.families import FAMILIES
from train.plan.memory import (
    LONG_ROW_SHAPES,
    LongRowOptions,
    ModelShape,
    activation_bytes,
    choose_sp_degree,
    default_tile_tokens,
    host_offload_problem,
    longest_row,
    model_state_bytes,
    offload_host_bytes,
    row_fits,
    smallest_sp_degree,
)
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


# ---------------------------------------------------------------------------------------------- activation offload
@pytest.mark.parametrize("model_type", ["qwen2", "mixtral"])
def test_offload_equals_checkpointing_alone(model_type):
    config = tiny_config(model_type)
    results, offloads = [], []
    for offloaded in (False, True):
        lm = _lm(config)
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if offloaded:
            offload = HostOffload(copy_on_cpu=True)  # clones: the round trip through the hooks is exercised
            assert offload.install(lm) == config.num_hidden_layers
            offloads.append(offload)
        model = PackedCausalLM(lm, chunk_size=5, num_categories=1)
        results.append(_loss_and_grads(model, [_row(1), _row(2, (13, 3, 8))]))
    _assert_same(results[1], results[0], model_type)
    assert offloads[0].packed == 2 * config.num_hidden_layers  # every layer's input, in both micro-batches
    assert offloads[0]._last is None  # backward unpacked the chain: nothing held until the next forward


@pytest.mark.gpu
def test_offload_on_cuda_moves_the_layer_inputs_to_pinned_host_memory_and_stays_exact():
    """The CUDA path (device-to-host copies on a side stream, copies back prefetched in backward): fp32 loss and
    gradients those of checkpointing alone, and at the end of forward the layer inputs are off the GPU, in pinned
    host buffers."""
    device = torch.device("cuda")
    config = tiny_config("qwen2", num_hidden_layers=6, layer_types=["full_attention"] * 6)
    ids, positions, cu, weights = _row(3, (4096, 6000, 2000, 4288))  # 16,384 tokens: 4 MiB a layer input
    results, after_forward = [], []
    for offloaded in (False, True):
        lm = _lm(config).to(device)
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        offload = HostOffload() if offloaded else None
        if offload is not None:
            assert offload.install(lm) == 6
        model = PackedCausalLM(lm, chunk_size=1024, num_categories=1)
        attn = AttentionContext.for_micro_batch(cu, device, SDPA_KERNELS)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(ids[None].to(device), positions[None].to(device), torch.roll(ids, -1).to(device),
                     weights.to(device), torch.zeros(len(ids), dtype=torch.long, device=device), attn)[0]
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # the allocator takes back the blocks whose copies have finished
        after_forward.append(torch.cuda.memory_allocated() - before)
        if offload is not None:
            assert offload.packed == 6 and offload._last.host.is_pinned() and offload._last.host.device.type == "cpu"
        loss.backward()
        torch.cuda.synchronize()
        results.append((float(loss.detach()), {n: p.grad.cpu() for n, p in model.named_parameters()
                                               if p.grad is not None}))
        if offload is not None:
            assert offload._last is None  # backward unpacked the chain
    _assert_same(results[1], results[0], "qwen2 on CUDA")
    layer_input = len(ids) * config.hidden_size * 4
    assert after_forward[0] - after_forward[1] >= 4 * layer_input, after_forward


def test_offload_needs_checkpointing():
    with pytest.raises(ValueError, match="checkpointing"):
        HostOffload().install(_lm(tiny_config("qwen2")))


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


# ---------------------------------------------------------------------------------------------- memory plan
QWEN_15B = LONG_ROW_SHAPES["Qwen2.5-1.5B"]
GB = 10**9
GIB = 2**30


def test_tiled_mlp_keeps_one_tile_of_intermediates():
    tokens, tile = 65536, 4096
    plain = activation_bytes(QWEN_15B, tokens, 2, checkpointing=False, loss_chunk=4096)
    tiled = activation_bytes(QWEN_15B, tokens, 2, checkpointing=False, loss_chunk=4096, tile=tile)
    mlp = 2 * 4 * QWEN_15B.intermediate
    assert plain - tiled == QWEN_15B.n_layers * tokens * mlp - tile * mlp
    ckpt = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096)
    ckpt_tiled = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096, tile=tile)
    assert ckpt - ckpt_tiled == (tokens - tile) * mlp


def test_offload_leaves_two_layer_inputs():
    tokens = 65536
    kept = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096)
    offloaded = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096, offload=True)
    assert kept - offloaded == (QWEN_15B.n_layers - 2) * tokens * 2 * QWEN_15B.hidden


def test_default_tile():
    assert default_tile_tokens(8960, 2) == 3584  # Qwen2.5-1.5B, bf16: 3584 x 4 x 8960 x 2 B <= 256 MiB
    assert default_tile_tokens(8960, 2) * 4 * 8960 * 2 <= 256 << 20
    assert default_tile_tokens(10**7, 4) == 1024  # never below 1024 tokens


def test_smallest_sp_degree_is_the_first_that_fits():
    state = model_state_bytes(QWEN_15B.n_params, QWEN_15B.n_params, 3, 8, bf16=True)
    options = LongRowOptions(checkpointing=True)
    row = 1 << 20
    k = smallest_sp_degree(QWEN_15B, row, 80 * GB, state, options)
    assert k is not None and k > 1
    assert row_fits(QWEN_15B, row // k, 80 * GB, state, options)
    assert not row_fits(QWEN_15B, -(-row // (k // 2)), 80 * GB, state, options)
    both = LongRowOptions(True, default_tile_tokens(QWEN_15B.intermediate, 2), True)
    assert smallest_sp_degree(QWEN_15B, row, 80 * GB, state, both) < k  # the options save sp ranks
    assert smallest_sp_degree(QWEN_15B, row, 80 * GB, 10**12, options) is None  # the state alone does not fit
    longest = longest_row(QWEN_15B, 80 * GB, state, options)
    assert row_fits(QWEN_15B, longest, 80 * GB, state, options)
    assert not row_fits(QWEN_15B, longest + 1024, 80 * GB, state, options)
    assert smallest_sp_degree(QWEN_15B, longest, 80 * GB, state, options) == 1


def test_offload_host_memory_is_every_layer_input_in_power_of_two_buffers():
    llama = LONG_ROW_SHAPES["Llama-3-8B"]
    assert offload_host_bytes(llama, 524288, 2) == 32 * 524288 * 4096 * 2 == 128 * GIB  # 4 GiB a layer
    assert offload_host_bytes(llama, 393216, 2) == 128 * GIB  # 3 GiB a layer, rounded up to 4 by torch's allocator
    assert offload_host_bytes(llama, 262144, 2) == 64 * GIB
    assert offload_host_bytes(QWEN_15B, 131072, 2) == 28 * 512 * 2**20  # 384 MiB a layer, in 512 MiB buffers
    assert host_offload_problem(llama, 262144, 2, None) is None  # the host unknown: not checked
    assert host_offload_problem(llama, 262144, 2, 80 * GIB) is None  # 64 GiB <= 90% of 80
    problem = host_offload_problem(llama, 262144, 2, 140 * GIB, ranks=2)  # two ranks share the machine
    assert problem == ("activation_offload: a 262,144-token micro-batch per rank keeps 64.0 GiB of pinned host memory "
                       "(32 layers × 2.00 GiB: 262,144 tokens × 4096 hidden × 2 bytes, rounded up to a power of two by "
                       "torch's pinned allocator); this machine has 140.0 GiB available, 63.0 GiB usable per rank for "
                       "its 2 ranks")


def test_the_host_bounds_offload_in_the_plan():
    llama = LONG_ROW_SHAPES["Llama-3-8B"]
    state = model_state_bytes(llama.n_params, 0, 3, 8, bf16=True)  # adapters only: the frozen base's state
    options = LongRowOptions(True, default_tile_tokens(llama.intermediate, 2), True)
    row = 1 << 19
    assert row_fits(llama, row // 4, 80 * GB, state, options)  # 128K per rank (32 GiB pinned): the GPU holds it
    assert row_fits(llama, row // 4, 80 * GB, state, options, host_bytes=120 * GIB, host_ranks=4) is False  # 27 each
    assert row_fits(llama, row // 4, 80 * GB, state, options, host_bytes=120 * GIB, host_ranks=1)  # 108 GiB usable
    assert row_fits(llama, row // 4, 80 * GB, state, LongRowOptions(True), host_bytes=1) == row_fits(
        llama, row // 4, 80 * GB, state, LongRowOptions(True))  # no offload: nothing asked of the host
    gpu_only = choose_sp_degree(llama, row, 8, 80 * GB, state, options).degree
    roomy = 8 * offload_host_bytes(llama, row // gpu_only, 2) * 10 // 9 + GIB  # 8 ranks on one machine
    assert choose_sp_degree(llama, row, 8, 80 * GB, state, options, host_bytes=roomy, host_ranks=8).degree == gpu_only
    tight = choose_sp_degree(llama, row, 8, 80 * GB, state, options, host_bytes=roomy // 2, host_ranks=8)
    assert tight.degree == 2 * gpu_only  # the host, not the GPU, asks for more ranks
    with pytest.raises(ValueError, match=r"over all 8 ranks \(sp degrees tried: \[1, 2, 4, 8\]\), activation_offload: "
                                         r"a 65,536-token micro-batch per rank keeps 16.0 GiB.* usable per rank for its "
                                         r"8 ranks; try more GPUs \(more machines\), activation_offload: false"):
        choose_sp_degree(llama, row, 8, 80 * GB, state, options, host_bytes=40 * GIB, host_ranks=8)


def test_the_memory_plan_refuses_an_offload_the_host_cannot_hold(tmp_path, monkeypatch):
    """Checked before any weight loads, on a GPU only (CUDA faked: the device type and the host query are used)."""
    import train.plan.memory_plan as startup
    from train.preflight import preflight

    cfg = _config(tmp_path, "offload", activation_offload=True)
    model_config = preflight(cfg, 1).model_config
    shape = ModelShape.from_hf_config(model_config)
    assert cfg.steps.micro_batch_rows == 1
    need = offload_host_bytes(shape, 4096 // 2, 2 if cfg.model.bf16 else 4)
    monkeypatch.setattr(startup, "available_host_bytes", lambda: int(need / 0.9) - 1)

    def plan(device):
        return startup.plan_memory(cfg, model_config, 1, 1, 4096 // 2, False, device=torch.device(device))

    plan("cpu")  # on a CPU device the offload keeps its tensors: nothing to check
    monkeypatch.setattr(startup, "_choose_checkpointing", lambda *args: (True, None, "on"))  # no GPU to query
    with pytest.raises(ConfigError, match=r"a 2,048-token micro-batch per rank keeps .*; set a larger "
                                          r"sequence_parallel_size \(or auto\), shorter rows \(max_length\) or "
                                          r"activation_offload: false"):
        plan("cuda")
    monkeypatch.setattr(startup, "available_host_bytes", lambda: int(need / 0.9) + 8)
    plan("cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share that memory
    with pytest.raises(ConfigError, match="usable per rank for its 2 ranks"):
        plan("cuda")


def test_offload_without_checkpointing_is_not_a_plan():
    with pytest.raises(ValueError, match="checkpointing"):
        LongRowOptions(checkpointing=False, offload=True)


# ---------------------------------------------------------------------------------------------- sequence_parallel_size: auto
def test_sp_auto_is_the_smallest_degree_of_the_world_that_fits():
    state = model_state_bytes(QWEN_15B.n_params, QWEN_15B.n_params, 3, 8, bf16=True)
    options = LongRowOptions(checkpointing=True)
    row = 1 << 20
    choice = choose_sp_degree(QWEN_15B, row, 8, 80 * GB, state, options)
    assert choice.degree == smallest_sp_degree(QWEN_15B, row, 80 * GB, state, options) > 1
    assert row_fits(QWEN_15B, row // choice.degree, 80 * GB, state, options)
    assert not row_fits(QWEN_15B, row // (choice.degree // 2), 80 * GB, state, options)
    assert f"{row // choice.degree:,} tokens per rank fit" in choice.describe()
    assert choose_sp_degree(QWEN_15B, 4096, 8, 80 * GB, state, options).degree == 1  # short rows: data parallel
    # only degrees dividing the world: 6 GPUs offer 1 and 2, not enough for this row
    with pytest.raises(ValueError, match=r"1,048,576-token row does not fit .* all 6 ranks .*\[1, 2\].*tiled_mlp: true"):
        choose_sp_degree(QWEN_15B, row, 6, 80 * GB, state, options)


def test_sp_auto_in_the_layout(tmp_path, monkeypatch):
    """The layout sizes the data's rows against the least free GPU memory (the memory plan's estimate): with just
    enough for half a row it picks 2 (CUDA faked: only the memory query is used); on CPU it keeps 1 and says why; the
    config it was given stays `auto`."""
    import train.plan.memory_plan as memory_plan
    from train.plan.layout import plan_layout
    from train.preflight import preflight

    row = 4096
    write_packed(tmp_path / "data", random_rows(5, 2), meta_extra={"max_length": row})
    save_tiny_model(tmp_path / "model")
    cfg = _config(tmp_path, "auto", sequence_parallel_size="auto", launch={"num_processes": 2})
    cfg.validate(world_size=3)  # auto: no divisibility rule before the degree is chosen
    model_config = preflight(cfg, 2).model_config
    layout = plan_layout(cfg, model_config, 2, row, False)
    assert (layout.sp, layout.sp_reason) == (1, "auto: no CUDA device to size the rows against")
    assert cfg.parallel.sequence_parallel_size == "auto"

    shape = ModelShape.from_hf_config(model_config)
    state = memory_plan._model_state_bytes(cfg, shape, 2, False)
    options = LongRowOptions(checkpointing=True)
    needed = state + activation_bytes(shape, row // 2, 4, True, cfg.steps.loss_chunk_size)
    free = int(needed / 0.9) + 1  # the plan keeps 10% headroom
    assert not row_fits(shape, row, free, state, options, act_bytes=4, loss_chunk=cfg.steps.loss_chunk_size)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(memory_plan.dist, "is_initialized", lambda: False)  # one rank's memory (a group of earlier tests)
    layout = plan_layout(cfg, model_config, 2, row, False)
    assert layout.sp == 2 and layout.sp_reason.startswith("auto: 4,096-token micro-batches, 2,048 tokens per rank fit")
    assert layout.dp == 1 and cfg.parallel.sequence_parallel_size == "auto"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state, 2 * state))
    with pytest.raises(ConfigError, match="sequence_parallel_size: auto: a 4,096-token row does not fit"):
        plan_layout(cfg, model_config, 2, row, False)


def test_sp_auto_trains_and_says_so(tmp_path):
    from train.trainer import Trainer

    lines = []
    trainer = Trainer(_config(tmp_path, "auto_run", sequence_parallel_size="auto"),
                      console=lambda *_: None)
    trainer._console_write = lines.append
    trainer.train()
    assert trainer.mesh.sp_size == 1 and trainer.plan.layout.sp == 1
    assert trainer.cfg.parallel.sequence_parallel_size == "auto"  # the config as written: the choice is the plan's
    assert "sp 1 [auto: no CUDA device to size the rows against]" in next(l for l in lines if l.startswith("training"))
    with pytest.raises(ConfigError, match="sp_ulysses_size=2 needs a fixed sequence_parallel_size"):
        _config(tmp_path, "auto_u", sequence_parallel_size="auto", sp_ulysses_size=2).validate()
