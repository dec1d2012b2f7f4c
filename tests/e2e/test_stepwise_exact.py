"""`stepwise: tree` trains exactly as `stepwise: samples` through the Trainer, beyond the Qwen3 fixture of
tests/e2e/test_stepwise_trees.py:

- ShareGPT multi-turn data (FastChat's) with Llama 3.1's template, and a synthetic agent trajectory of 10 steps
  behind a ~2K-token tools prompt (benchmarks/bench_stepwise.py's generator) with Qwen3's: per optimizer step the
  loss, per-category loss, loss tokens and gradients, and the weights after the steps (fp32 on CPU, 1e-6), full
  fine-tuning and LoRA (with the `sample` loss reduction: a tree's trained turn is one sample); on ShareGPT
  `samples` equals transformers' unpacked forward of each rendered step;
- trees under data parallelism (2 gloo processes, gradient accumulation 2, LoRA, stopped after step 2) and a resume
  (1 process, gradient accumulation 4) equal one uninterrupted process: loss, gradients and rows of every step, the
  adapter at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import orjson
import pytest
import torch

from tests._train_helpers import ROOT, free_port, write_config
from tests.conftest import fixture_path, tokenizer_dir
from tests.e2e.test_stepwise_trees import _close, _unpacked_reference, build_samples_and_tree

TOL = 1e-6
SHAREGPT_RECORDS = 8  # FastChat records with 2-3 assistant turns
# model: a tiny random-init decoder of the tokenizer's family and vocabulary; steps: optimizer steps of the tree ==
# samples runs, each over the whole data set (the agent's 11 steps hold ~36K tokens as samples: one step);
# categories: how many the data has
CASES = {
    "sharegpt_llama3_1": {"tokenizer": "llama3_1_instruct", "model_type": "llama", "architecture": "LlamaForCausalLM",
                          "vocab": 128256, "max_length": 192, "steps": 2, "categories": 2},
    "agents_qwen3": {"tokenizer": "qwen3", "model_type": "qwen2", "architecture": "Qwen2ForCausalLM",
                     "vocab": 151936, "max_length": 8192, "steps": 1, "categories": 1},
}


def _sharegpt_inputs(root) -> list[dict]:
    """Two ShareGPT files (two categories) of FastChat records with two or more assistant turns."""
    path = fixture_path("data", "fastchat_dummy_conversation.json")
    multi = [r for r in orjson.loads(path.read_bytes()) if sum(t["from"] == "gpt" for t in r["conversations"]) >= 2]
    inputs = []
    for k, part in enumerate((multi[:SHAREGPT_RECORDS // 2], multi[SHAREGPT_RECORDS // 2:SHAREGPT_RECORDS])):
        (root / f"chat_{k}.json").write_bytes(orjson.dumps(part))
        inputs.append({"path": str(root / f"chat_{k}.json"), "format": "sharegpt", "category_name": f"chat_{k}"})
    return inputs


def _agent_inputs(root) -> list[dict]:
    """One trajectory of 10 steps (11 trained assistant turns) behind the ~2K-token tools prompt (one category: its
    11 samples are ~36K tokens, ~3.3K each, and CPU attention costs the square of that)."""
    from benchmarks.bench_stepwise import agent_records

    (rec,) = agent_records(1, seed=0, steps=(10, 10))
    line = {"messages": rec["messages"], "tools": rec["tools"], "labels": rec["labels"]}
    (root / "agent.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    return [{"path": str(root / "agent.jsonl"), "format": "messages", "category_name": "agent"}]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> {mode: DataConfig} of the data pipeline run with stepwise samples and tree (built once per case)."""
    cache: dict[str, dict] = {}

    def build(case: str) -> dict:
        if case in cache:
            return cache[case]
        root = tmp_path_factory.mktemp(case)
        spec = CASES[case]
        inputs = _sharegpt_inputs(root) if case.startswith("sharegpt") else _agent_inputs(root)
        cache[case] = build_samples_and_tree(root, inputs, tokenizer_dir(spec["tokenizer"]), spec["max_length"])
        return cache[case]

    return build


