"""train.model.lm_head + train.model.loss: the loss reproduces each family's own logits (softcap, logit scale, logits scaling,
hidden-state division, padded vocabulary), values and gradients of every parameter, on tiny random models."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from train.model.composite import attn_implementations
from train.model.lm_head import LMHead, causal_lm_of, decoder_of, lm_head_of
from train.model.loss import weighted_lm_loss
from train.model.support import UnsupportedModelError

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, attention_dropout=0.0, hidden_dropout=0.0, max_position_embeddings=256)
SOFTCAP, SCALE, SCALING = 2.0, 0.3, 4.0
GEMMA_PER_LAYER = dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8)

# family -> (config overrides: the transform made to bite, the head lm_head_of must return)
FAMILIES = {
    "gemma2": (dict(final_logit_softcapping=SOFTCAP), LMHead(softcap=SOFTCAP)),
    "gemma3_text": (dict(final_logit_softcapping=SOFTCAP), LMHead(softcap=SOFTCAP)),
    "gemma3n_text": (dict(final_logit_softcapping=SOFTCAP, activation_sparsity_pattern=[0.0, 0.0], num_kv_shared_layers=0,
                          laurel_rank=8, layer_types=["sliding_attention", "full_attention"], **GEMMA_PER_LAYER),
                     LMHead(softcap=SOFTCAP)),
    "gemma4_text": (dict(final_logit_softcapping=SOFTCAP, **GEMMA_PER_LAYER), LMHead(softcap=SOFTCAP)),
    "gemma4_unified_text": (dict(final_logit_softcapping=SOFTCAP), LMHead(softcap=SOFTCAP)),
    "vaultgemma": (dict(final_logit_softcapping=SOFTCAP), LMHead(softcap=SOFTCAP)),
    "nanochat": (dict(final_logit_softcapping=SOFTCAP), LMHead(softcap=SOFTCAP)),
    "beam": (dict(final_logit_softcapping=SOFTCAP), LMHead(softcap=SOFTCAP)),
    "recurrent_gemma": (dict(logits_soft_cap=SOFTCAP, lru_width=64, block_types=("recurrent", "attention")),
                        LMHead(softcap=SOFTCAP)),
    "xlstm": (dict(output_logit_soft_cap=SOFTCAP, embedding_dim=64, num_heads=4, num_blocks=2, chunk_size=4),
              LMHead(softcap=SOFTCAP)),
    "cohere": (dict(logit_scale=SCALE), LMHead(scale=SCALE)),
    "cohere2": (dict(logit_scale=SCALE), LMHead(scale=SCALE)),
    "cohere2_moe": (dict(logit_scale=SCALE), LMHead(scale=SCALE)),
    "cohere_compass_text": (dict(logit_scale=SCALE, layer_types=["full_attention"] * 2,
                                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                            LMHead(scale=SCALE)),
    "granite": (dict(logits_scaling=SCALING), LMHead(scale=1 / SCALING)),
    "granite_swa": (dict(logits_scaling=SCALING), LMHead(scale=1 / SCALING)),
    "granitemoe": (dict(logits_scaling=SCALING), LMHead(scale=1 / SCALING)),
    "granitemoe_swa": (dict(logits_scaling=SCALING), LMHead(scale=1 / SCALING)),
    "granitemoeshared": (dict(logits_scaling=SCALING), LMHead(scale=1 / SCALING)),
    "granitemoehybrid": (dict(logits_scaling=SCALING, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                              mamba_chunk_size=16, shared_intermediate_size=64),
                         LMHead(scale=1 / SCALING)),
    "hyperclovax": (dict(logits_scaling=SCALE), LMHead(scale=SCALE)),
    "falcon_h1": (dict(lm_head_multiplier=SCALE, mamba_n_heads=8, mamba_d_head=16, mamba_d_ssm=128,
                       mamba_d_state=16, mamba_chunk_size=16), LMHead(scale=SCALE)),
    "minicpm3": (dict(dim_model_base=16, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=16, num_key_value_heads=4),  # MLA: one key per head
                 LMHead(scale=16 / 64)),  # logits_scaling = hidden_size / dim_model_base
    "inkling_text": (dict(logits_mup_width_multiplier=SCALING, unpadded_vocab_size=100, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, swa_head_dim=16, rel_extent=32),
                     LMHead(scale=1 / SCALING, vocab_size=100)),
    "inkling2_text": (dict(final_logit_softcapping=SOFTCAP, unpadded_vocab_size=100, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, swa_head_dim=16, rel_extent=32),
                      LMHead(softcap=SOFTCAP, vocab_size=100)),
}


def head_logits(hidden: torch.Tensor, causal_lm: torch.nn.Module, head: LMHead) -> torch.Tensor:
    """fp32 logits of final hidden states through the output embedding and `head` (what the loss computes)."""
    out = causal_lm.get_output_embeddings()
    return head.transform(F.linear(hidden.to(out.weight.dtype), out.weight, getattr(out, "bias", None)))


@torch.no_grad()
def check_lm_head(lm: torch.nn.Module, head: LMHead | None = None, num_tokens: int = 16, seed: int = 0) -> float:
    """Max |model logits - reproduced logits| / max |model logits| on `num_tokens` random tokens (one sequence).

    Runs the model's own forward (eager attention, no cache, eval mode; all three restored after) and, on the
    final hidden states its decoder returned in that same forward, the output embedding and `head` (default
    `lm_head_of(lm)`). At rounding level of the model's dtype when the head is reproduced. Under ZeRO-3 it must
    run with the parameters gathered.
    """
    causal_lm = causal_lm_of(lm)
    head = lm_head_of(lm) if head is None else head
    weight = causal_lm.get_output_embeddings().weight
    vocab = causal_lm.config.get_text_config().vocab_size
    input_ids = torch.randint(head.vocab_size or vocab, (1, num_tokens),
                              generator=torch.Generator().manual_seed(seed)).to(weight.device)
    decoder_outputs = []
    hook = decoder_of(causal_lm).register_forward_hook(lambda module, args, output: decoder_outputs.append(output))
    attn_implementation, training = attn_implementations(causal_lm), causal_lm.training
    try:
        causal_lm.set_attn_implementation("eager")
        causal_lm.eval()
        model_logits = causal_lm(input_ids=input_ids, use_cache=False).logits[0].float()
    finally:
        hook.remove()
        causal_lm.set_attn_implementation(attn_implementation)
        causal_lm.train(training)
    reproduced = head_logits(decoder_outputs[-1][0][0], causal_lm, head)
    if reproduced.shape != model_logits.shape:
        return float("inf")
    return float((model_logits - reproduced).abs().max() / model_logits.abs().max().clamp_min(1e-30))


def tiny_lm(family: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIG_MAPPING[family](**{**TINY, **overrides})
    lm = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # logits of a few units (the init's are ~0.1): the softcap and the scales bite
        lm.get_output_embeddings().weight.normal_(0.0, 1.0)
    return lm


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def one_sequence(vocab, n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(vocab, (1, n), generator=g)
    targets = torch.cat([input_ids[0, 1:], torch.tensor([-100])])
    targets[:3] = -100  # an untrained prompt
    weights = torch.rand(n, generator=g) + 0.5
    return input_ids, targets, weights


def grads_of(lm):
    return {name: p.grad.clone() for name, p in lm.named_parameters() if p.grad is not None}


def model_loss_and_grads(lm, input_ids, targets, weights):
    """The model's own logits (its forward, eager attention) under the same weighted cross-entropy."""
    lm.zero_grad()
    logits = lm(input_ids=input_ids, use_cache=False).logits[0].float()
    ce = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none")
    loss = (ce * weights).sum()
    loss.backward()
    return loss.detach(), grads_of(lm)


