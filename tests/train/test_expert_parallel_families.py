"""expert_parallel_size: 2 through the trainer's start-up (`python -m train` under torchrun, gloo, 2 CPU processes)
equals one process without expert parallelism on the same 2 rows a step, for the families and features
tests/train/test_expert_parallel.py does not run: losses, router aux losses and gradient norms of 3 steps within
1e-5 relative, and final/ equal to the reference's final/ (each tensor within 1e-5 of its scale):
- deepseek_v3 (a dense first layer, a shared expert, grouped sigmoid routing with its correction bias, latent
  attention) under FSDP2 with tiled_mlp: the dense layer tiled over tokens, the routed experts over the rows they
  receive after the exchange (train/model/experts.py `tiled_local_experts`);
- the qwen3_5_moe composite's text decoder (gated delta-net and full attention layers), final/ the whole composite;
- mixtral (a newly marked family) on the plain engine with LoRA on its attention and tiled_mlp: the adapter and the
  merged model equal the one-process LoRA run's (the routed experts stay frozen, as without expert parallelism).
One launch per family; the references run in this process."""
from __future__ import annotations

import json

import pytest
import torch

from tests._train_helpers import one_thread, random_rows, run_train, write_config, write_packed  # noqa: F401
from tests._train_helpers import VOCAB
from tests.train.test_expert_parallel import AUX, COMMON, RTOL, STEPS, _model_config, _rel
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

LORA = ["lora_rank=4", "lora_alpha=8", 'target_modules=["q_proj","k_proj","v_proj","o_proj"]',
        "lora_merge_on_save=true"]
TILED = ["tiled_mlp=true", "tiled_mlp_tile=4"]  # rows of 6-24 tokens a sequence, 3 a row: several tiles per layer


def _family_config(family: str) -> dict:
    """Tiny random-init configs, 8 experts top-2: deepseek_v3 as tests/train/test_expert_parallel.py has it; mixtral
    (hidden 32); the qwen3_5_moe composite (towers shrunk, its text decoder: a gated delta-net layer and a full
    attention layer, hidden 64)."""
    if family == "deepseek_v3":
        return _model_config(family)
    if family == "mixtral":
        return dict(model_type="mixtral", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=8,
                    num_experts_per_tok=2, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False,
                    sliding_window=None)
    from tests.model_zoo import tiny_composite_config

    config = tiny_composite_config("qwen3_5_moe", vocab_size=VOCAB, num_experts=8, num_experts_per_tok=2)
    return config.to_dict()


