"""gradient_checkpointing auto on a GPU: the memory estimate and the decision as pure functions."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests._train_helpers import ROOT, one_thread  # noqa: F401  (a fixture)

from train.plan.memory import (
    ModelShape,
    TowerShape,
    activation_bytes,
    activation_bytes_per_token_layer,
    choose_checkpointing,
    media_towers,
    model_state_bytes,
    tower_activation_bytes,
)

GIB = 1 << 30
# Qwen2.5-0.5B and -1.5B (config.json of the released models)
QWEN_05B = ModelShape(hidden=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64, intermediate=4864, vocab=151936)
QWEN_15B = ModelShape(hidden=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, intermediate=8960,
                      vocab=151936)


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_equals_the_built_model(tie):
    """The shape's count is exact for a Qwen2 model built from the same config."""
    from tests._train_helpers import tiny_model

    model = tiny_model(tie=tie)
    shape = ModelShape.from_hf_config(model.config)
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert shape.tied_embeddings is tie and shape.qkv_bias


def test_released_model_sizes():
    assert QWEN_05B.n_params == 494_032_768  # the published Qwen2.5-0.5B count
    assert abs(QWEN_15B.n_params - 1_543_714_304) / 1_543_714_304 < 1e-6  # Qwen2.5-1.5B


def test_per_layer_formula():
    # a · (12·h + 4·kv + 4·I) + 8·h, with a = 2 (bf16): Qwen2.5-0.5B
    assert activation_bytes_per_token_layer(QWEN_05B, 2) == 2 * (12 * 896 + 4 * 128 + 4 * 4864) + 8 * 896


def test_checkpointing_keeps_far_less():
    full = activation_bytes(QWEN_15B, 32768, 2, checkpointing=False, loss_chunk=4096)
    ckpt = activation_bytes(QWEN_15B, 32768, 2, checkpointing=True, loss_chunk=4096)
    assert ckpt < full / 5


@pytest.mark.parametrize(
    "shape,tokens,expected",
    # plain torch bf16 on an 80 GB H100 (~79 GiB free before the model loads): the measurements say the
    # 0.5B shape at 32K runs without checkpointing and the 1.5B shape does not fit (fp32 weights + AdamW)
    [(QWEN_05B, 8192, False), (QWEN_05B, 32768, False), (QWEN_15B, 32768, True), (QWEN_05B, 131072, True)],
)
def test_decision_on_an_h100(shape, tokens, expected):
    state = model_state_bytes(shape.n_params, shape.n_params, deepspeed_stage=None)
    decision = choose_checkpointing(shape, tokens, free_bytes=79 * GIB, state_bytes=state, act_bytes=2,
                                    loss_chunk=4096)
    assert decision.enabled is expected
    assert ("on" if expected else "off") in decision.describe()


def test_decision_is_monotone_in_free_memory():
    state = model_state_bytes(QWEN_05B.n_params, QWEN_05B.n_params, deepspeed_stage=None)
    verdicts = [choose_checkpointing(QWEN_05B, 32768, free * GIB, state, 2, 4096).enabled for free in range(8, 200, 8)]
    assert verdicts == sorted(verdicts, reverse=True) and verdicts[0] and not verdicts[-1]


def test_headroom():
    with pytest.raises(ValueError, match="headroom"):
        choose_checkpointing(QWEN_05B, 1024, GIB, 0, 2, 4096, headroom=1.0)
    needed = choose_checkpointing(QWEN_05B, 1024, 10**15, 0, 2, 4096).needed_bytes
    assert not choose_checkpointing(QWEN_05B, 1024, needed, 0, 2, 4096, headroom=0.0).enabled
    assert choose_checkpointing(QWEN_05B, 1024, needed, 0, 2, 4096, headroom=0.01).enabled


def test_model_state_bytes():
    n = 1000
    assert model_state_bytes(n, n, None) == 16 * n  # fp32 weights + grads + 2 Adam moments
    assert model_state_bytes(n, 0, None) == 4 * n  # frozen (LoRA base)
    assert model_state_bytes(n, n, 0, dp_size=4) == 16 * n  # bf16 w + g, 12 B fp32 master + moments
    assert model_state_bytes(n, n, 1, dp_size=4) == 2 * n + 2 * n + 3 * n
    assert model_state_bytes(n, n, 2, dp_size=4) == 2 * n + (2 * n + 12 * n) // 4
    assert model_state_bytes(n, n, 3, dp_size=4) == 16 * n // 4
    assert model_state_bytes(n, n, 2, dp_size=4, offload_optimizer=True) == 2 * n + 2 * n // 4