def packed_loss_and_grads(lm, input_ids, targets, weights, chunk_size, head):
    """What the trainer computes: decoder body, output-embedding weight and `head`, chunked loss."""
    lm.zero_grad()
    hidden = decoder_of(lm)(input_ids=input_ids, use_cache=False).last_hidden_state[0]
    out = lm.get_output_embeddings()
    loss, _, _ = weighted_lm_loss(hidden, out.weight, targets, weights, torch.zeros_like(targets), 1, chunk_size,
                                  lm_head_bias=getattr(out, "bias", None), head=head)
    loss.backward()
    return loss.detach(), grads_of(lm)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_head_is_read_from_the_config(family):
    overrides, expected = FAMILIES[family]
    head = lm_head_of(tiny_lm(family, **overrides))
    assert head.softcap == expected.softcap and head.vocab_size == expected.vocab_size
    assert head.scale == pytest.approx(expected.scale, rel=1e-12)


@pytest.mark.parametrize("chunk_size", [3, 0])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_gradients_match_the_models_own_logits(family, chunk_size):
    lm = tiny_lm(family, **FAMILIES[family][0])
    head = lm_head_of(lm)
    inputs = one_sequence(head.vocab_size or lm.config.vocab_size)
    want_loss, want_grads = model_loss_and_grads(lm, *inputs)
    loss, grads = packed_loss_and_grads(lm, *inputs, chunk_size, head)
    assert rel_err(loss, want_loss) < 1e-5
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert rel_err(grad, want_grads[name]) < 1e-5, name
    assert check_lm_head(lm) < 1e-5
    # the plain head (today's loss) trains these families on other logits
    assert rel_err(packed_loss_and_grads(lm, *inputs, chunk_size, LMHead())[0], want_loss) > 1e-3
    assert check_lm_head(lm, LMHead()) > 1e-3