OPTIONS = {  # each family's EP run beyond expert_parallel_size=2 on 2 processes, and what its reference shares
    # deepseek_v3 under FSDP2 (each experts module a unit over its edp group: the tiles recomputed inside its
    # backward); no aux loss: its routers balance by a bias
    "deepseek_v3": (TILED + ["moe_kernel=grouped_mm", "distributed_backend=fsdp2"], []),
    "qwen3_5_moe": (AUX + ["moe_kernel=loop"], AUX),
    "mixtral": (AUX + LORA + TILED + ["moe_kernel=auto"], AUX + LORA),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_families")
    return tmp, write_packed(tmp / "data", random_rows(5, 6))


def _runs(data, family: str):
    """The EP 2 run (2 processes) and the one-process reference (2 micro-batches a step): their output dirs, the
    reference's log and the EP run's console output."""
    tmp, packed = data
    model_config = tmp / f"{family}.json"
    model_config.write_text(json.dumps(_family_config(family)))
    config = write_config(tmp / f"{family}.yaml", data_path=str(packed), model_config=str(model_config),
                          max_steps=STEPS, lr=1e-4, loss_chunk_size=16, plot=False, output_dir=str(tmp / "unused"),
                          seed=3)
    ep_options, shared = OPTIONS[family]
    ep_out, ref_out = tmp / f"{family}_ep2", tmp / f"{family}_ref"
    proc = run_train(config, [f"output_dir={ep_out}", *COMMON, *ep_options, "expert_parallel_size=2",
                              "launch.num_processes=2"], nproc=2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_log = Trainer(load_config(config, [f"output_dir={ref_out}", *COMMON, *shared, "grad_accum=2"]),
                          console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)
    return ep_out, ref_out, ref_log, proc.stdout + proc.stderr


def _assert_same_logs(ep_out, ref_log, aux: bool):
    log = read_log(ep_out)
    assert [r["step"] for r in log] == [r["step"] for r in ref_log] == list(range(1, STEPS + 1))
    for got, want in zip(log, ref_log):
        assert ("aux_loss" in want) == aux
        for key in [key for key in ("loss", "aux_loss", "grad_norm") if key in want]:
            assert _rel(got[key], want[key]) <= RTOL, (key, got["step"], got[key], want[key])


def _assert_same_tensors(got_file, want_file, experts: str = ".experts."):
    """The same keys and tensors (every expert whole); atol as tests/train/test_expert_parallel.py says why."""
    from safetensors.torch import load_file

    got, want = load_file(got_file), load_file(want_file)
    assert got.keys() == want.keys()
    assert any(experts in name for name in want) or experts == ""
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=RTOL,
                                   atol=max(1e-6, RTOL * float(want[name].abs().max())), msg=name)


@pytest.mark.multiprocess
def test_deepseek_v3_ep2_tiled_mlp_equals_one_process(data):
    """deepseek_v3 under EP 2 and FSDP2 with tiled_mlp (4-token tiles: the routed experts' received rows in tiles of
    8 pairs) == one process, untiled."""
    from transformers import AutoModelForCausalLM

    ep_out, ref_out, ref_log, output = _runs(data, "deepseek_v3")
    assert "expert parallel 2: 4 of 8 experts per rank, grouped_mm (1 MoE layers)" in output
    assert "tiled MLP (dense and experts, 2 modules, 4-token tiles)" in output
    assert "the experts over their edp group" in output
    assert "self-check: packed = unpacked" in output
    _assert_same_logs(ep_out, ref_log, aux=False)
    _assert_same_tensors(ep_out / "final" / "model.safetensors", ref_out / "final" / "model.safetensors")
    assert AutoModelForCausalLM.from_pretrained(ep_out / "final").config.model_type == "deepseek_v3"


@pytest.mark.multiprocess
def test_qwen3_5_moe_composite_ep2_equals_one_process(data):
    """The qwen3_5_moe composite's text decoder under EP 2 == one process; final/ is the whole composite (towers
    included, unchanged: trained or not, they are equal to the reference's)."""
    from transformers import AutoModelForImageTextToText

    ep_out, ref_out, ref_log, output = _runs(data, "qwen3_5_moe")
    assert "expert parallel 2: 4 of 8 experts per rank, loop" in output
    _assert_same_logs(ep_out, ref_log, aux=True)
    _assert_same_tensors(ep_out / "final" / "model.safetensors", ref_out / "final" / "model.safetensors")
    assert AutoModelForImageTextToText.from_pretrained(ep_out / "final").config.model_type == "qwen3_5_moe"


@pytest.mark.multiprocess
def test_mixtral_ep2_lora_tiled_mlp_equals_one_process(data):
    """mixtral under EP 2 with LoRA on its attention and tiled_mlp == one process with the same LoRA: the adapter
    (replicated on every rank) and final/merged/ (every expert gathered: frozen, the checkpoint's own)."""
    ep_out, ref_out, ref_log, output = _runs(data, "mixtral")
    assert "expert parallel 2: 4 of 8 experts per rank" in output
    assert "tiled MLP (experts, 2 modules, 4-token tiles)" in output
    _assert_same_logs(ep_out, ref_log, aux=True)
    _assert_same_tensors(ep_out / "final" / "adapter_model.safetensors",
                         ref_out / "final" / "adapter_model.safetensors", experts="")
    _assert_same_tensors(ep_out / "final" / "merged" / "model.safetensors",
                         ref_out / "final" / "merged" / "model.safetensors")


@pytest.mark.parametrize("family,kernel", [("gpt_oss", "loop"), ("qwen3_moe", "grouped_mm")])
def test_tiled_local_experts_equal_one_call(family, kernel):
    """The rows a rank's experts receive, in tiles of 3 rows (tiles across expert boundaries, an empty expert) ==
    one call: outputs and the gradients of the rows and of every expert weight (gpt_oss: its biases too)."""
    import copy

    from tests.train.test_experts import _close, _experts
    from train.model.experts import tiled_local_experts

    module = _experts(family)
    per_expert = torch.tensor([3, 0, 5, 1, 0, 4, 2, 1])
    x0 = torch.randn(int(per_expert.sum()), 32)
    probe = torch.randn(x0.shape[0], 32)
    results = []
    for tile in (3, None):
        m = copy.deepcopy(module)
        x = x0.clone().requires_grad_()
        y = tiled_local_experts(m, x, per_expert, kernel, tile)
        (y * probe).sum().backward()
        results.append((y, x.grad, [p.grad for p in m.parameters()]))
    (y, x_grad, grads), (want_y, want_x_grad, want_grads) = results
    _close(y, want_y)
    _close(x_grad, want_x_grad)
    assert len(grads) == len(want_grads) >= 2
    for got, want in zip(grads, want_grads):
        _close(got, want)
    assert type(y.grad_fn).__name__ == "TiledCallBackward" and type(want_y.grad_fn).__name__ != "TiledCallBackward"


def test_lora_refuses_the_routed_experts():
    """A LoRA target naming a routed-experts module (fused 3-D weights): one ConfigError naming target_modules and
    what works, with or without expert parallelism."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.config import ConfigError
    from train.model.lora import apply_lora

    config = AutoConfig.for_model(**{**_family_config("mixtral"), "num_hidden_layers": 1})
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"target_modules \['experts'\] names the routed experts \(MixtralExperts") as err:
        apply_lora(model, 4, 8.0, 0.0, ["q_proj", "experts"])
    assert 'target_modules=["q_proj","k_proj","v_proj","o_proj"]' in str(err.value) and "lora_rank=0" in str(err.value)
