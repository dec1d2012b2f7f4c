"""Tiny models with attention features, and the 2-process gloo worker of tests/train/attention/test_function_features.py: sp = 2
over the torch backend (contiguous layout: one varlen call; zigzag: the boolean mask) for tiny gemma2 (softcap,
alternating window) and gpt-oss (sinks, alternating window) against transformers' eager attention on each sequence
alone; rank 0 writes the worst relative errors to a JSON file."""
from __future__ import annotations

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tests._sp_worker import reference_step, relative_errors, sample_rows, sp_step, totals_of, write_results
from train.steps.batch import make_batch

FAMILIES = ("gemma2", "gpt_oss")
WINDOW = 4
SOFTCAP = 1.0  # small enough to bite at initializer_range 0.2
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, attention_dropout=0.0, max_position_embeddings=64, pad_token_id=0,
            tie_word_embeddings=False, initializer_range=0.2)
ALTERNATING = ["sliding_attention", "full_attention"]


def tiny_config(family: str, **overrides):
    """A 2-layer random config of `family` whose attention features bite on sequences of a few tokens."""
    from transformers import Gemma2Config, GptOssConfig, MistralConfig

    if family == "mistral":
        return MistralConfig(**TINY, sliding_window=WINDOW, **overrides)
    if family == "gemma2":
        return Gemma2Config(**TINY, sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP, final_logit_softcapping=None,
                            query_pre_attn_scalar=16, layer_types=ALTERNATING, **overrides)
    if family == "gpt_oss":
        return GptOssConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, **overrides}, **TINY,
                            sliding_window=WINDOW, layer_types=ALTERNATING)
    raise ValueError(family)


def tiny_model(family: str, **overrides):
    """The random tiny model of `family` with the packsft attention, fp32 (the same weights on every call);
    `overrides`: config fields to change."""
    import train.attention.function  # noqa: F401  registers attn_implementation="packsft"
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="packsft", dtype=torch.float32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)  # sinks that matter (their init is ~0)
    return model


def worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        rows = sample_rows()
        totals = totals_of(rows)
        batches = [make_batch([row], totals, "token") for row in rows]
        results = {}
        for family in FAMILIES:
            model = tiny_model(family).train()
            reference = copy.deepcopy(model)
            reference.set_attn_implementation("eager")
            want = reference_step(reference, batches)
            for layout in ("contiguous", "zigzag"):
                got = sp_step(model, batches, rank, world_size, dist.group.WORLD, layout, dist.group.WORLD)
                results[f"{family}/{layout}"] = relative_errors(got, want)
        write_results(results, out_path, rank)
    finally:
        dist.destroy_process_group()
