"""expert_parallel_size: 2 through the trainer's start-up (`python -m train` under torchrun, gloo, CPU processes)
equals one process without expert parallelism on the same 2 rows a step: losses, router aux losses and gradient
norms of 3 steps within 1e-5 relative, and final/ (every expert, the model's own layout, loading with
from_pretrained) equal to the reference's final/ — qwen3_moe with sequence parallelism 2 on 4 processes (stopped
after step 2 and resumed from its per-part checkpoint) and gpt_oss under FSDP2 on 2; a resume on another degree (2 -> 1);
the refusal of `sh train.sh` on a dense model. deepseek_v3, the qwen3_5_moe composite's text and mixtral, with
tiled_mlp and LoRA: tests/train/model/test_experts_parallel_families.py. The dispatch / combine core alone:
tests/train/model/test_experts.py."""
from __future__ import annotations

import json

import pytest
import torch

from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    VOCAB,
    one_thread,
    random_rows,
    run_train,
    write_config,
    write_packed,
)
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

RTOL = 1e-5
STEPS = 3
COMMON = ["max_grad_norm=0.5", "self_check=true"]
AUX = ["output_router_logits=true", "router_aux_loss_coef=0.05"]  # not deepseek_v3: its routers balance by a bias


def _model_config(family: str) -> dict:
    """Tiny random-init configs: 8 experts top-2, 2 layers, hidden 32."""
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return dict(base, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if family == "gpt_oss":  # expert biases, interleaved clamped SwiGLU, attention sinks
        return dict(base, model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                    swiglu_limit=0.5, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # deepseek_v3: a dense first layer, shared experts, grouped sigmoid routing with its correction bias
    return dict(base, model_type="deepseek_v3", num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                norm_topk_prob=True, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep")
    return tmp, write_packed(tmp / "data", random_rows(5, 6))


def _setup(data, family: str, model_config: dict | None = None):
    """The run config of `family` (its tiny model config: `model_config`, else `_model_config(family)`) on the
    module's data: (the data's tmp dir, the config file)."""
    tmp, packed = data
    config_dict = model_config if model_config is not None else _model_config(family)
    model_config = tmp / f"{family}.json"
    model_config.write_text(json.dumps(config_dict))
    config = write_config(tmp / f"{family}.yaml", data_path=str(packed), model_config=str(model_config),
                          max_steps=STEPS, lr=1e-4, loss_chunk_size=16, plot=False, output_dir=str(tmp / "unused"),
                          seed=3)
    return tmp, config


def _options(family: str) -> list[str]:
    return COMMON + ([] if family == "deepseek_v3" else AUX)


def _reference(config, out, family) -> list[dict]:
    """One process, no expert parallelism, the same 2 rows a step (2 micro-batches)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Trainer(load_config(config, [f"output_dir={out}", *_options(family), "grad_accum=2"]),
                       console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_equal_runs(family, ep_out, ref_out, ref_log, first_step: int = 1, steps: int = STEPS):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    log = read_log(ep_out)
    assert [r["step"] for r in ref_log] == list(range(1, steps + 1))
    assert [r["step"] for r in log] == list(range(first_step, steps + 1))
    for got, want in zip(log, ref_log[first_step - 1:]):
        assert ("aux_loss" in want) == (family != "deepseek_v3")
        for key in [key for key in ("loss", "aux_loss", "grad_norm") if key in want]:
            assert _rel(got[key], want[key]) <= RTOL, (family, key, got["step"], got[key], want[key])
    got, want = load_file(ep_out / "final" / "model.safetensors"), load_file(ref_out / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    experts = [name for name in want if ".experts." in name]
    assert experts and all(got[name].shape == want[name].shape for name in experts)  # every expert exported
    for name in want:  # atol as tests/train/engines/test_fsdp2.py: Adam's first steps turn the rounding of a tiny
        # gradient's sums (another order under EP / SP) into up to lr x its relative error: lr 1e-4 keeps that below
        # 1e-6, while a wrong gradient moves a weight by up to lr a step (the weights are ~0.02)
        torch.testing.assert_close(got[name], want[name], rtol=RTOL,
                                   atol=max(1e-6, RTOL * float(want[name].abs().max())))
    model = AutoModelForCausalLM.from_pretrained(ep_out / "final")
    assert model.config.model_type == family


@pytest.fixture(scope="module")
def qwen3_moe_runs(data):
    """EP 2 x SP 2 on 4 processes (dp 2: one ep group per sp rank, each part's edp group two sp ranks) with
    activation checkpointing, stopped after step 2 (its checkpoint: one file per part of the experts) and resumed to
    the end; and the reference."""
    tmp, config = _setup(data, "qwen3_moe")
    ep_out = tmp / "qwen3_moe_ep2"
    options = [f"output_dir={ep_out}", *_options("qwen3_moe"), "expert_parallel_size=2", "launch.num_processes=4",
               "sequence_parallel_size=2", "gradient_checkpointing=true", "moe_kernel=auto"]
    run_train(config, [*options, "stop_at_step=2"], nproc=4)
    step2 = ep_out / "checkpoints" / "step-000002"
    parts = sorted(path.name for path in step2.glob("*.pt") if path.name.startswith(("model", "optimizer")))
    proc = run_train(config, [*options, "resume=latest"], nproc=4)
    ref_out = tmp / "qwen3_moe_ref"
    return config, ep_out, ref_out, _reference(config, ref_out, "qwen3_moe"), proc.stdout + proc.stderr, parts


@pytest.mark.multiprocess
def test_qwen3_moe_ep2_sp2_equals_one_process(qwen3_moe_runs):
    """EP 2 x SP 2 (resumed from its step-2 checkpoint for step 3) == one process: steps, aux losses, norms,
    final/."""
    config, ep_out, ref_out, ref_log, output, parts = qwen3_moe_runs
    assert "expert parallel 2: 4 of 8 experts per rank, grouped_mm" in output
    assert "resumed from" in output
    assert parts == ["model.ep1.pt", "model.pt", "optimizer.ep1.pt", "optimizer.pt"]  # one file per part
    _assert_equal_runs("qwen3_moe", ep_out, ref_out, ref_log)


@pytest.mark.multiprocess
def test_resume_on_another_degree(qwen3_moe_runs, tmp_path, one_thread):
    """The EP 2 x SP 2 checkpoint of step 2 (4 processes, one file per part) resumes on one process without expert
    parallelism (the parts put together, weights and Adam moments): step 3 and final/ equal the reference's."""
    config, ep_out, ref_out, ref_log, *_ = qwen3_moe_runs
    out = tmp_path / "out"
    log = Trainer(load_config(config, [f"output_dir={out}", *_options("qwen3_moe"), "grad_accum=2",
                                       f"resume={ep_out / 'checkpoints' / 'step-000002'}"]),
                  console=lambda *_: None).train()
    assert [r["step"] for r in log] == [3]
    _assert_equal_runs("qwen3_moe", out, ref_out, ref_log, first_step=3)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["gpt_oss"])
def test_other_families_ep2_fsdp2_equal_one_process(data, family):
    """gpt_oss (expert biases, interleaved clamped SwiGLU, attention sinks; the per-expert loop) under
    distributed_backend: fsdp2 (the experts sharded over their edp group, the rest over all ranks)."""
    tmp, config = _setup(data, family)
    ep_out, ref_out = tmp / f"{family}_ep2", tmp / f"{family}_ref"
    proc = run_train(config, [f"output_dir={ep_out}", *_options(family), "expert_parallel_size=2",
                              "launch.num_processes=2", "moe_kernel=loop", "distributed_backend=fsdp2"], nproc=2)
    output = proc.stdout + proc.stderr
    assert "the experts over their edp group" in output and "4 of 8 experts per rank, loop" in output
    _assert_equal_runs(family, ep_out, ref_out, _reference(config, ref_out, family))


def test_train_sh_refuses_expert_parallelism_on_a_dense_model(data, tmp_path):
    """`sh train.sh` checks expert_parallel_size against the model config before accelerate starts any process:
    one line naming the key, exit 2, nothing written."""
    import os
    import subprocess

    from tests._train_helpers import ROOT

    _, packed = data
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 32,
                                 "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 64}))
    config = write_config(tmp_path / "c.yaml", data_path=str(packed), model_config=str(dense),
                          output_dir=str(tmp_path / "out"))
    proc = subprocess.run(["sh", "train.sh", str(config), "expert_parallel_size=2", "launch.num_processes=2"],
                          cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "config error: expert_parallel_size=2 needs a mixture-of-experts model" in proc.stderr
    assert "set expert_parallel_size=1" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