def test_partial_checkpointing_estimate():
    n = QWEN_15B.n_layers
    full = activation_bytes(QWEN_15B, 32768, 2, checkpointing=True, loss_chunk=4096)
    none = activation_bytes(QWEN_15B, 32768, 2, checkpointing=False, loss_chunk=4096)
    assert activation_bytes(QWEN_15B, 32768, 2, True, 4096, checkpointed_layers=n) == full
    assert activation_bytes(QWEN_15B, 32768, 2, True, 4096, checkpointed_layers=0) == none
    partial = [activation_bytes(QWEN_15B, 32768, 2, True, 4096, checkpointed_layers=k) for k in range(n + 1)]
    assert partial[:n] == sorted(partial[:n], reverse=True)  # each checkpointed layer saves memory, but the last:
    assert partial[n - 1] < partial[n]  # its activations are what one recomputed layer holds
    # one layer more checkpointed: its activations less, its input kept
    per_layer = activation_bytes_per_token_layer(QWEN_15B, 2)
    assert partial[5] - partial[6] == 32768 * (per_layer - 2 * QWEN_15B.hidden)
    with pytest.raises(ValueError, match="offload"):
        activation_bytes(QWEN_15B, 32768, 2, True, 4096, offload=True, checkpointed_layers=3)


def test_auto_checkpoints_the_fewest_layers_that_fit():
    state = model_state_bytes(QWEN_15B.n_params, QWEN_15B.n_params, deepspeed_stage=None)
    decision = choose_checkpointing(QWEN_15B, 32768, 79 * GIB, state, 2, 4096)
    k, n = decision.layers, QWEN_15B.n_layers
    assert 0 < k < n  # the 1.5B shape at 32K on 80 GB: some layers, not all
    available = int(79 * GIB * 0.9)
    fits = [state + activation_bytes(QWEN_15B, 32768, 2, True, 4096, checkpointed_layers=j) <= available
            for j in range(n + 1)]
    assert fits[k] and not fits[k - 1] and decision.planned_bytes <= available
    assert f"on for the first {k} of {n} layers" in decision.describe()
    layers = [choose_checkpointing(QWEN_15B, 32768, free * GIB, state, 2, 4096).layers for free in range(40, 200, 8)]
    assert layers == sorted(layers, reverse=True) and layers[0] == n - 1 and layers[-1] == 0
    assert choose_checkpointing(QWEN_15B, 32768, GIB, state, 2, 4096).layers == n - 1  # nothing fits: the least


def test_keep_checkpointing_recomputes_only_the_first_layers(one_thread):
    """keep_checkpointing(lm, 1) on a 2-layer model: layer 0's MLP runs twice per step (forward + recomputation),
    layer 1's once; the gradients equal the fully checkpointed model's."""
    import torch

    from tests._train_helpers import tiny_model
    from train.model.packed import checkpointed_decoder_layers, keep_checkpointing

    def step(k):
        torch.manual_seed(0)
        lm = tiny_model()
        lm.set_attn_implementation("eager")  # transformers' own forward: no packed rows needed here
        lm.train()
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        layers = checkpointed_decoder_layers(lm)
        if k is not None:
            keep_checkpointing(lm, k)
        calls = [0] * len(layers)
        for i, layer in enumerate(layers):
            layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(1))
        lm(input_ids=ids, labels=ids).loss.backward()
        return calls, {n: p.grad for n, p in lm.named_parameters()}

    (all_calls, all_grads), (calls, grads) = step(None), step(1)
    assert all_calls == [2, 2] and calls == [2, 1]
    for name, grad in all_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------- mixture of experts
def _qwen3_moe_config(**values):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe", **values)


@pytest.mark.parametrize("family,values", [
    ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=16)),
    ("deepseek_v3", dict(n_routed_experts=8, moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1)),
    ("mixtral", dict(num_local_experts=8, intermediate_size=16)),
])
def test_expert_params_equal_the_built_model(family, values):
    """The shape's routed-expert count (what EP splits) is exact for a tiny model of the family (meta weights),
    its dense first layer and shared experts excluded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                  num_key_value_heads=2, vocab_size=64, num_experts_per_tok=2, **values)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for name, p in lm.named_parameters() if ".experts." in name)
    shape = ModelShape.from_hf_config(config)
    assert shape.expert_params == experts and shape.n_experts == 8 and shape.top_k == 2
    assert shape.moe_layers == (2 if family == "deepseek_v3" else 3)


def test_qwen3_30b_a3b_shape():
    """The table's Qwen3-30B-A3B shape is what the released config gives, 30.5B parameters (the published count)."""
    from train.plan.memory import MOE_SHAPES

    config = _qwen3_moe_config(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                               head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                               num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False)
    shape = MOE_SHAPES["Qwen3-30B-A3B"]
    assert ModelShape.from_hf_config(config) == shape
    assert abs(shape.n_params - 30.5e9) / 30.5e9 < 0.005
    assert shape.matmul_params < shape.n_params / 9  # top 8 of 128 experts active per token


