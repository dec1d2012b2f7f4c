"""Expert parallelism's core (train/model/experts.py) on one process: the dispatch / exchange / combine of N ranks
simulated with the exchanges written out (what all_to_all_single delivers), against transformers' own experts module
on each rank's tokens (outputs and gradients, fp32, 1e-5); grouped_mm == the per-expert loop; the config and model
refusals. The 2-process runs through the trainer: tests/train/model/test_experts_parallel.py."""
from __future__ import annotations

import copy

import pytest
import torch

from common.config import ConfigError
from train.config.ep_rules import model_expert_parallel_problem
from train.config.sections import from_keys
from train.model.experts import (combine, expert_parameter_names, inverse_permutation, keep_part, local_experts,
                                 plan_dispatch, receive_layout)

RTOL = 1e-5


def _close(got, want):
    """Within 1e-5 of the tensor's scale: sums of the same terms in another order (per rank vs over the ranks'
    rows in one product) differ by rounding, relative to the largest terms, not to each element."""
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.detach().abs().max()))


# family -> (its experts class in transformers' modeling module, the tiny config's keys: hidden 32, expert width 16)
EXPERTS = {
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeExperts", {"moe_intermediate_size": 16, "num_experts": None}),
    "gpt_oss": ("gpt_oss", "GptOssExperts", {"intermediate_size": 16, "num_local_experts": None, "swiglu_limit": 0.5}),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Experts", {"moe_intermediate_size": 16, "n_routed_experts": None}),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2Experts", {"moe_intermediate_size": 16, "n_routed_experts": None}),
    "glm4_moe": ("glm4_moe", "Glm4MoeExperts", {"moe_intermediate_size": 16, "n_routed_experts": None}),
    "granitemoe": ("granitemoe", "GraniteMoeExperts", {"intermediate_size": 16, "num_local_experts": None}),
    "minimax": ("minimax", "MiniMaxExperts", {"intermediate_size": 16, "num_local_experts": None}),
    "mixtral": ("mixtral", "MixtralExperts", {"intermediate_size": 16, "num_local_experts": None}),
    "olmoe": ("olmoe", "OlmoeExperts", {"intermediate_size": 16, "num_experts": None}),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeExperts", {"moe_intermediate_size": 16, "num_experts": None}),
    "qwen3_next": ("qwen3_next", "Qwen3NextExperts", {"moe_intermediate_size": 16, "num_experts": None}),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeExperts", {"moe_intermediate_size": 16, "num_experts": None}),
    "qwen3_vl_moe_text": ("qwen3_vl_moe", "Qwen3VLMoeTextExperts", {"moe_intermediate_size": 16, "num_experts": None}),
}
KERNELS = ("loop", "grouped_mm")


