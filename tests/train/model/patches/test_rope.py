"""Length-dependent ropes per packed sequence (train/model/patches/rope.py): which rotary modules are wrapped, the wrapper against
each sequence alone (also with positions that are not 0..n-1), and the refusal under sequence parallelism. The
model-level equivalence (packed row = each sequence through the model alone) is in tests/train/test_families.py
(`test_length_dependent_rope_packed_equals_unpacked`)."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.model_zoo import tiny_config
from train.attention.function import AttentionContext
from train.model.patches.rope import (
    PerSequenceRope,
    install_per_sequence_rope,
    sequence_parallel_problem,
    sequence_lengths,
    switch_points,
)

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], "original_max_position_embeddings": 16}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
CONFIGS = {
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=16, rope_parameters=LONGROPE)),
    "phimoe-longrope": ("phimoe", dict(rope_parameters={**LONGROPE, "short_mscale": 1.0, "long_mscale": 1.3})),
    "llama-dynamic": ("llama", dict(max_position_embeddings=16, rope_parameters=DYNAMIC)),
    "gemma3_text-dynamic-full-layers": ("gemma3_text", dict(max_position_embeddings=16, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": DYNAMIC})),
}


def _model(case: str):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type, overrides = CONFIGS[case]
    config = tiny_config(model_type, **overrides)
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._from_config(config, dtype=torch.float32)


def test_only_length_dependent_ropes_are_wrapped():
    from transformers import LlamaForCausalLM

    lm = _model("phi3-longrope")
    ropes = install_per_sequence_rope(lm)
    assert list(ropes.wrapped) == ["model.rotary_emb"] and isinstance(lm.model.rotary_emb, PerSequenceRope)
    assert lm.model.rotary_emb.switches == {None: ("longrope", 16)}
    assert list(install_per_sequence_rope(lm).wrapped) == ["model.rotary_emb"]  # idempotent: no wrapper in a wrapper
    gemma = _model("gemma3_text-dynamic-full-layers")
    install_per_sequence_rope(gemma)
    assert gemma.model.rotary_emb.switches == {"full_attention": ("dynamic", 16)}  # the sliding layers' is default
    assert not install_per_sequence_rope(LlamaForCausalLM(tiny_config("llama")))  # default rope
    assert switch_points(tiny_config("llama")) == [] and switch_points(gemma.config) == [16]


def _alone(rope, positions: torch.Tensor, layer_type):
    """What a fresh copy of `rope` (transformers' module) gives one sequence alone."""
    args = (layer_type,) if layer_type else ()
    return copy.deepcopy(rope)(torch.zeros(1), positions[None], *args)


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_each_token_gets_its_sequence_alone(case):
    """Bitwise: a packed row of sequences on both sides of the switch point (16), lengths in any order, one
    with positions that are not 0..n-1 (Parallel-R1: two paths share positions; 20 tokens but positions up to 15,
    so short: transformers' length is the largest position + 1), then a row of short sequences only."""
    lm = _model(case)
    original = copy.deepcopy(lm.model.rotary_emb)
    ropes = install_per_sequence_rope(lm)
    wrapper = lm.model.rotary_emb
    layer_type = next(iter(wrapper.switches))
    pieces = [torch.arange(40), torch.arange(10), torch.cat([torch.arange(12), torch.arange(8, 16)]),
              torch.arange(23), torch.arange(16), torch.arange(30)]
    for row in (pieces, pieces[1:3]):
        cu = torch.tensor([0, *torch.tensor([len(p) for p in row]).cumsum(0).tolist()], dtype=torch.int32)
        ropes.set_row(AttentionContext(cu, int(max(len(p) for p in row))).bounds)
        args = (layer_type,) if layer_type else ()
        packed = wrapper(torch.zeros(1), torch.cat(row)[None], *args)
        expected = [_alone(original, p, layer_type) for p in row]
        for got, want in zip(packed, zip(*expected)):
            assert torch.equal(got, torch.cat(want, dim=1))
    ropes.clear()
    whole = torch.arange(40)[None]
    args = (layer_type,) if layer_type else ()
    assert all(torch.equal(a, b) for a, b in zip(wrapper(torch.zeros(1), whole, *args),
                                                  _alone(original, whole[0], layer_type)))


def test_sequence_lengths_are_largest_position_plus_one():
    positions = torch.tensor([0, 1, 2, 0, 1, 1, 2, 0])
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    assert sequence_lengths(positions, cu).tolist() == [3, 3, 3, 3, 3, 3, 3, 1]


def test_sequence_parallel_refuses_length_dependent_ropes():
    for case in CONFIGS:
        model_type, overrides = CONFIGS[case]
        problem = sequence_parallel_problem(tiny_config(model_type, **overrides))
        assert f"model_type '{model_type}'" in problem and "sequence_parallel_size=1" in problem
        assert ("rope_type longrope" if "longrope" in case else "rope_type dynamic") in problem
    assert sequence_parallel_problem(tiny_config("llama")) is None
    with pytest.raises(ValueError, match="sequence parallelism"):
        install_per_sequence_rope(_model("phi3-longrope")).set_row(
            AttentionContext(torch.tensor([0, 4], dtype=torch.int32), 4, sp=object()).bounds)


def test_the_trainer_refuses_them_under_sequence_parallelism_before_the_model_loads():
    """The SP layout, planned from the model config before the mesh and the model, refuses them."""
    from common.config import ConfigError
    from train.plan.attention import plan_sp_layout
    from train.config.sections import LaunchSection, ParallelSection

    model_type, overrides = CONFIGS["phi3-longrope"]
    config = tiny_config(model_type, **overrides)
    launch = LaunchSection(num_processes=2)
    with pytest.raises(ConfigError, match="sequence_parallel_size > 1 cannot train model_type 'phi3' with rope_type "
                                          "longrope"):
        plan_sp_layout(ParallelSection(sequence_parallel_size=2), launch, config, 2)
    assert plan_sp_layout(ParallelSection(), launch, config, 1) is None
    assert plan_sp_layout(ParallelSection(sequence_parallel_size=2), launch, tiny_config("llama"), 2).sp_size == 2

