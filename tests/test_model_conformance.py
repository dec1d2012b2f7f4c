"""Every causal-LM family of the installed transformers trains exactly on a packed row, or is refused.

For each family of transformers' causal-LM auto mapping (tests/model_zoo.py builds a tiny random-init config that
exercises its features: windows shorter than the sequences, softcaps that bite, non-trivial logit scales):
- `exact` (train/model_support.py): a packed row of four sequences through PackSFT (`PackedCausalLM`: packed
  attention on the CPU reference backend, recurrent restarts, chunked loss head) equals transformers' own eager
  forward on each sequence alone — loss within 1e-5 and every parameter's gradient within 1e-4 relative (fp32);
- `refused`: `check_model_support` stops it before any weight is loaded, naming the family and the reason.
A family the table does not classify fails `test_every_family_is_classified`: a new transformers release that
adds a family fails this suite until it is classified.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import train.attention  # noqa: F401  (registers attn_implementation="packsft")
from tests.model_zoo import VOCAB, tiny_config
from train.model_check import compare_packed_with_reference
from train.model_support import (
    EXACT,
    REFUSED,
    UnsupportedModelError,
    check_model_support,
    family_status,
)
from train.trainer import PackedCausalLM

FAMILIES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
SEQUENCE_LENGTHS = (7, 11, 5, 9)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_family_is_classified():
    unclassified = [f for f in FAMILIES if family_status(f) == "unverified"]
    assert not unclassified, (
        f"families of transformers' causal-LM mapping with no classification in train/model_support.py: "
        f"{unclassified}; add each to EXACT (and make this suite pass for it) or to REFUSED with the reason")


def test_the_table_names_only_real_families():
    stale = sorted((set(EXACT) | set(REFUSED)) - set(FAMILIES))
    assert not stale, f"train/model_support.py classifies model types transformers does not have: {stale}"


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if family_status(f) == "refused"])
def test_refused_family_stops_before_training(model_type):
    config = SimpleNamespace(model_type=model_type)  # no weights, no config validation: the type alone decides
    with pytest.raises(UnsupportedModelError, match=f"model family '{model_type}'") as err:
        check_model_support(config)
    assert REFUSED[model_type].why in str(err.value)


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if family_status(f) == "exact"])
def test_exact_family_packed_equals_unpacked(model_type):
    config = tiny_config(model_type)
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    torch.manual_seed(0)
    lm = model_cls._from_config(config, attn_implementation="packsft", dtype=torch.float32)
    model = PackedCausalLM(lm, chunk_size=5, num_categories=1, attn_backend="sdpa")
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, VOCAB, (n,), generator=gen) for n in SEQUENCE_LENGTHS]
    result = compare_packed_with_reference(model, sequences)
    assert result.ok, f"{model_type}: {result.describe()}"


def test_the_docs_table_is_current():
    from tests.conftest import ROOT
    from train.model_support import supported_models_table

    assert supported_models_table() in (ROOT / "docs" / "TRAINING.md").read_text(), (
        "docs/TRAINING.md's supported-models table is stale: regenerate it with `python -m train.model_support`")