def test_expert_state_divided_by_expert_parallel_size():
    """Per-rank expert weights + gradients + AdamW state halve from EP 1 to EP 2 under the plain engine; under
    FSDP2 (fp32, sharded over every rank) the resident share is the same and the gathered layer halves; the
    all-to-all buffers are 4 · tokens · top_k · hidden · bytes, none without EP."""
    from train.plan.memory import MOE_SHAPES, all_to_all_bytes, gathered_experts_bytes

    shape = MOE_SHAPES["Qwen3-30B-A3B"]
    n, e = shape.n_params, shape.expert_params
    others = model_state_bytes(n - e, n - e, None, 8)
    per_rank = {ep: model_state_bytes(n, n, None, 8, expert_params=e, expert_parallel_size=ep) - others
                for ep in (1, 2, 8)}
    assert per_rank[1] == 16 * e and per_rank[2] * 2 == per_rank[1] and per_rank[8] * 8 == per_rank[1]
    assert model_state_bytes(n, n, None, 8, expert_params=e, expert_parallel_size=1) == model_state_bytes(n, n, None, 8)
    fsdp2 = [model_state_bytes(n, n, 3, 8, bf16=False, expert_params=e, expert_parallel_size=ep) for ep in (1, 2)]
    assert abs(fsdp2[0] - fsdp2[1]) <= 16
    assert gathered_experts_bytes(shape, 2) * 2 == gathered_experts_bytes(shape, 1) == 4 * e // 48
    assert all_to_all_bytes(shape, 1024, 2, 2) == 4 * 1024 * 8 * 2048 * 2
    assert all_to_all_bytes(shape, 1024, 2, 1) == 0 == all_to_all_bytes(QWEN_15B, 1024, 2, 2)


@pytest.mark.parametrize("engine", ["plain", "deepspeed", "fsdp2"])
def test_dense_plan_unchanged(tmp_path, engine):
    """A dense model's shape has no experts, and its model state is the count of before (no expert terms), bitwise,
    under every engine, whatever expert_parallel_size says."""
    from tests._train_helpers import tiny_model
    from train.config.sections import from_keys
    from train.plan.memory_plan import _model_state_bytes

    shape = ModelShape.from_hf_config(tiny_model().config)
    assert (shape.n_experts, shape.expert_params, shape.moe_layers) == (0, 0, 0)
    dense_fields = ("hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab",
                    "tied_embeddings", "qkv_bias")
    assert ModelShape(**{f: getattr(shape, f) for f in dense_fields}) == shape
    values = {"plain": {}, "deepspeed": {"deepspeed": {"stage": 2}}, "fsdp2": {"distributed_backend": "fsdp2"}}[engine]
    cfg = from_keys({"data_path": str(tmp_path), "output_dir": str(tmp_path / "out"), "model_config": "m.json",
                     **values})
    stage, bf16 = {"plain": (None, cfg.model.bf16), "deepspeed": (2, cfg.model.bf16), "fsdp2": (3, False)}[engine]
    before = model_state_bytes(shape.n_params, shape.n_params, stage, 4, bf16=bf16)
    assert _model_state_bytes(cfg, shape, 4, False) == before
    assert model_state_bytes(shape.n_params, shape.n_params, stage, 4, bf16=bf16, expert_parallel_size=2) == before


