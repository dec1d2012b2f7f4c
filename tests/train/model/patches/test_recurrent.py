"""Recurrent mixers restarted at packed-sequence boundaries (train/model/patches/recurrent.py).

For tiny random-init hybrid and state-space models of each family: a packed row of four sequences through the
body with the packsft attention equals each sequence alone through the same model with eager attention (outputs
and every parameter's gradient, fp32), with and without activation checkpointing; and without the boundaries the
same packed row leaks between sequences (the comparison is sensitive to the restart).
"""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")
from train.model.patches import recurrent_kernels as kernels
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.model.self_check import GRAD_FLOOR, TOLERANCES
from train.model.support import UnsupportedModelError
from train.model.patches.recurrent import (
    KNOWN_MIXERS,
    ONE_CALL,
    ROW_KERNELS,
    SHORT_CONVOLUTION,
    RecurrentLayers,
    SequenceRestart,
    install_sequence_restart,
    recurrent_mixers,
    sequence_parallel_problem,
)
from train.row import Row, RowHolder

from tests.model_zoo import RECURRENT_FAMILIES as FAMILIES

VOCAB = 128
LENGTHS = (7, 11, 5, 9)
TOLERANCE = 1e-5  # logits
LOSS_TOLERANCE = 2e-6
# gradients: the conformance suite's fp32 tolerance. The one-call forms cut the chunks elsewhere than each sequence
# alone does, so float sums run in another order; on gradients that sum many nearly cancelling terms (A_log,
# dt_bias of a gated delta net across chunks) that is ~2e-5, as much as transformers' own chunked and token-by-token
# forms of the same rule differ there (1.3e-5) or its chunks of 16 and 64 (1.4e-5)
GRAD_TOLERANCE = TOLERANCES[torch.float32][1]

COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)

SDPA_KERNELS = LayerKernels(every=BACKENDS["sdpa"])  # every layer through the SDPA loop


def tiny_model(model_type: str, **overrides) -> nn.Module:
    """A random-init fp32 causal LM of `model_type`: COMMON's sizes where the config has them, the family's
    settings, `overrides`, every dropout 0."""
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
    settings.update(overrides)
    config = config_class(**settings)
    torch.manual_seed(0)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return model_class._from_config(config, attn_implementation="eager", dtype=torch.float32).train()


def sequences(seed: int = 1, lengths: tuple[int, ...] = LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


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


def logits_and_grads(lm: nn.Module, run) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """`run(lm) -> (logits [T, V], loss)`, backward; the logits, the loss and every parameter's gradient."""
    lm.zero_grad(set_to_none=True)
    logits, loss = run(lm)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}
    return logits.detach(), float(loss), grads


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
        lengths = [len(seq) for seq in seqs]
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        attn = AttentionContext(cu_seqlens, max(lengths), SDPA_KERNELS)
        if layers is not None:
            layers.set_row(attn.bounds)
        input_ids = torch.cat(seqs)[None]
        position_ids = torch.cat([torch.arange(len(seq)) for seq in seqs])[None]
        hidden = body_of(lm)(input_ids=input_ids, position_ids=position_ids, use_cache=False, packsft=attn)
        logits = head_of(lm)(hidden.last_hidden_state[0])
        return logits, next_token_loss(logits, seqs)

    return run


def wrappers_of(lm: nn.Module) -> list[SequenceRestart]:
    return [module for module in lm.modules() if isinstance(module, SequenceRestart)]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def assert_same(actual, expected, label: str) -> None:
    """Logits and loss as the reference, and every parameter's gradient, measured as the conformance suite measures
    it (train/model/self_check.py: against the larger of its own magnitude and GRAD_FLOOR of the largest gradient, so
    that a gradient summed from terms that nearly cancel is not judged on its rounding noise alone)."""
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = actual, expected
    assert relative_error(logits, ref_logits) < TOLERANCE, f"{label}: logits differ"
    assert abs(loss - ref_loss) <= LOSS_TOLERANCE * abs(ref_loss), f"{label}: loss {loss} vs {ref_loss}"
    assert set(grads) == set(ref_grads), f"{label}: different parameters got gradients"
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    errors = {
        name: float((grads[name] - g).abs().max()) / max(float(g.abs().max()), GRAD_FLOOR * scale, 1e-30)
        for name, g in ref_grads.items()
    }
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_TOLERANCE, f"{label}: gradient of {worst} differs by {errors[worst]:.1e} (relative)"


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_packed_row_equals_each_sequence_alone(model_type):
    lm = tiny_model(model_type)
    seqs = sequences()
    reference = logits_and_grads(lm, each_alone(seqs))
    leaking = logits_and_grads(lm, packed(seqs))  # the mixers unwrapped: the row leaks between sequences
    assert relative_error(leaking[0], reference[0]) > 10 * TOLERANCE, "the tiny model hides the leak"

    layers = install_sequence_restart(lm)
    assert layers.names, f"{model_type}: no recurrent mixer wrapped"
    for wrapper in wrappers_of(lm):  # the families of ONE_CALL take the whole row in one call, the others loop
        assert wrapper.one_call == (type(wrapper.mixer).__name__ in ONE_CALL), f"{model_type}: {wrapper}"
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


# families whose chunked delta rules run in chunks of 64 (transformers' default): sequences that cross chunk
# boundaries, one that starts on one, a one-token sequence, so that the state carried between chunks is exercised
CHUNKED_DELTA_RULES = ("qwen3_next", "olmo_hybrid", "kimi_linear", "bailing_hybrid")
ACROSS_CHUNKS = (70, 1, 57, 130)