def test_identity_head_is_bit_identical_to_the_plain_loss():
    g = torch.Generator().manual_seed(0)
    n, vocab, dim = 10, 40, 8
    targets = torch.randint(vocab, (n,), generator=g)
    targets[::4] = -100
    weights, cats = torch.rand(n, generator=g), torch.zeros(n, dtype=torch.long)

    def run(chunk_size, **head_kwarg):
        hidden = torch.randn(n, dim, generator=torch.Generator().manual_seed(1)).requires_grad_()
        weight = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(2)).requires_grad_()
        bias = torch.randn(vocab, generator=torch.Generator().manual_seed(3)).requires_grad_()
        loss, cat_sum, _ = weighted_lm_loss(hidden, weight, targets, weights, cats, 1, chunk_size, bias, **head_kwarg)
        loss.backward()
        return loss, cat_sum, hidden.grad, weight.grad, bias.grad

    for chunk_size in (3, 0):
        for got, want in zip(run(chunk_size, head=LMHead()), run(chunk_size)):
            assert torch.equal(got, want)


def test_plain_family_has_the_identity_head():
    lm = tiny_lm("llama")
    assert lm_head_of(lm) == LMHead()
    assert check_lm_head(lm) < 1e-5


class LogitDoublingLlama(LlamaForCausalLM):
    """A forward that transforms the logits in a way the table does not know (like an unknown remote-code model)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_the_check_sees_a_logit_transform_the_table_does_not_know():
    torch.manual_seed(0)
    lm = LogitDoublingLlama(LlamaConfig(**TINY))
    assert check_lm_head(lm) == pytest.approx(0.5, rel=1e-4)  # |2 z - z| / |2 z|


def test_unreproducible_heads_raise_a_clear_error():
    torch.manual_seed(0)
    prophetnet = AutoModelForCausalLM.from_config(CONFIG_MAPPING["prophetnet"](
        hidden_size=64, vocab_size=128, num_encoder_layers=1, num_decoder_layers=1, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_encoder_attention_heads=4, num_decoder_attention_heads=4))
    with pytest.raises(UnsupportedModelError, match=r"'prophetnet': .*n-gram streams.*To train it"):
        lm_head_of(prophetnet)
    # BERT's prediction transform (dense + activation + norm) runs between the decoder and the output embedding
    with pytest.raises(UnsupportedModelError, match=r"'bert': .*nested in the head module cls"):
        lm_head_of(tiny_lm("bert", is_decoder=True))


def test_check_restores_attention_and_mode():
    import train.attention.function  # noqa: F401  (registers "packsft")
    from train.attention.function import ATTN_IMPLEMENTATION

    torch.manual_seed(0)
    lm = LlamaForCausalLM._from_config(LlamaConfig(**TINY), attn_implementation=ATTN_IMPLEMENTATION)
    lm.train()
    assert check_lm_head(lm) < 1e-5
    assert lm.config._attn_implementation == ATTN_IMPLEMENTATION and lm.training


def test_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    lm = tiny_lm("gemma2", final_logit_softcapping=SOFTCAP)
    wrapped = peft.get_peft_model(lm, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert lm_head_of(wrapped) == LMHead(softcap=SOFTCAP)
    assert check_lm_head(wrapped) < 1e-5


def test_chunked_head_with_bias_and_padded_vocabulary_matches_the_reference():
    head = LMHead(scale=0.5, softcap=3.0, vocab_size=30)
    g = torch.Generator().manual_seed(0)
    n, vocab, dim = 11, 40, 8
    targets = torch.randint(head.vocab_size, (n,), generator=g)
    targets[::5] = -100
    weights, cats = torch.rand(n, generator=g), torch.zeros(n, dtype=torch.long)
    leaves = [torch.randn(n, dim, generator=g), torch.randn(vocab, dim, generator=g) * 2, torch.randn(vocab, generator=g)]

    def run(chunk_size):
        hidden, weight, bias = (t.clone().requires_grad_() for t in leaves)
        loss, _, _ = weighted_lm_loss(hidden, weight, targets, weights, cats, 1, chunk_size, bias, head=head)
        loss.backward()
        return loss.detach(), hidden.grad, weight.grad, bias.grad

    for got, want in zip(run(3), run(0)):
        assert rel_err(got, want) < 1e-5
    assert not run(3)[2][head.vocab_size:].any()  # the padded rows get no gradient


def test_bf16_model_is_at_rounding_level_and_the_plain_head_is_not():
    lm = tiny_lm("gemma2", final_logit_softcapping=SOFTCAP).to(torch.bfloat16)
    assert check_lm_head(lm) < 3e-2  # bf16 logits: the model rounds them
    assert check_lm_head(lm, LMHead()) > 3e-2
