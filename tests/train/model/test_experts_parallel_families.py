"""expert_parallel_size: 2 through the trainer's start-up (`python -m train` under torchrun, gloo, 2 CPU processes)
equals one process without expert parallelism on the same 2 rows a step, for the families and features
tests/train/model/test_experts_parallel.py does not run: losses, router aux losses and gradient norms of 3 steps within
1e-5 relative, and final/ equal to the reference's final/ (each tensor within 1e-5 of its scale):
- deepseek_v3 (a dense first layer, a shared expert, grouped sigmoid routing with its correction bias, latent
  attention) under FSDP2 with tiled_mlp: the dense layer tiled over tokens, the routed experts over the rows they
  receive after the exchange (train/model/experts.py `tiled_local_experts`);
- the qwen3_5_moe composite's text decoder (gated delta-net and full attention layers) on the plain engine with
  tiled_mlp, final/ the whole composite;
- mixtral (a newly marked family) with LoRA on its attention and on its routed experts (peft's parameter targets:
  one adapter per expert, whole on every rank, each rank adding its experts' deltas to its part), stopped after
  step 2 and resumed for step 3 (a second launch): the adapter and the merged model equal the uninterrupted
  one-process LoRA run's; its step-2 checkpoint also resumes on one process without EP.
One launch per family (mixtral: two); the references run in this process."""
from __future__ import annotations

import pytest
import torch

from tests._train_helpers import one_thread, random_rows, run_train, write_packed  # noqa: F401
from tests._train_helpers import VOCAB
from tests.train.model.test_experts_parallel import AUX, COMMON, RTOL, STEPS, _model_config, _rel, _setup
from train.config.sections import load_config
from train.metrics import read_log
from train.trainer import Trainer

LORA = ["lora_rank=4", "lora_alpha=8", 'target_modules=["q_proj","k_proj","v_proj","o_proj"]',
        'target_parameters=["experts.gate_up_proj","experts.down_proj"]', "lora_merge_on_save=true"]
TILED = ["tiled_mlp=true", "tiled_mlp_tile=4"]  # rows of 6-24 tokens a sequence, 3 a row: several tiles per layer