def _experts(family: str, num_experts: int = 8):
    """transformers' experts module of a tiny `family` config, random weights."""
    import importlib

    from transformers import AutoConfig

    module_name, class_name, keys = EXPERTS[family]
    config = AutoConfig.for_model(family, hidden_size=32, num_experts_per_tok=2,
                                  **{k: num_experts if v is None else v for k, v in keys.items()})
    cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), class_name)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    module = cls(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return module


def _routing(tokens: int, num_experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return index, weights / weights.sum(dim=-1, keepdim=True)


def _simulated_ep(full, xs, indices, weights, n: int, kernel: str):
    """Each rank's output under expert parallelism of degree n, with the all-to-alls done by hand: owner j receives,
    source by source, the rows each source sends it; the outputs go back the same way."""
    num_experts = full.num_experts
    local = num_experts // n
    names = expert_parameter_names(full, num_experts)
    parts = []
    for j in range(n):
        part = copy.deepcopy(full)
        keep_part(part, names, j * local, local)
        parts.append(part)
    plans = [plan_dispatch(index, num_experts) for index in indices]
    sends = [list(x[order // index.shape[1]].split(per.reshape(n, local).sum(1).tolist()))
             for x, index, (order, per) in zip(xs, indices, plans)]
    back = [[None] * n for _ in range(n)]  # back[source][owner]
    for j in range(n):
        received = torch.stack([per.reshape(n, local)[j] for _, per in plans])  # [sources, local]
        rows = torch.cat([sends[s][j] for s in range(n)])
        perm, per_local = receive_layout(received)
        out = local_experts(parts[j], rows[perm], per_local, kernel)[inverse_permutation(perm)]
        for s, piece in enumerate(out.split(received.sum(1).tolist())):
            back[s][j] = piece
    outs = [combine(torch.cat(back[s]), plans[s][0], weights[s]) for s in range(n)]
    return outs, parts


@pytest.mark.parametrize("family,n,kernel", [(family, n, KERNELS[(i + n // 2) % 2]) for i, family in enumerate(EXPERTS)
                                             for n in (2, 4)])
def test_dispatch_combine_equals_the_experts_module(family, n, kernel):
    """n ranks of 5-9 tokens each (an expert some rank never picks included), top-2 of 8: every rank's output and
    the gradients of its tokens and of every expert's weights equal transformers' module on the same tokens."""
    full = _experts(family)
    k, num_experts = 2, full.num_experts
    xs = [torch.randn(5 + 2 * r, 32, requires_grad=True) for r in range(n)]
    routing = [_routing(x.shape[0], num_experts - 1, k, seed=r) for r, x in enumerate(xs)]  # expert 7: never
    indices, weights = [r[0] for r in routing], [r[1] for r in routing]
    reference = copy.deepcopy(full)
    ref_xs = [x.detach().clone().requires_grad_() for x in xs]
    want = [reference(x, index, w) for x, index, w in zip(ref_xs, indices, weights)]
    got, parts = _simulated_ep(full, xs, indices, weights, n, kernel)
    probes = [torch.randn_like(w) for w in want]
    sum((w * p).sum() for w, p in zip(want, probes)).backward()
    sum((g * p).sum() for g, p in zip(got, probes)).backward()
    for g, w, x, rx in zip(got, want, xs, ref_xs):
        _close(g, w)
        _close(x.grad, rx.grad)
    local = num_experts // n
    for name in expert_parameter_names(reference, num_experts):
        whole = torch.cat([getattr(part, name).grad for part in parts])
        _close(whole, getattr(reference, name).grad)
        assert getattr(parts[0], name).shape[0] == local


@pytest.mark.parametrize("family", list(EXPERTS))
def test_grouped_mm_equals_the_loop(family):
    """One grouped product per projection == one product per expert (fp32 on CPU), forward and backward, with
    empty experts."""
    module = _experts(family)
    per_expert = torch.tensor([3, 0, 5, 1, 0, 4, 2, 0])
    outs, grads = [], []
    x0 = torch.randn(int(per_expert.sum()), 32)
    for kernel in ("grouped_mm", "loop"):
        m = copy.deepcopy(module)
        x = x0.clone().requires_grad_()
        y = local_experts(m, x, per_expert, kernel)
        y.sum().backward()  # an expanded (zero-stride) gradient: grouped_mm's backward needs it contiguous
        outs.append(y)
        grads.append([x.grad, *(p.grad for p in m.parameters())])
    _close(outs[0], outs[1])
    for a, b in zip(*grads):
        _close(a, b)



def _norm_error(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("family, hidden, width", [("qwen3_moe", 2048, 768), ("gpt_oss", 1024, 512)])
def test_grouped_mm_equals_the_loop_in_bf16_on_gpu(family, hidden, width):
    """On CUDA in bf16 (torch._grouped_mm's kernel, not the CPU's): a Qwen3-30B-A3B expert's shape (hidden 2048,
    expert width 768) and gpt_oss's layout (biases, transposed weights, clamped SwiGLU), 16 experts with uneven and
    empty groups: outputs and every gradient within 1e-2 of the loop's by norm (bf16 has 8 bits of mantissa: two
    summation orders differ by ~1e-3; a wrong group or offset by O(1))."""
    import importlib

    from transformers import AutoConfig

    module_name, class_name, keys = EXPERTS[family]
    values = {"moe_intermediate_size": width, "intermediate_size": width}
    config = AutoConfig.for_model(family, hidden_size=hidden, num_experts_per_tok=2,
                                  **{k: 16 if v is None else values.get(k, v) for k, v in keys.items()})
    config._experts_implementation = "eager"
    cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), class_name)
    torch.manual_seed(0)
    module = cls(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=hidden ** -0.5)
    module = module.to("cuda", torch.bfloat16)
    per_expert = torch.tensor([300, 0, 517, 64, 0, 1000, 3, 250, 0, 128, 77, 900, 1, 0, 460, 300], device="cuda")
    x0 = torch.randn(int(per_expert.sum()), hidden, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for kernel in ("grouped_mm", "loop"):
        m = copy.deepcopy(module)
        x = x0.clone().requires_grad_()
        y = local_experts(m, x, per_expert, kernel)
        (y.float() * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        outs.append(y)
        grads.append([x.grad, *(p.grad for p in m.parameters())])
    assert _norm_error(outs[0], outs[1]) <= 1e-2
    for a, b in zip(*grads):
        assert _norm_error(a, b) <= 1e-2

def test_dispatch_plan():
    """Pairs sorted by expert, stable in token order; the receive layout groups source-ordered rows by expert."""
    order, per = plan_dispatch(torch.tensor([[2, 0], [0, 3], [2, 1]]), 4)
    assert order.tolist() == [1, 2, 5, 0, 4, 3] and per.tolist() == [2, 1, 2, 1]
    perm, per_local = receive_layout(torch.tensor([[1, 2], [3, 0]]))  # source 0: e0 x1, e1 x2; source 1: e0 x3
    assert perm.tolist() == [0, 3, 4, 5, 1, 2] and per_local.tolist() == [4, 2]


def _config(tmp_path, **values):
    return from_keys({"data_path": str(tmp_path), "output_dir": str(tmp_path / "out"), "model_config": "m.json",
                      **values})


@pytest.mark.parametrize("values,world,needle", [
    ({"expert_parallel_size": 2, "deepspeed": {"stage": 2}}, 2, "use distributed_backend=fsdp2 with deepspeed.stage=null"),
    ({"expert_parallel_size": 3}, 4, "must divide the data-parallel size (4 = world size 4 / sequence_parallel_size 1)"),
    ({"expert_parallel_size": 2}, 1, "needs 2 processes"),
    ({"expert_parallel_size": 2, "sequence_parallel_size": 2}, 2, "must divide the data-parallel size (1 = world size 2 / sequence_parallel_size 2)"),
    ({"expert_parallel_size": 2, "compile_layers": True}, 2, "compile_layers=false"),
    ({"expert_parallel_size": 0}, 2, "expert_parallel_size must be >= 1"),
])
def test_config_refusals(tmp_path, values, world, needle):
    cfg = _config(tmp_path, launch={"num_processes": world}, **values)
    with pytest.raises(ConfigError, match="expert_parallel_size") as err:
        cfg.validate(world)
    assert needle in str(err.value)


def test_section_and_flat_key(tmp_path):
    assert _config(tmp_path, parallel={"expert_parallel_size": 2}).parallel.expert_parallel_size == 2
    assert _config(tmp_path, expert_parallel_size=2, moe_kernel="loop").moe.moe_kernel == "loop"
    _config(tmp_path, expert_parallel_size=2).validate(4)
    _config(tmp_path, expert_parallel_size=2, sequence_parallel_size=2, launch={"num_processes": 4}).validate(4)
    _config(tmp_path, expert_parallel_size=2, distributed_backend="fsdp2", launch={"num_processes": 4}).validate(4)
    _config(tmp_path, expert_parallel_size=2, lora_rank=4, tiled_mlp=True).validate(2)  # both verified under EP


def test_model_refusals():
    from transformers import AutoConfig

    dense = AutoConfig.for_model("qwen2")
    assert "dense" in model_expert_parallel_problem(2, dense, "qwen2")
    phimoe = AutoConfig.for_model("phimoe", num_local_experts=8)
    assert "'phimoe' is not one expert parallelism supports" in model_expert_parallel_problem(2, phimoe, "phimoe")
    moe = AutoConfig.for_model("qwen3_moe", num_experts=6)
    assert "num_experts=6" in model_expert_parallel_problem(4, moe, "qwen3_moe")
    assert model_expert_parallel_problem(2, moe, "qwen3_moe") is None
    assert model_expert_parallel_problem(1, dense, "qwen2") is None


def test_family_table_marks_the_tested_experts():
    """Every family the table marks for expert parallelism is one whose experts module the dispatch test above
    compares with transformers'; in a tiny model of it (meta weights), the table's path finds one experts module per
    MoE layer, of that class, holding the table's count_key experts."""
    import importlib

    from transformers import AutoConfig, AutoModelForCausalLM

    from train.families import FAMILIES, expert_parallel_families
    from train.model.experts import find_experts

    assert set(expert_parallel_families()) == set(EXPERTS)
    for family in EXPERTS:
        spec = FAMILIES[family].experts
        module_name, class_name, keys = EXPERTS[family]
        config = AutoConfig.for_model(family, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, vocab_size=64, num_experts_per_tok=2,
                                      **{k: 4 if v is None else v for k, v in keys.items()})
        if hasattr(config, "first_k_dense_replace"):
            config.first_k_dense_replace = 1  # a dense first layer (no experts module there), then a MoE layer
        with torch.device("meta"):
            if FAMILIES[family].composite_only:
                modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
                lm = torch.nn.Module()  # its text decoder under a causal LM's attribute names
                lm.config, lm.base_model_prefix = config, "model"
                lm.model = getattr(modeling, class_name.replace("Experts", "Model"))(config)
            else:
                lm = AutoModelForCausalLM.from_config(config)
        found = find_experts(lm, spec.path)
        assert found and all(type(m).__name__ == class_name for m in found), family
        assert {m.num_experts for m in found} == {getattr(config, spec.count_key)}