def test_memory_cli_shows_expert_parallelism():
    """`python -m train.plan.memory --expert-parallel 8`: Qwen3-30B-A3B on 8 GPUs, EP 1 and EP 8, both engines."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "train.plan.memory", "--expert-parallel", "8"], capture_output=True,
                         text=True, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| Qwen3-30B-A3B")]
    assert len(rows) == 4 and sum("| 16 of 128 |" in r for r in rows) == 2
    plain = {r.split("|")[3].strip(): float(r.split("|")[5].split()[0]) for r in rows if "| plain |" in r}
    assert plain["1"] == pytest.approx(8 * plain["8"], rel=1e-3)
    docs = (ROOT / "docs" / "TRAINING.md").read_text()
    assert all(f"  {row}\n" in docs for row in rows), "docs/TRAINING.md's EP table differs from the CLI's"


# ---------------------------------------------------------------------------------------------- media towers
# Qwen2.5-VL-7B's vision tower (config.json of the release: 32 blocks of width 1280, MLP 3420, spatial merge 2)
QWEN25_VL_TOWER = TowerShape("vision", hidden=1280, intermediate=3420, layers=32, positions_per_token=4, trained=True)


def test_tower_activations_follow_the_formula():
    """A trained tower keeps its blocks' activations per tower position (merge² patches per token), its block inputs
    under checkpointing; a frozen one only its output, the features at the media tokens."""
    tokens, a = 16384, 2
    trained = replace(QWEN_15B, towers=(QWEN25_VL_TOWER,))
    frozen = replace(QWEN_15B, towers=(replace(QWEN25_VL_TOWER, trained=False),))
    positions, block = tokens * 4, a * (16 * 1280 + 4 * 3420) + 8 * 1280
    features = tokens * a * QWEN_15B.hidden
    assert tower_activation_bytes(frozen, tokens, a, checkpointing=False) == features
    assert tower_activation_bytes(trained, tokens, a, checkpointing=False) == positions * 32 * block + features
    assert tower_activation_bytes(trained, tokens, a, checkpointing=True) == (
        positions * 32 * a * 1280 + positions * block + features)
    assert tower_activation_bytes(QWEN_15B, tokens, a, checkpointing=True) == 0  # a text model
    for checkpointing in (False, True):  # the term adds to the decoder's estimate
        assert (activation_bytes(trained, tokens, a, checkpointing, 4096)
                - activation_bytes(QWEN_15B, tokens, a, checkpointing, 4096)
                == tower_activation_bytes(trained, tokens, a, checkpointing))
    # two towers: the rank's tokens are the costlier tower's (a token is one kind), the features counted once
    audio = TowerShape("audio", hidden=1280, intermediate=5120, layers=32, positions_per_token=2, trained=True)
    both = replace(QWEN_15B, towers=(QWEN25_VL_TOWER, audio))
    assert tower_activation_bytes(both, tokens, a, True) == tower_activation_bytes(trained, tokens, a, True)


def test_tower_shapes_come_from_the_composite_config():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    vl = CONFIG_MAPPING["qwen2_vl"]()  # its tower's width is `embed_dim`, its MLP `mlp_ratio` times it
    (vision,) = media_towers(vl, ("video",), trained_vision=True)
    assert (vision.hidden, vision.intermediate, vision.layers, vision.positions_per_token, vision.trained) == (
        vl.vision_config.embed_dim, int(vl.vision_config.embed_dim * vl.vision_config.mlp_ratio),
        vl.vision_config.depth, 4, True)
    omni = CONFIG_MAPPING["qwen2_5_omni_thinker"]()
    assert [t.name for t in media_towers(omni, ("image", "video", "audio"))] == ["vision", "audio"]
    (audio,) = media_towers(omni, ("audio",), trained_audio=True)
    assert (audio.hidden, audio.intermediate, audio.layers, audio.positions_per_token) == (
        omni.audio_config.d_model, omni.audio_config.encoder_ffn_dim, omni.audio_config.encoder_layers, 2)
    assert media_towers(vl, ()) == ()


def test_trained_towers_turn_checkpointing_on(tmp_path, monkeypatch):
    """The memory plan (train/plan/memory_plan.py) counts the data's towers: with GPU memory that holds a text row
    without checkpointing, the same rows of video conversations with a trained vision tower are checkpointed; with
    the tower frozen they are not."""
    import torch

    from tests._media_inputs import tiny_config
    from tests._train_helpers import random_rows, write_config, write_packed
    from train.config.sections import load_config
    from train.plan import memory_plan as startup
    from train.preflight import preflight

    model_dir = tmp_path / "model"
    tiny_config("qwen2_5_omni_thinker").save_pretrained(model_dir)
    data = write_packed(tmp_path / "data", random_rows(5, 2))

    def plan(free: int, kinds=(), frozen=False):
        path = write_config(tmp_path / "train.yaml", data_path=str(data), model_config=str(model_dir / "config.json"),
                            output_dir=str(tmp_path / "out"), max_steps=1, bf16=False, loss_chunk_size=64,
                            freeze_vision_tower=frozen, tokenizer_mismatch="warn")
        cfg = load_config(path)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
        return startup.plan_memory(cfg, preflight(cfg, 1).model_config, 1, 1, 4096, False,
                                   device=torch.device("cuda"), media_kinds=kinds)

    shape = ModelShape.from_hf_config(tiny_config("qwen2_5_omni_thinker"))
    text_peak = startup.model_state_bytes(shape.n_params, shape.n_params, None) + activation_bytes(
        shape, 4096, 4, False, 64)
    # the text row fits without checkpointing, with room for a frozen tower's output (4,096 x 64 fp32: 1 MiB) but not
    # for a trained tower's activations (109 MB)
    free = int((text_peak + (4 << 20)) / 0.9)
    assert not plan(free).checkpointing
    assert plan(free, ("video",)).checkpointing
    assert not plan(free, ("video",), frozen=True).checkpointing
