"""LoRA on the routed experts (peft's parameter targets, `target_parameters`) under the sharding engines without
expert parallelism: FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, each through `python -m train` on 2 processes (gloo), equal
to one process on the plain engine on the same 2 rows a step (2 micro-batches): losses, router aux losses and
gradient norms of 3 steps within 1e-5 relative, and final/'s adapter (the experts' adapters trained) and
final/merged/ (the adapters folded into every expert) each tensor within 1e-5 of its scale (1e-6 absolute at least:
ZeRO-3 reduce-scatters the gradients, summing them in another order). A tiny mixtral (8 experts top-2, hidden 32),
LoRA on its attention and its experts; one launch per engine, the reference once in this process."""
from __future__ import annotations

import json

import pytest
import torch

from tests._train_helpers import random_rows, run_train, write_config, write_packed
from tests.train.model.test_experts_parallel import AUX, COMMON, STEPS
from tests.train.model.test_experts_parallel_families import LORA, _assert_same_logs, _assert_same_tensors, _family_config
from train.config.sections import load_config
from train.trainer import Trainer

ENGINES = {  # the overrides of each 2-process run, and what its start line says
    "fsdp2": (["distributed_backend=fsdp2"], "FSDP2 ("),
    "zero2": (["deepspeed.stage=2"], "deepspeed stage 2"),
    "zero3": (["deepspeed.stage=3"], "deepspeed stage 3"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The data, the config and the one-process plain run: (tmp, config, reference out dir, its log)."""
    tmp = tmp_path_factory.mktemp("lora_experts_engines")
    packed = write_packed(tmp / "data", random_rows(5, 6))
    model_config = tmp / "mixtral.json"
    model_config.write_text(json.dumps(_family_config("mixtral")))
    config = write_config(tmp / "mixtral.yaml", data_path=str(packed), model_config=str(model_config),
                          max_steps=STEPS, lr=1e-4, loss_chunk_size=16, plot=False, output_dir=str(tmp / "unused"),
                          seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_out = tmp / "ref"
        ref_log = Trainer(load_config(config, [f"output_dir={ref_out}", *COMMON, *AUX, *LORA, "grad_accum=2"]),
                          console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)
    return tmp, config, ref_out, ref_log


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", list(ENGINES))
def test_lora_on_the_experts_two_processes_equal_one(reference, engine):
    from safetensors.torch import load_file

    tmp, config, ref_out, ref_log = reference
    overrides, start_line = ENGINES[engine]
    out = tmp / engine
    proc = run_train(config, [f"output_dir={out}", *COMMON, *AUX, *LORA, "launch.num_processes=2", *overrides],
                     nproc=2)
    output = proc.stdout + proc.stderr
    assert start_line in output
    assert "experts: grouped_mm (transformers' experts module, experts_implementation=grouped_mm" in output  # auto
    _assert_same_logs(out, ref_log, aux=True)
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    experts_b = [name for name in adapter if ".experts." in name and "lora_B" in name]
    assert len(experts_b) == 2 * 2 and all(adapter[name].abs().max() > 0 for name in experts_b)  # 2 layers x 2
    _assert_same_tensors(out / "final" / "adapter_model.safetensors", ref_out / "final" / "adapter_model.safetensors",
                         experts="")
    _assert_same_tensors(out / "final" / "merged" / "model.safetensors",
                         ref_out / "final" / "merged" / "model.safetensors")
