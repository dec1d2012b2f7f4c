"""gradient_checkpointing auto on a GPU: the memory estimate and the decision as pure functions."""
from __future__ import annotations

import pytest

from tests._train_helpers import one_thread  # noqa: F401  (a fixture)

from train.plan.memory import (
    ModelShape,
    activation_bytes,
    activation_bytes_per_token_layer,
    choose_checkpointing,
    model_state_bytes,
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
