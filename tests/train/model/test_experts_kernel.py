"""`moe_kernel` at expert_parallel_size 1: the experts run as transformers' own experts module, and moe_kernel sets
its `experts_implementation` (train/model/experts.py `set_experts_kernel`, the choice `choose_kernel` shared with
expert parallelism): loop -> eager, grouped_mm -> grouped_mm, auto -> grouped_mm where it runs, else eager. Through
the trainer's start-up (in this process, one thread): a tiny qwen3_moe (8 experts top-2, hidden 32) per value, the
implementation on the model's configs, the start line, transformers' grouped_mm forward called (or not), and loop
vs grouped_mm losses of 2 steps within 1e-5 (fp32, CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from tests._train_helpers import random_rows, tiny_model, write_config, write_packed
from tests.train.model.test_experts_parallel import _model_config
from train.config.sections import load_config
from train.trainer import Trainer

KERNELS = {"auto": "grouped_mm", "grouped_mm": "grouped_mm", "loop": "eager"}  # moe_kernel -> implementation (CPU)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """moe_kernel -> (start lines, the implementation each experts module's config holds, the model config's, the
    calls of transformers' grouped_mm experts forward, the log)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from train.model.experts import experts_modules

    tmp = tmp_path_factory.mktemp("moe_kernel")
    packed = write_packed(tmp / "data", random_rows(5, 4))
    model_config = tmp / "qwen3_moe.json"
    model_config.write_text(json.dumps(_model_config("qwen3_moe")))
    config = write_config(tmp / "c.yaml", data_path=str(packed), model_config=str(model_config), max_steps=2,
                          lr=1e-3, loss_chunk_size=16, plot=False, output_dir=str(tmp / "unused"), seed=3)
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return grouped(*args, **kwargs)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ALL_EXPERTS_FUNCTIONS["grouped_mm"] = counted  # this instance's own mapping: the one the experts classes use
    results = {}
    try:
        for kernel in KERNELS:
            lines, calls[:] = [], []
            trainer = Trainer(load_config(config, [f"output_dir={tmp / kernel}", f"moe_kernel={kernel}"]),
                              console=lines.append)
            modules = [m.config._experts_implementation for m in experts_modules(trainer.lm)]
            log = trainer.train()
            results[kernel] = (lines, modules, trainer.lm.config._experts_implementation, len(calls), log)
    finally:
        del ALL_EXPERTS_FUNCTIONS["grouped_mm"]
        torch.set_num_threads(before)
    return results


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_moe_kernel_sets_the_experts_implementation(runs, kernel):
    lines, modules, model, calls, log = runs[kernel]
    implementation = KERNELS[kernel]
    assert modules == [implementation] * 2 and model == implementation  # both MoE layers, the model's config
    kernel_name = "loop" if implementation == "eager" else "grouped_mm"
    start = [line for line in lines if line.startswith("training ")]
    assert len(start) == 1 and (f"experts: {kernel_name} (transformers' experts module, experts_implementation="
                                f"{implementation}, 2 MoE layers)") in start[0]
    assert len(log) == 2
    # transformers' grouped_mm experts forward: every MoE layer's forward (and the self-check's) or never
    assert (calls >= 2 * 2) if implementation == "grouped_mm" else calls == 0


def test_loop_and_grouped_mm_losses_agree(runs):
    loop, grouped = runs["loop"][-1], runs["grouped_mm"][-1]
    assert [r["step"] for r in loop] == [r["step"] for r in grouped] == [1, 2]
    for a, b in zip(loop, grouped):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a[key], b[key])
    assert runs["auto"][-1][-1]["loss"] == grouped[-1]["loss"]  # auto is grouped_mm here


def test_grouped_mm_refused_where_it_cannot_run():
    """Expert rows that are not 16-byte aligned (moe_intermediate_size 3, fp32: 12 bytes): grouped_mm is refused
    naming why, auto falls back to the loop (eager); a dense model has no experts module: nothing to set."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.config import ConfigError
    from train.model.experts import experts_modules, set_experts_kernel

    config = AutoConfig.for_model(**{**_model_config("qwen3_moe"), "moe_intermediate_size": 3})
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"moe_kernel=grouped_mm: torch._grouped_mm needs 16-byte aligned rows: "
                                          r"gate_up_proj has shape \(6, 32\)"):
        set_experts_kernel(model, config, "grouped_mm")
    info = set_experts_kernel(model, config, "auto")
    assert info == {"layers": 2, "kernel": "loop", "implementation": "eager"}
    assert {m.config._experts_implementation for m in experts_modules(model)} == {"eager"}
    dense = tiny_model()
    assert set_experts_kernel(dense, dense.config, "grouped_mm") is None
