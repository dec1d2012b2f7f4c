"""Recurrent mixers restarted at packed-sequence boundaries (train/recurrent.py).

For tiny random-init hybrid and state-space models of each family: a packed row of four sequences through the
body with the packsft attention equals each sequence alone through the same model with eager attention (outputs
and every parameter's gradient, fp32), with and without activation checkpointing; and without the boundaries the
same packed row leaks between sequences (the comparison is sensitive to the restart).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import train.attention  # noqa: F401  (registers attn_implementation="packsft")
from train.attention import BACKENDS, AttentionContext, LayerKernels
from train.model_support import UnsupportedModelError
from train.recurrent import (
    SequenceRestart,
    install_sequence_restart,
    recurrent_mixers,
    sequence_parallel_problem,
)

from tests.model_zoo import RECURRENT_FAMILIES as FAMILIES

VOCAB = 128
LENGTHS = (7, 11, 5, 9)
TOLERANCE = 1e-5

COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)

SDPA_KERNELS = LayerKernels(every=BACKENDS["sdpa"])  # every layer through the SDPA loop


def tiny_model(model_type: str) -> nn.Module:
    """A random-init fp32 causal LM of `model_type`: COMMON's sizes where the config has them, the family's
    settings, every dropout 0."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    settings = {key: value for key, value in COMMON.items() if hasattr(defaults, key)}
    settings.update({
        key: 0.0 for key in dir(defaults)
        if not key.startswith("_") and "dropout" in key and isinstance(getattr(defaults, key, None), float)
    })
    settings.update(FAMILIES[model_type])
    config = config_class(**settings)
    torch.manual_seed(0)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return model_class._from_config(config, attn_implementation="eager", dtype=torch.float32).train()