def _family_config(family: str) -> dict:
    """Tiny random-init configs, 8 experts top-2: deepseek_v3 as tests/train/model/test_experts_parallel.py has it; mixtral
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
    "qwen3_5_moe": (AUX + TILED + ["moe_kernel=loop"], AUX),
    "mixtral": (AUX + LORA + ["moe_kernel=auto"], AUX + LORA),
}
STOPPED = {"mixtral"}  # its EP run stops after step 2 (stop_at_step) and a second launch resumes it (resume=latest)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_families")
    return tmp, write_packed(tmp / "data", random_rows(5, 6))


def _runs(data, family: str):
    """The EP 2 run (2 processes) and the one-process reference (2 micro-batches a step): their output dirs, the
    reference's log and the EP run's console output."""
    tmp, config = _setup(data, family, _family_config(family))
    ep_options, shared = OPTIONS[family]
    ep_out, ref_out = tmp / f"{family}_ep2", tmp / f"{family}_ref"
    ep_run = [f"output_dir={ep_out}", *COMMON, *ep_options, "expert_parallel_size=2", "launch.num_processes=2"]
    if family in STOPPED:
        run_train(config, [*ep_run, "stop_at_step=2"], nproc=2)
        ep_run.append("resume=latest")
    proc = run_train(config, ep_run, nproc=2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_log = Trainer(load_config(config, [f"output_dir={ref_out}", *COMMON, *shared, "grad_accum=2"]),
                          console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)
    return config, ep_out, ref_out, ref_log, proc.stdout + proc.stderr


def _assert_same_logs(ep_out, ref_log, aux: bool):
    log = read_log(ep_out)
    assert [r["step"] for r in log] == [r["step"] for r in ref_log] == list(range(1, STEPS + 1))
    for got, want in zip(log, ref_log):
        assert ("aux_loss" in want) == aux
        for key in [key for key in ("loss", "aux_loss", "grad_norm") if key in want]:
            assert _rel(got[key], want[key]) <= RTOL, (key, got["step"], got[key], want[key])


def _assert_same_tensors(got_file, want_file, experts: str = ".experts."):
    """The same keys and tensors (every expert whole); atol as tests/train/model/test_experts_parallel.py says why."""
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

    _, ep_out, ref_out, ref_log, output = _runs(data, "deepseek_v3")
    assert "expert parallel 2: 4 of 8 experts per rank, grouped_mm (1 MoE layers)" in output
    assert "tiled MLP (dense and experts, 2 modules, 4-token tiles)" in output
    assert "the experts over their edp group" in output
    assert "self-check: packed = unpacked" in output
    _assert_same_logs(ep_out, ref_log, aux=False)
    _assert_same_tensors(ep_out / "final" / "model.safetensors", ref_out / "final" / "model.safetensors")
    assert AutoModelForCausalLM.from_pretrained(ep_out / "final").config.model_type == "deepseek_v3"


@pytest.mark.multiprocess
def test_qwen3_5_moe_composite_ep2_equals_one_process(data):
    """The qwen3_5_moe composite's text decoder under EP 2 with tiled_mlp == one process untiled; final/ is the whole
    composite (towers included, unchanged: trained or not, they are equal to the reference's)."""
    from transformers import AutoModelForImageTextToText

    _, ep_out, ref_out, ref_log, output = _runs(data, "qwen3_5_moe")
    assert "expert parallel 2: 4 of 8 experts per rank, loop" in output
    assert "tiled MLP (experts, 2 modules, 4-token tiles)" in output
    _assert_same_logs(ep_out, ref_log, aux=True)
    _assert_same_tensors(ep_out / "final" / "model.safetensors", ref_out / "final" / "model.safetensors")
    assert AutoModelForImageTextToText.from_pretrained(ep_out / "final").config.model_type == "qwen3_5_moe"


@pytest.fixture(scope="module")
def mixtral_runs(data):
    return _runs(data, "mixtral")


@pytest.mark.multiprocess
def test_mixtral_ep2_lora_on_attention_and_experts_equals_one_process(mixtral_runs):
    """mixtral under EP 2 with LoRA on its attention and its routed experts, stopped after step 2 and resumed ==
    one uninterrupted process with the same LoRA: steps 1-3, the adapter (the experts' adapters trained: B no longer
    zero) and final/merged/ (every expert gathered, its adapter folded in)."""
    from safetensors.torch import load_file

    _, ep_out, ref_out, ref_log, output = mixtral_runs
    assert "expert parallel 2: 4 of 8 experts per rank" in output
    assert "resumed from" in output
    _assert_same_logs(ep_out, ref_log, aux=True)
    adapter = load_file(ep_out / "final" / "adapter_model.safetensors")
    experts_b = [name for name in adapter if ".experts." in name and "lora_B" in name]
    assert len(experts_b) == 2 * 2 and all(adapter[name].abs().max() > 0 for name in experts_b)  # 2 layers x 2
    _assert_same_tensors(ep_out / "final" / "adapter_model.safetensors",
                         ref_out / "final" / "adapter_model.safetensors", experts="")
    _assert_same_tensors(ep_out / "final" / "merged" / "model.safetensors",
                         ref_out / "final" / "merged" / "model.safetensors")


@pytest.mark.multiprocess
def test_mixtral_ep2_lora_checkpoint_resumes_without_ep(mixtral_runs, tmp_path, one_thread):
    """The EP 2 LoRA run's step-2 checkpoint (the frozen experts one file per part, the adapters whole) resumes on
    one process without expert parallelism: step 3, the adapter and final/merged/ equal the uninterrupted run's."""
    config, ep_out, ref_out, ref_log, _ = mixtral_runs
    out = tmp_path / "out"
    log = Trainer(load_config(config, [f"output_dir={out}", *COMMON, *OPTIONS["mixtral"][1], "grad_accum=2",
                                       f"resume={ep_out / 'checkpoints' / 'step-000002'}"]),
                  console=lambda *_: None).train()
    assert [r["step"] for r in log] == [3]
    for key in ("loss", "aux_loss", "grad_norm"):
        assert _rel(log[0][key], ref_log[2][key]) <= RTOL, (key, log[0][key], ref_log[2][key])
    _assert_same_tensors(out / "final" / "adapter_model.safetensors", ref_out / "final" / "adapter_model.safetensors",
                         experts="")
    _assert_same_tensors(out / "final" / "merged" / "model.safetensors",
                         ref_out / "final" / "merged" / "model.safetensors")


@pytest.mark.parametrize("family,kernel", [("gpt_oss", "loop"), ("qwen3_moe", "grouped_mm")])
def test_tiled_local_experts_equal_one_call(family, kernel):
    """The rows a rank's experts receive, in tiles of 3 rows (tiles across expert boundaries, an empty expert) ==
    one call: outputs and the gradients of the rows and of every expert weight (gpt_oss: its biases too)."""
    import copy

    from tests.train.model.test_experts import _close, _experts
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


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_lora_on_the_experts_merges_as_peft_does(family):
    """LoRA on the routed experts' fused weights (target_parameters; gpt_oss: transposed, with biases): the merged
    export (train/model/lora.py, out of place from the state dict) equals peft's own merge_and_unload, key for key."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from train.model.lora import apply_lora, merged_state_dict

    values = {**_family_config("mixtral"), "model_type": family, "num_hidden_layers": 1}
    if family == "gpt_oss":
        values.update(layer_types=["full_attention"], sliding_window=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values))
    lora = apply_lora(model, 4, 8.0, 0.0, ["q_proj"], ["experts.gate_up_proj", "experts.down_proj"])
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # zero at init: the fold would show nothing
            torch.nn.init.normal_(p, std=0.1)
    merged = merged_state_dict(lora, is_main=True)
    want = copy.deepcopy(lora).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    assert any(".experts.gate_up_proj" in k for k in merged)
    for name in want:
        torch.testing.assert_close(merged[name], want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_lora_expert_refusals(tmp_path):
    """One ConfigError naming the key and what works: target_modules naming the experts module (its fused weights:
    target_parameters), a target parameter matching nothing, target_parameters with tiled_mlp or lora_dropout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.config import ConfigError
    from train.config.sections import from_keys
    from train.model.lora import apply_lora

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**_family_config("mixtral"),
                                                                     "num_hidden_layers": 1}))
    with pytest.raises(ConfigError, match=r"target_modules \['experts'\] names the routed experts \(MixtralExperts") as err:
        apply_lora(model, 4, 8.0, 0.0, ["q_proj", "experts"])
    assert 'target_parameters=["experts.gate_up_proj","experts.down_proj"]' in str(err.value)
    with pytest.raises(ConfigError, match=r"target_parameters \['experts.up_proj'\] match no parameter"):
        apply_lora(model, 4, 8.0, 0.0, ["q_proj"], ["experts.up_proj"])
    base = {"data_path": str(tmp_path), "output_dir": str(tmp_path / "out"), "model_config": "m.json", "lora_rank": 4,
            "target_parameters": ["experts.down_proj"]}
    assert from_keys(base).lora.target_parameters == ["experts.down_proj"]
    for extra, needle in (({"tiled_mlp": True}, "set tiled_mlp=false"), ({"lora_dropout": 0.1}, "needs lora_dropout=0"),
                          ({"expert_parallel_size": 2, "distributed_backend": "fsdp2", "launch": {"num_processes": 2}},
                           "expert_parallel_size=2 with LoRA target_parameters=['experts.down_proj'] under "
                           "distributed_backend=fsdp2 is not supported")):
        with pytest.raises(ConfigError, match="target_parameters") as err:
            from_keys({**base, **extra}).validate(extra.get("launch", {}).get("num_processes", 1))
        assert needle in str(err.value)
    from_keys({**base, "expert_parallel_size": 2, "launch": {"num_processes": 2}}).validate(2)  # the plain engine