def _model_config(root, case: str):
    spec = CASES[case]
    path = root / f"tiny_{case}.json"
    if not path.exists():
        path.write_text(json.dumps({
            "model_type": spec["model_type"], "architectures": [spec["architecture"]], "vocab_size": spec["vocab"],
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 8192, "initializer_range": 0.1,
            "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "use_cache": False}))
    return path


def _config(root, name: str, case: str, data_cfg, **values):
    # adam_eps=1 makes AdamW's update ~ lr * gradient for these small gradients: the weights after the steps show a
    # gradient error (with the usual eps the update is about lr * sign(gradient))
    return write_config(root / f"{name}.yaml", model_config=str(_model_config(root, case)),
                        tokenizer_path=str(tokenizer_dir(CASES[case]["tokenizer"])), data_path=str(data_cfg.packed_dir),
                        output_dir=str(root / f"out_{name}"), lr=1.0, adam_eps=1.0, schedule="constant",
                        max_grad_norm=0.0, loss_chunk_size=256, attn_backend="sdpa", bf16=False, plot=False, seed=7,
                        save_steps=0, log_backends=[], **values)


def _trainer(config, console=lambda *_: None, overrides=()):
    from train.config.sections import load_config
    from train.trainer import Trainer

    return Trainer(load_config(config, list(overrides)), console=console)


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case, lora", [
    pytest.param("sharegpt_llama3_1", 0, id="sharegpt_llama3_1"),
    pytest.param("sharegpt_llama3_1", 4, id="sharegpt_llama3_1_lora"),
    pytest.param("agents_qwen3", 0, id="agents_qwen3", marks=pytest.mark.slow),  # ~36K tokens as samples
])
def test_tree_trains_exactly_as_samples(built, case, lora, tmp_path):
    torch.set_num_threads(1)
    data = built(case)
    steps = CASES[case]["steps"]
    from data.shards.dataset import PackedDataset

    reduction = "sample" if lora else "token"
    extra = {"lora_rank": lora, "lora_alpha": 8.0} if lora else {}
    said: list[str] = []
    trainers, grads, records = {}, {}, {}
    try:
        for mode, cfg in data.items():
            rows = len(PackedDataset(cfg.packed_dir))  # one micro-batch per row; every step holds the whole data set
            config = _config(tmp_path, mode, case, cfg, max_steps=steps, micro_batch_rows=1, grad_accum=rows,
                             loss_reduction=reduction, **extra)
            tr = trainers[mode] = _trainer(config, console=said.append)
            assert all(len(tr.sampler.plan(k).step_rows) == rows for k in range(steps))
            grads[mode] = []
            tr.grad_hook = lambda x, g=grads[mode]: g.append(_grads(x.model))
        s, t = trainers["samples"], trainers["tree"]
        assert "tree_spans" in t.dataset.token_fields and "tree_spans" not in s.dataset.token_fields
        assert int(np.sum(t.dataset.row_n_tokens)) < int(np.sum(s.dataset.row_n_tokens))
        assert sum("tree = its paths" in line for line in said) == 1, said  # the tree run's start-up self-check
        for (name, a), b in zip(s.model.named_parameters(), t.model.parameters()):
            assert torch.equal(a, b), f"the two trainers start from different weights ({name})"
        unpacked = case.startswith("sharegpt") and not lora  # the agent's 3-4K-token steps: eager attention is slow
        if unpacked:  # samples == transformers' unpacked forward of each rendered step (token mean, per category)
            ref_loss, ref_cats = _unpacked_reference(s, data["samples"])
        for mode, tr in trainers.items():
            records[mode] = tr.train()
        assert len(records["tree"]) == len(records["samples"]) == steps
        names = {v: k for k, v in s.plan.data.categories.items()}
        for step, (rs, rt) in enumerate(zip(records["samples"], records["tree"])):
            assert abs(rt["loss"] - rs["loss"]) <= TOL * max(1.0, rs["loss"]), step
            assert rt["loss_tokens"] == rs["loss_tokens"] and rt["tokens"] < rs["tokens"], step
            assert rs["category_loss"].keys() == rt["category_loss"].keys() and len(rs["category_loss"]) == CASES[case]["categories"]
            for name, value in rs["category_loss"].items():
                assert abs(rt["category_loss"][name] - value) <= TOL * max(1.0, value), (step, name)
            if step == 0 and unpacked:
                assert abs(rs["loss"] - ref_loss) <= TOL * max(1.0, ref_loss)
                for name, value in rs["category_loss"].items():
                    assert abs(value - ref_cats[names[name]]) <= TOL * max(1.0, value), name
            gs, gt = grads["samples"][step], grads["tree"][step]
            assert gs.keys() == gt.keys() and gs
            if lora:
                assert all("lora_" in n for n in gs), "LoRA trains the adapters only"
            for name in gs:
                _close(gt[name], gs[name], f"step {step + 1}: grad {name}")
        moved = 0
        for (name, a), (_, b) in zip(s.model.named_parameters(), t.model.named_parameters()):
            _close(b.detach(), a.detach(), f"weights after {steps} step(s): {name}")
            moved += a.requires_grad
        assert moved > 0
    finally:
        for tr in trainers.values():
            tr.metrics.close()


# ---------------------------------------------------------------------------------------------- DP, GA, resume, LoRA
@pytest.mark.multiprocess
def test_trees_under_data_parallelism_accumulation_lora_and_resume(built, tmp_path):
    """2 processes x grad_accum 2 with LoRA, stopped after step 2, then resumed in 1 process with grad_accum 4 (a
    resume on another layout), equal 1 uninterrupted process with grad_accum 4: each step's rows (4 of the data's
    tree rows, the last step of an epoch short, an epoch boundary crossed), loss, category losses, gradients, and
    the adapter after the last step."""
    from data.shards.dataset import PackedDataset
    from train.checkpoint import safe_load
    from train.metrics import read_log

    torch.set_num_threads(1)
    case, cfg = "sharegpt_llama3_1", built("sharegpt_llama3_1")["tree"]
    n_rows = len(PackedDataset(cfg.packed_dir))
    assert n_rows > 4 and n_rows % 4, n_rows  # steps of 4 rows: partial epochs, a short last step
    steps = -(-n_rows // 4) + 1  # into the second epoch
    config = _config(tmp_path, "tree", case, cfg, max_steps=steps, micro_batch_rows=1, lora_rank=4, lora_alpha=8.0,
                     loss_reduction="token")
    out = tmp_path / "dp"

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_train_worker.py"), str(config), str(tmp_path / "grads"), f"output_dir={out}",
           "grad_accum=2", "stop_at_step=2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    ref_grads: list[dict] = []
    ref = _trainer(config, overrides=[f"output_dir={tmp_path / 'ref'}", "grad_accum=4"])
    resumed = None
    try:
        ref.grad_hook = lambda x: ref_grads.append(_grads(x.model))
        ref_log = ref.train()
        assert [r["step"] for r in ref_log] == list(range(1, steps + 1))

        said: list[str] = []
        resumed = _trainer(config, console=said.append,
                           overrides=[f"output_dir={out}", "grad_accum=4", "resume=latest"])
        assert resumed.step == 2 and any("resumed from" in line for line in said), said
        for step in range(steps):  # the data position: every step trains the reference's rows
            np.testing.assert_array_equal(resumed.sampler.plan(step).step_rows, ref.sampler.plan(step).step_rows)
        resumed_grads: list[dict] = []
        resumed.grad_hook = lambda x: resumed_grads.append(_grads(x.model))
        resumed.train()
        log = read_log(out)
        assert [r["step"] for r in log] == list(range(1, steps + 1))
        for got, want in zip(log, ref_log):
            assert abs(got["loss"] - want["loss"]) <= TOL * max(1.0, want["loss"]), got["step"]
            assert (got["tokens"], got["loss_tokens"]) == (want["tokens"], want["loss_tokens"]), got["step"]
            for name, value in want["category_loss"].items():
                assert abs(got["category_loss"][name] - value) <= TOL * max(1.0, value), (got["step"], name)
        assert {r["loss_tokens"] for r in ref_log[:steps - 1]} != {0}
        dp_grads = [safe_load(tmp_path / "grads" / f"step_{k}.pt") for k in (1, 2)]
        for step, got in enumerate(dp_grads + resumed_grads):
            want = ref_grads[step]
            assert got.keys() == want.keys() and want and all("lora_" in n for n in want)
            for name in want:
                _close(got[name], want[name], f"step {step + 1}: grad {name}")
        for (name, a), (_, b) in zip(ref.model.named_parameters(), resumed.model.named_parameters()):
            _close(b.detach(), a.detach(), f"weights after {steps} steps: {name}")
    finally:
        for tr in (ref, resumed):
            if tr is not None:
                tr.metrics.close()