def sequences(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


def body_of(lm: nn.Module) -> nn.Module:
    if hasattr(lm, "get_base_model"):
        lm = lm.get_base_model()
    return getattr(lm, lm.base_model_prefix)


def head_of(lm: nn.Module) -> nn.Module:
    return (lm.get_base_model() if hasattr(lm, "get_base_model") else lm).get_output_embeddings()


def next_token_loss(logits: torch.Tensor, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross entropy of each sequence within its own span of `logits` [T, V]."""
    total, start = 0.0, 0
    for seq in seqs:
        total = total + F.cross_entropy(logits[start : start + len(seq) - 1], seq[1:], reduction="sum")
        start += len(seq)
    return total


def logits_and_grads(lm: nn.Module, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`run(lm) -> (logits [T, V], loss)`, backward; the logits and every parameter's gradient."""
    lm.zero_grad(set_to_none=True)
    logits, loss = run(lm)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def each_alone(seqs):
    """Reference: eager attention, no boundaries, one sequence per call (body + head: the head's own soft-capping,
    where a family has one, is not part of what the trainer computes)."""

    def run(lm):
        lm.set_attn_implementation("eager")
        hidden = [body_of(lm)(input_ids=seq[None], use_cache=False).last_hidden_state[0] for seq in seqs]
        logits = head_of(lm)(torch.cat(hidden))
        return logits, next_token_loss(logits, seqs)

    return run


def packed(seqs, layers=None):
    """The packed row through the body with the packsft attention (boundaries set on `layers` when given)."""

    def run(lm):
        lm.set_attn_implementation("packsft")
        cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
        attn = AttentionContext(cu_seqlens, max(LENGTHS), SDPA_KERNELS)
        if layers is not None:
            layers.set_boundaries(attn.bounds.host_cu_q)
        input_ids = torch.cat(seqs)[None]
        position_ids = torch.cat([torch.arange(len(seq)) for seq in seqs])[None]
        hidden = body_of(lm)(input_ids=input_ids, position_ids=position_ids, use_cache=False, packsft=attn)
        logits = head_of(lm)(hidden.last_hidden_state[0])
        return logits, next_token_loss(logits, seqs)

    return run


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def assert_same(actual, expected, label: str) -> None:
    logits, grads = actual
    ref_logits, ref_grads = expected
    assert relative_error(logits, ref_logits) < TOLERANCE, f"{label}: logits differ"
    assert set(grads) == set(ref_grads), f"{label}: different parameters got gradients"
    worst = max(ref_grads, key=lambda name: relative_error(grads[name], ref_grads[name]))
    error = relative_error(grads[worst], ref_grads[worst])
    assert error < TOLERANCE, f"{label}: gradient of {worst} differs by {error:.1e} (relative)"


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_packed_row_equals_each_sequence_alone(model_type):
    lm = tiny_model(model_type)
    seqs = sequences()
    reference = logits_and_grads(lm, each_alone(seqs))
    leaking = logits_and_grads(lm, packed(seqs))  # the mixers unwrapped: the row leaks between sequences
    assert relative_error(leaking[0], reference[0]) > 10 * TOLERANCE, "the tiny model hides the leak"

    layers = install_sequence_restart(lm)
    assert layers.names, f"{model_type}: no recurrent mixer wrapped"
    assert_same(logits_and_grads(lm, packed(seqs, layers)), reference, model_type)
    layers.clear()
    assert_same(logits_and_grads(lm, each_alone(seqs)), reference, f"{model_type} unpacked after clear()")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_packed_row_exact_with_activation_checkpointing(model_type):
    """The backward recomputes the checkpointed layers after the forward returned: the boundaries must still be
    there."""
    lm = tiny_model(model_type)
    seqs = sequences()
    reference = logits_and_grads(lm, each_alone(seqs))
    layers = install_sequence_restart(lm)
    lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert_same(logits_and_grads(lm, packed(seqs, layers)), reference, f"{model_type} checkpointed")


def test_packed_row_exact_through_lora():
    """LoRA injected after the wrappers (the trainer's order: build_lm applies LoRA, then the restart is installed
    on the PEFT model, or the other way round): adapters inside the mixers train exactly."""
    from train.lora import apply_lora

    for install_first in (True, False):
        lm = tiny_model("qwen3_next")
        seqs = sequences()
        layers = install_sequence_restart(lm) if install_first else None
        lm = apply_lora(lm, 4, lora_alpha=8.0)
        for name, p in lm.named_parameters():  # LoRA B starts at 0: make the adapters matter
            if "lora_B" in name:
                nn.init.normal_(p, std=0.1)
        layers = layers or install_sequence_restart(lm)
        assert any(".linear_attn.in_proj_qkvz.lora_A" in name for name, _ in lm.named_parameters())
        layers.clear()
        reference = logits_and_grads(lm, each_alone(seqs))
        assert_same(logits_and_grads(lm, packed(seqs, layers)), reference, f"lora, install first: {install_first}")


def test_wrapping_keeps_names_state_dict_and_unpacked_outputs():
    lm = tiny_model("qwen3_next").eval()
    names = [name for name, _ in lm.named_parameters()]
    state = {key: value.clone() for key, value in lm.state_dict().items()}
    ids = sequences()[1][None]
    before = lm(input_ids=ids, use_cache=False).logits

    layers = install_sequence_restart(lm)
    assert layers.wrapped == {"model.layers.0.linear_attn": "Qwen3NextGatedDeltaNet"}
    assert isinstance(lm.model.layers[0].linear_attn, SequenceRestart)
    assert [name for name, _ in lm.named_parameters()] == names
    assert lm.state_dict().keys() == state.keys()
    lm.load_state_dict(state)  # a checkpoint of the unwrapped model loads into the wrapped one
    assert torch.equal(lm(input_ids=ids, use_cache=False).logits, before)  # no boundaries: a plain HF call
    assert lm.model.layers[0].linear_attn.layer_idx == 0  # the mixer's attributes read through the wrapper
    lm.train()
    assert lm.model.layers[0].linear_attn.mixer.training
    assert install_sequence_restart(lm).wrapped == layers.wrapped  # idempotent


def test_boundaries_that_do_not_cover_the_input_raise():
    lm = tiny_model("mamba")
    layers = install_sequence_restart(lm)
    layers.set_boundaries([0, 4, 9])
    with pytest.raises(ValueError, match="cover 9 tokens, the input has 10"):
        lm(input_ids=torch.arange(3, 13)[None], use_cache=False)
    with pytest.raises(ValueError, match="strictly increase"):
        layers.set_boundaries([0, 4, 4, 9])


def test_plain_transformer_has_nothing_to_restart():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB)
    lm = LlamaForCausalLM(config)
    assert recurrent_mixers(lm) == []
    assert not install_sequence_restart(lm)
    assert sequence_parallel_problem(lm) is None
    assert sequence_parallel_problem(config) is None


class SequenceConvolution(nn.Module):
    """A token mixer of a family the restart table does not know: a causal convolution over the sequence."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel_size=3, groups=width, padding=2)

    def forward(self, hidden_states):
        return self.conv(hidden_states.transpose(1, 2))[..., : hidden_states.shape[1]].transpose(1, 2)


def test_unknown_recurrent_family_is_flagged_and_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    lm = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB))
    lm.model.layers[1].mlp = SequenceConvolution(64)
    assert recurrent_mixers(lm) == ["model.layers.1.mlp"]
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp"):
        install_sequence_restart(lm)
    assert "model.layers.1.mlp" in sequence_parallel_problem(lm)


def test_sequence_parallel_refuses_recurrent_families():
    lm = tiny_model("qwen3_next")
    problem = sequence_parallel_problem(lm.config)  # from the config alone (a meta-device model)
    assert "qwen3_next" in problem and "Qwen3NextGatedDeltaNet" in problem
    assert "model.layers.0.linear_attn" in problem and "sequence_parallel_size=1" in problem
    install_sequence_restart(lm)
    assert sequence_parallel_problem(lm) == problem  # wrapped or not, the mixers are the same
