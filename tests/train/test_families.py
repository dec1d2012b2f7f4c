"""Every causal-LM family of the installed transformers trains exactly on a packed row, or is refused.

Parametrized from the family table (train/families.py); for each family (tests/model_zoo.py builds a tiny
random-init config that exercises its features: windows shorter than the sequences, softcaps that bite, the logit
transform of its spec with non-trivial values):
- `exact`: a packed row of four sequences through PackSFT (`PackedCausalLM`: packed attention on the CPU reference
  backend, recurrent restarts, chunked loss head) equals transformers' own eager forward on each sequence alone —
  loss within 1e-5 and every parameter's gradient within 1e-4 relative (fp32); so do the length-dependent ropes of
  its spec (`ropes`), on both sides of their switch point;
- `refused`: `check_model_support` stops it before any weight is loaded, naming the family and the reason.
- composite checkpoints (`text_family`, train/model/composite.py): the composite class itself, towers loaded, against its own
  forward on each sequence alone (tests/model_zoo.py's `tiny_composite_config`: the text decoder's tiny config,
  shrunk towers); every composite of transformers' image-text-to-text and multimodal-LM mappings is classified.
A causal LM of transformers' auto mapping that the table does not classify fails `test_every_family_is_classified`:
a new transformers release that adds a family fails this suite until it is classified.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
)

from tests.model_zoo import VOCAB, tiny_composite_config, tiny_config
from train.attention.function import BACKENDS, LayerKernels  # (importing it registers attn_implementation="packsft")
from train.model.composite import attn_implementation
from train.families import FAMILIES
from train.model.self_check import compare_packed_with_reference
from train.model.support import UnsupportedModelError, check_model_support
from train.model.packed import PackedCausalLM

EXACT = [model_type for model_type, spec in sorted(FAMILIES.items())
         if spec.status == "exact" and not spec.text_family and not spec.composite_only]
# composite checkpoints trained on text through their text decoder (train/model/composite.py)
EXACT_COMPOSITES = [model_type for model_type, spec in sorted(FAMILIES.items())
                    if spec.status == "exact" and spec.text_family]
REFUSED = [model_type for model_type, spec in sorted(FAMILIES.items()) if spec.status == "refused"]
SEQUENCE_LENGTHS = (7, 11, 5, 9)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_family_is_classified():
    unclassified = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(FAMILIES))
    assert not unclassified, (
        f"families of transformers' causal-LM mapping with no spec in train/families.py: {unclassified}; add each, "
        f"exact (and make this suite pass for it) or refused with the reason")


def test_the_table_names_only_real_families():
    stale = sorted(set(FAMILIES) - set(CONFIG_MAPPING_NAMES))
    assert not stale, f"train/families.py has specs of model types transformers does not have: {stale}"
    not_causal = sorted(set(EXACT) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    assert not not_causal, f"exact families that AutoModelForCausalLM cannot build: {not_causal}"
    not_composite = sorted(set(EXACT_COMPOSITES) - set(MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES))
    assert not not_composite, f"exact composites that AutoModelForMultimodalLM cannot build: {not_composite}"
    decoders = {spec.text_family for spec in FAMILIES.values()}
    orphans = sorted(t for t, spec in FAMILIES.items() if spec.composite_only and t not in decoders)
    assert not orphans, f"composite-only text decoders that no composite of the table names: {orphans}"


def test_every_composite_is_classified():
    composites = set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) | set(MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES)
    unclassified = sorted(composites - set(FAMILIES))
    assert not unclassified, (
        f"composites of transformers' image-text-to-text and multimodal-LM mappings with no spec in "
        f"train/families.py: {unclassified}")


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_family_stops_before_training(model_type):
    config = SimpleNamespace(model_type=model_type)  # no weights, no config validation: the type alone decides
    with pytest.raises(UnsupportedModelError, match=f"model family '{model_type}'") as err:
        check_model_support(config)
    assert FAMILIES[model_type].refusal.why in str(err.value)


def _packed_check(config, lengths, mapping=MODEL_FOR_CAUSAL_LM_MAPPING):
    """compare_packed_with_reference on a fresh tiny model of `config` (its class: `mapping`'s) and random
    sequences of `lengths`."""
    model_cls = mapping[type(config)]
    torch.manual_seed(0)
    lm = model_cls._from_config(config, attn_implementation=attn_implementation(config, "packsft"),
                                dtype=torch.float32)
    model = PackedCausalLM(lm, chunk_size=5, num_categories=1)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    return compare_packed_with_reference(model, sequences, LayerKernels(every=BACKENDS["sdpa"]))


@pytest.mark.parametrize("model_type", EXACT)
def test_exact_family_packed_equals_unpacked(model_type):
    config = tiny_config(model_type)
    assert check_model_support(config) == "exact"  # the suite's config is one PackSFT accepts
    result = _packed_check(config, SEQUENCE_LENGTHS)
    assert result.ok, f"{model_type}: {result.describe()}"


# the bar every family meets in fp32 (the model_check tolerances leave room for larger models and other devices)
COMPOSITE_LOSS_BAR, COMPOSITE_GRAD_BAR = 2e-6, 3e-5


@pytest.mark.parametrize("model_type", EXACT_COMPOSITES)
def test_exact_composite_packed_equals_unpacked(model_type):
    """The composite class itself (towers loaded, text decoder through PackSFT's packed path) against its own
    forward on each sequence alone: M-RoPE positions, windows, softcaps and recurrent restarts of its text decoder
    included."""
    config = tiny_composite_config(model_type)
    assert check_model_support(config) == "exact"
    result = _packed_check(config, SEQUENCE_LENGTHS, MODEL_FOR_MULTIMODAL_LM_MAPPING)
    assert result.ok, f"{model_type}: {result.describe()}"
    assert result.loss_error <= COMPOSITE_LOSS_BAR and result.grad_error <= COMPOSITE_GRAD_BAR, result.describe()


@pytest.mark.parametrize("model_type", sorted(t for t, spec in FAMILIES.items() if spec.composite_only))
def test_composite_only_decoder_alone_is_refused(model_type):
    with pytest.raises(UnsupportedModelError, match=f"model family '{model_type}' is the text decoder of a "
                                                    "composite checkpoint"):
        check_model_support(tiny_config(model_type))


def test_unlisted_composite_is_refused_not_a_transformers_error(monkeypatch):
    """A composite the table does not list (a newer transformers) stops with the family, not with transformers'
    `Unrecognized configuration class ... for AutoModelForCausalLM` when the weights load."""
    config = tiny_composite_config("mistral3")
    monkeypatch.delitem(FAMILIES, "mistral3")
    with pytest.raises(UnsupportedModelError, match="model family 'mistral3' cannot be trained on packed rows: a "
                                                    r"composite checkpoint \(its text decoder is 'mistral'\)"):
        check_model_support(config)


SWITCH = 16  # tokens: where the length-dependent ropes below change their frequencies
LONG_FACTORS = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]  # one per frequency of head dim 16


def _longrope(**extra) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": LONG_FACTORS,
            "original_max_position_embeddings": SWITCH, **extra}


_DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
# (family, rope type) of the families' `ropes` -> the config that sets it: rope types whose frequencies depend on
# the length of the sequence (train/model/patches/rope.py): longrope (Phi-3 / Phi-3.5 / Phi-4-mini; PhiMoE also switches its
# scale) switches to its long factors past original_max_position_embeddings, dynamic NTK scales its base to the
# length past max_position_embeddings (gemma3_text: on its full-attention layers only). No sliding window here: the
# rope's effect is not confined to 4 tokens.
ROPE_CONFIGS = {
    ("phi3", "longrope"): dict(sliding_window=None, original_max_position_embeddings=SWITCH,
                               rope_parameters=_longrope()),
    ("phimoe", "longrope"): dict(sliding_window=None, rope_parameters=_longrope(short_mscale=1.0, long_mscale=1.3)),
    ("llama", "dynamic"): dict(max_position_embeddings=SWITCH, rope_parameters=_DYNAMIC),
    ("gemma3_text", "dynamic"): dict(max_position_embeddings=SWITCH, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": _DYNAMIC}),
}
ROPE_CASES = [(model_type, rope) for model_type, spec in sorted(FAMILIES.items()) for rope in spec.ropes]
# both sides of the switch point in one packed row: 10 and 16 tokens (short factors, unscaled), 40 and 23 (long
# factors; dynamic NTK scaled to 40 and to 23)
ROPE_SEQUENCE_LENGTHS = (10, 40, 16, 23)


def test_every_rope_case_has_a_config():
    assert sorted(ROPE_CONFIGS) == sorted(ROPE_CASES), "a family's `ropes` and ROPE_CONFIGS disagree"


@pytest.mark.parametrize("model_type,rope_type", ROPE_CASES)
def test_length_dependent_rope_packed_equals_unpacked(model_type, rope_type):
    """transformers picks these frequencies from the longest position of a call; packed, each sequence must still
    get those of its own length (the model's own forward on it alone)."""
    config = tiny_config(model_type, **ROPE_CONFIGS[model_type, rope_type])
    assert check_model_support(config) == "exact"
    result = _packed_check(config, ROPE_SEQUENCE_LENGTHS)
    assert result.ok, f"{model_type} with rope_type {rope_type}: {result.describe()}"


# config values that change which tokens a token attends to (train/model/support.py ATTENTION_SETTINGS)
ATTENTION_CHANGES = [
    ("gemma", "use_bidirectional_attention", True),
    ("gemma2", "use_bidirectional_attention", True),
    ("gemma3_text", "use_bidirectional_attention", True),
    ("gemma4_text", "use_bidirectional_attention", "all"),
    ("gemma4_unified_text", "use_bidirectional_attention", "all"),
    ("hrm_text", "prefix_lm", True),
    ("qwen2", "is_causal", False),
]


@pytest.mark.parametrize("model_type,key,value", ATTENTION_CHANGES)
def test_attention_changing_config_is_refused(model_type, key, value):
    config = tiny_config(model_type, **{key: value})
    with pytest.raises(UnsupportedModelError, match=f"model family '{model_type}' cannot be trained on packed rows "
                                                    f"with `{key}: {value}`"):
        check_model_support(config)


@pytest.mark.parametrize("model_type,key,value", [c for c in ATTENTION_CHANGES if c[0] != "gemma2"])
def test_refused_attention_change_matters(model_type, key, value):
    """Those refusals are not vacuous: with the value set, the model's own forward lets a later token change the
    output at position 0 (bidirectional attention; HRM's prefix-LM over the tokens its `token_type_ids` mark), which
    PackSFT's causal packed attention cannot reproduce. Gemma 2 reads it only under flash attention (not on CPU);
    Gemma 1 under sdpa, the default."""
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    later = ids.clone()
    later[0, 2] = (ids[0, 2] + 1) % VOCAB
    extra = {"token_type_ids": torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]])} if key == "prefix_lm" else {}
    first_position = {}
    for setting in (value, not value if isinstance(value, bool) else None):
        config = tiny_config(model_type, **{key: setting})
        torch.manual_seed(0)
        lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._from_config(config, attn_implementation="sdpa").eval()
        with torch.no_grad():
            first_position[setting] = [lm(input_ids=x, use_cache=False, **extra).logits[0, 0] for x in (ids, later)]
    changed = {setting: not torch.equal(*outputs) for setting, outputs in first_position.items()}
    assert changed == {value: True, not value if isinstance(value, bool) else None: False}, changed


def test_the_docs_table_is_current():
    from tests.conftest import ROOT
    from train.model.support import supported_models_table

    assert supported_models_table() in (ROOT / "docs" / "TRAINING.md").read_text(), (
        "docs/TRAINING.md's supported-models table is stale: regenerate it with `python -m train.model.support`")