@pytest.mark.parametrize("model_type", CHUNKED_DELTA_RULES)
def test_packed_row_exact_across_chunks(model_type):
    lm = tiny_model(model_type)
    seqs = sequences(lengths=ACROSS_CHUNKS)
    reference = logits_and_grads(lm, each_alone(seqs))
    layers = install_sequence_restart(lm)
    assert all(wrapper.one_call for wrapper in wrappers_of(lm))
    assert_same(logits_and_grads(lm, packed(seqs, layers)), reference, f"{model_type} across chunks")


def test_granite_hybrid_with_default_mamba_sizes_is_exact():
    """The issue's model (Granite 4 hybrid, hidden 64, the config's default Mamba sizes: 128 heads, state 256,
    chunks of 256, A = -1..-128, so strong decays) on sequences across its chunk boundaries."""
    from transformers import GraniteMoeHybridConfig

    default = GraniteMoeHybridConfig()
    lm = tiny_model("granitemoehybrid", mamba_n_heads=default.mamba_n_heads, mamba_d_state=default.mamba_d_state,
                    mamba_chunk_size=default.mamba_chunk_size)
    seqs = sequences(lengths=(300, 5, 250, 40))
    reference = logits_and_grads(lm, each_alone(seqs))
    layers = install_sequence_restart(lm)
    assert_same(logits_and_grads(lm, packed(seqs, layers)), reference, "granitemoehybrid, default Mamba sizes")


def test_one_call_mixers_are_known_mixers():
    assert set(ONE_CALL) <= KNOWN_MIXERS


def test_every_one_call_mixer_is_checked_by_a_family():
    """Each mixer class of ONE_CALL is the mixer of a family the tests above run, so each one-call form (Mamba2,
    gated delta rule, KDA, short convolution, in every family that has it) is compared with each sequence alone."""
    checked = set()
    for model_type in FAMILIES:
        lm = tiny_model(model_type)
        modules = dict(lm.named_modules())
        checked |= {type(modules[name]).__name__ for name in recurrent_mixers(lm)}
    assert set(ONE_CALL) <= checked, f"one-call mixers no family test runs: {sorted(set(ONE_CALL) - checked)}"


def test_packed_row_exact_through_lora():
    """LoRA injected after the wrappers (the trainer's order: build_lm applies LoRA, then the restart is installed
    on the PEFT model, or the other way round): adapters inside the mixers train exactly."""
    from train.model.lora import apply_lora

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
    layers.set_row(Row.build([0, 4, 9]))
    with pytest.raises(ValueError, match="cover 9 tokens, the input has 10"):
        lm(input_ids=torch.arange(3, 13)[None], use_cache=False)
    with pytest.raises(ValueError, match="strictly increase"):
        layers.set_row(Row.build([0, 4, 4, 9]))


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


def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
    """A module-level convolution kernel, called by name as transformers' mixers call theirs (no boundaries)."""
    return F.conv1d(x, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])[..., : x.shape[-1]]


def hooked(forward):
    """A decorator like transformers' `force_accelerate_hooks`: functools.wraps, the forward in its closure."""

    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapped


class ConvolutionThroughKernel(SequenceConvolution):
    @hooked
    def forward(self, hidden_states, **kwargs):
        x = hidden_states.transpose(1, 2)
        return causal_conv1d_fn(x, self.conv.weight.squeeze(1), self.conv.bias).transpose(1, 2)


class ConvolutionInline(SequenceConvolution):
    """Calls no kernel by name: its forward (SequenceConvolution's) convolves with its own module."""


@pytest.mark.parametrize("mixer_class, one_call", [(ConvolutionThroughKernel, True), (ConvolutionInline, False)])
def test_one_call_only_where_the_forward_calls_the_kernels(monkeypatch, mixer_class, one_call):
    """A mixer listed in ONE_CALL runs in one call only when its forward (through its decorator) calls every kernel
    of its form by name; otherwise (a transformers whose mixer computes differently) it runs once per sequence.
    Either way the packed row equals each sequence alone, and the module's own kernel is left as it is."""
    monkeypatch.setitem(ONE_CALL, mixer_class.__name__, SHORT_CONVOLUTION)
    torch.manual_seed(0)
    mixer = mixer_class(8)
    layers = RecurrentLayers(boundaries=RowHolder())
    wrapper = SequenceRestart(mixer, layers.boundaries)
    assert wrapper.one_call is one_call
    x = torch.randn(1, sum(LENGTHS), 8)
    starts = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    alone = torch.cat([mixer(x[:, lo:hi]) for lo, hi in zip(starts[:-1], starts[1:])], dim=1)
    layers.set_row(Row.build(starts))
    assert torch.allclose(wrapper(x), alone, atol=1e-6)
    assert not torch.allclose(mixer(x), alone, atol=1e-3)  # the module itself still convolves across sequences


def test_row_of_one_sequence_runs_the_mixer_unmasked(monkeypatch):
    """A row of one sequence needs no restart: the one-call mixer runs its own kernels, not the masked forms."""
    calls = []

    def counted(*args, row, **kwargs):
        calls.append(row.count)
        return kernels.causal_conv1d(*args, row=row, **kwargs)

    monkeypatch.setitem(ONE_CALL, ConvolutionThroughKernel.__name__, SHORT_CONVOLUTION)
    monkeypatch.setitem(ROW_KERNELS, "causal_conv1d_fn", counted)
    torch.manual_seed(0)
    mixer = ConvolutionThroughKernel(8)
    layers = RecurrentLayers(boundaries=RowHolder())
    wrapper = SequenceRestart(mixer, layers.boundaries)
    x = torch.randn(1, sum(LENGTHS), 8)
    layers.set_row(Row.build([0, x.shape[1]]))
    assert torch.equal(wrapper(x), mixer(x)) and calls == []
    layers.set_row(Row.build([0, 3, x.shape[1]]))
    wrapper(x)
    assert calls == [2]
