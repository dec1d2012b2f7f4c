"""MoE router load-balancing loss (train/model/moe.py): a packed row equals transformers' own aux_loss of the same
sequences as one padded batch (value and gradient); gradient accumulation == data parallel, sequence parallel ==
one process, a filler micro-batch adds nothing; aux_loss is logged. Tiny random MoE models, CPU fp32."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.config import ConfigError
from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    ROOT,
    free_port,
    one_thread,
    run_train,
    synthetic_sequence,
    untrained_sequence,
    write_config,
    write_packed,
)
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.steps.batch import make_batch, step_totals
from train.checkpoint import safe_load
from train.config.sections import load_config
from train.metrics import loss_curves, plot_losses, read_log
from train.model.moe import resolve_router_aux
from train.model.packed import PackedCausalLM
from train.trainer import Trainer

SDPA_KERNELS = LayerKernels(every=BACKENDS["sdpa"])  # every layer through the SDPA loop

RTOL = 1e-5
COEF = 0.1

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_moe(family: str, **overrides):
    """A random 2-layer MoE causal LM (4 experts, top 2) with the packsft attention."""
    import transformers

    import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0, use_cache=False,
                  output_router_logits=True, router_aux_loss_coef=COEF, num_experts_per_tok=2)
    if family == "mixtral":
        config, model = transformers.MixtralConfig(num_local_experts=4, **common), transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, head_dim=16, **common)
        model = transformers.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32, **common)
        model = transformers.Qwen2MoeForCausalLM
    elif family == "gpt_oss":
        config = transformers.GptOssConfig(num_local_experts=4, head_dim=16, **common)
        model = transformers.GptOssForCausalLM
    elif family == "jetmoe":  # its coefficient key is aux_loss_coef (router_aux_loss_coef is not given)
        jet = {k: v for k, v in common.items() if k not in ("num_attention_heads", "router_aux_loss_coef")}
        config = transformers.JetMoeConfig(num_local_experts=4, kv_channels=16, aux_loss_coef=COEF, **jet)
        model = transformers.JetMoeForCausalLM
    else:  # deepseek_v3: no load-balancing loss in transformers
        config = transformers.DeepseekV3Config(n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
                                               first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None,
                                               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                               v_head_dim=16, **common)
        model = transformers.DeepseekV3ForCausalLM
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return model._from_config(config, attn_implementation="packsft", dtype=torch.float32)


def tiny_composite_moe(model_type: str):
    """A composite checkpoint (towers + MoE text decoder: 4 experts, top 2) whose forward adds the aux loss from
    its text config."""
    from transformers import AutoModelForImageTextToText

    import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")
    from tests.model_zoo import tiny_composite_config
    from train.model.composite import attn_implementation

    config = tiny_composite_config(model_type, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                   router_aux_loss_coef=COEF)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation(config, "packsft"),
                                                   dtype=torch.float32)


COMPOSITES = ("qwen3_vl_moe", "qwen3_5_moe")


def save_tiny_moe(path, **overrides):
    model = tiny_moe("mixtral", **overrides)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(path)
    return path


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


def _assert_same_grads(got: dict, ref: dict, what: str, rtol: float = RTOL):
    assert got.keys() == ref.keys(), what
    for name in ref:
        err = _rel_err(got[name], ref[name])
        assert err <= rtol, f"{what}: {name} relative error {err:.2e}"


# ------------------------------------------------------------------------------------ the definition (HF's)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "jetmoe", *COMPOSITES])
def test_packed_row_equals_hf_padded_batch(family):
    rng = np.random.default_rng(1)
    seqs = [synthetic_sequence(rng, 11, 2, 1), synthetic_sequence(rng, 17, 3, 2), untrained_sequence(rng, 5),
            synthetic_sequence(rng, 9, 1, 1)]
    row = {k: np.concatenate([s[k] for s in seqs]) for k in seqs[0]}
    row["seq_lens"] = np.array([len(s["input_ids"]) for s in seqs])
    meta = {"row_n_loss_tokens": [int((row["labels"] != -100).sum())], "row_n_trained_turns": [6],
            "row_n_samples": [3]}
    batch = make_batch([row], step_totals(meta, [0]), "token")

    build = tiny_composite_moe if family in COMPOSITES else tiny_moe
    packed_lm = build(family)
    router_aux, _ = resolve_router_aux(packed_lm, None, None)
    assert router_aux is not None and router_aux.coef == COEF
    model = PackedCausalLM(packed_lm, chunk_size=8, num_categories=3, router_aux=router_aux)
    attn = AttentionContext(batch.cu_seqlens, batch.max_seqlen, SDPA_KERNELS)
    *_, aux = model(batch.input_ids, batch.position_ids, batch.targets, batch.weights,
                    batch.target_categories, attn)
    aux.backward()

    ref_lm = build(family)
    ref_lm.set_attn_implementation("eager")
    ref_lm.load_state_dict(packed_lm.state_dict())
    longest = max(len(s["input_ids"]) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.int64)
    mask = torch.zeros(len(seqs), longest, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s["input_ids"])] = torch.from_numpy(s["input_ids"].astype(np.int64))
        mask[i, : len(s["input_ids"])] = 1
    ref = COEF * ref_lm(input_ids=ids, attention_mask=mask, use_cache=False).aux_loss
    ref.backward()

    assert float(ref.detach()) > 0
    assert _rel_err(aux.detach(), ref.detach()) <= RTOL
    grads = {n: p.grad for n, p in packed_lm.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref_lm.named_parameters() if p.grad is not None}
    assert any("gate" in n or "router" in n for n in ref_grads)
    # Qwen3.5's gated-delta-rule layers scan the packed row in other chunks than the padded batch: fp32 rounding of
    # the scan reaches 1.2e-5 in single elements (the conformance suite's gradient bar is 3e-5)
    _assert_same_grads(grads, ref_grads, family, rtol=3e-5 if family == "qwen3_5_moe" else RTOL)


def test_gpt_oss_router_logits_give_hf_aux_loss():
    """gpt_oss's packed forward differs from HF's (the packsft attention has no attention sinks), so its aux is
    checked on HF's own router logits of a padded batch: train/model/moe.py's maths equals HF's aux_loss there."""
    lm = tiny_moe("gpt_oss")
    lm.config._attn_implementation = "eager"
    mask = torch.tensor([[1] * 9 + [0] * 3, [1] * 12, [1] * 4 + [0] * 8])
    out = lm(input_ids=torch.randint(0, 128, mask.shape), attention_mask=mask, use_cache=False)
    router_aux, _ = resolve_router_aux(lm, None, None)
    ours = router_aux.share(out.router_logits, mask.reshape(-1))
    assert _rel_err(ours.detach(), COEF * out.aux_loss.detach()) <= RTOL


def test_each_family_reads_its_own_coefficient_key():
    """JetMoe weighs its aux loss with `aux_loss_coef` (its causal LM multiplies by that), the others with
    `router_aux_loss_coef`; the train key overrides either."""
    jetmoe = tiny_moe("jetmoe", aux_loss_coef=0.3)
    assert not hasattr(jetmoe.config, "router_aux_loss_coef")
    assert resolve_router_aux(jetmoe, None, None)[0].coef == 0.3 == jetmoe.aux_loss_coef
    assert resolve_router_aux(jetmoe, None, 0.5)[0].coef == 0.5
    assert resolve_router_aux(tiny_moe("mixtral", router_aux_loss_coef=0.2), None, None)[0].coef == 0.2


def test_families_without_hf_aux_loss():
    lm = tiny_moe("deepseek_v3")
    router_aux, warning = resolve_router_aux(lm, None, None)  # the model config's output_router_logits: a no-op
    assert router_aux is None and "DeepseekV3ForCausalLM" in warning and "without one" in warning
    with pytest.raises(ConfigError, match="output_router_logits: true"):
        resolve_router_aux(lm, True, None)
    assert resolve_router_aux(tiny_moe("mixtral"), False, None) == (None, None)
    assert resolve_router_aux(tiny_moe("mixtral", output_router_logits=False), True, 0.5)[0].coef == 0.5


# ------------------------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    """4 rows of odd length (sequence parallelism pads them) and a saved tiny Mixtral."""
    tmp = tmp_path_factory.mktemp("moe")
    rng = np.random.default_rng(7)
    rows = [[synthetic_sequence(rng, n, 2, 1 + k % 2) for k, n in enumerate(lengths)]
            for lengths in ((11, 17, 9), (13, 8, 14), (21, 6), (9, 9, 9))]
    data = write_packed(tmp / "data", rows)
    model = save_tiny_moe(tmp / "model")
    config = write_config(tmp / "c.yaml", data_path=str(data), model_path=str(model), max_steps=1, lr=1e-3,
                          max_grad_norm=0.0, loss_chunk_size=8, plot=False, output_dir=str(tmp / "unused"))
    return tmp, rows, config


def _in_process(config, out, *overrides, console=None):
    """(log records, per-step summed gradients) of a single-process run."""
    trainer = Trainer(load_config(config, [f"output_dir={out}", *overrides]), console=console or (lambda *_: None))
    grads = []
    trainer.grad_hook = lambda tr: grads.append(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    )
    return trainer.train(), grads


def _two_processes(config, out, grads_dir, *overrides):
    """Log records and rank 0's per-step gradients of a 2-process gloo run (tests/_train_worker.py)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests" / "_train_worker.py"), str(config), str(grads_dir), f"output_dir={out}", *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = read_log(out)
    return log, [safe_load(grads_dir / f"step_{r['step']}.pt") for r in log]


def _assert_same_step(got: dict, ref: dict, got_grads: dict, ref_grads: dict, what: str):
    assert ref["aux_loss"] > 0
    assert got["aux_loss"] == pytest.approx(ref["aux_loss"], rel=RTOL), what
    assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL), what
    _assert_same_grads(got_grads, ref_grads, what)


@pytest.fixture(scope="module")
def accumulation(moe_setup):
    """The reference step: two rows as 2 micro-batches of one process; (log, gradients, console lines)."""
    tmp, _, config = moe_setup
    lines = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    log, grads = _in_process(config, tmp / "ga", "grad_accum=2", console=lines.append)
    torch.set_num_threads(before)
    return log, grads, lines


@pytest.mark.multiprocess
def test_data_parallel_equals_accumulation(moe_setup, accumulation, tmp_path):
    """The same two rows as one micro-batch on each of 2 dp ranks; aux_loss reaches log.jsonl, the console line
    and the loss curves."""
    tmp, _, config = moe_setup
    ref_log, ref_grads, lines = accumulation
    log, grads = _two_processes(config, tmp_path / "dp", tmp_path / "grads")
    assert len(log) == len(ref_log) == 1
    _assert_same_step(log[0], ref_log[0], grads[0], ref_grads[0], "dp 2 vs grad_accum 2")
    assert read_log(tmp / "ga")[0]["aux_loss"] == ref_log[0]["aux_loss"]
    assert any("aux_loss=" in line for line in lines)
    assert any("router aux loss (coef 0.1, 4 experts, top 2)" in line for line in lines)
    assert loss_curves(ref_log)["aux_loss"] == ([1], [ref_log[0]["aux_loss"]])
    assert plot_losses(tmp / "ga").is_file()


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["deepspeed.stage=2", "distributed_backend=fsdp2"], ids=["zero2", "fsdp2"])
def test_sharded_backends_scale_aux_like_the_loss(moe_setup, accumulation, tmp_path, backend):
    """ZeRO-2 / FSDP2 over 2 dp ranks: DeepSpeed's mean over ranks undone, FSDP2's reduce-scatter summing, for the
    aux term too (the gradient norm is scale-sensitive). The first DeepSpeed run on a machine JIT-builds its CPU
    comm op (about 2 minutes)."""
    _, _, config = moe_setup
    ref_log, _, _ = accumulation
    out = tmp_path / "sharded"
    run_train(config, [f"output_dir={out}", backend, "launch.num_processes=2"], nproc=2)
    (got,) = read_log(out)
    assert got["aux_loss"] == pytest.approx(ref_log[0]["aux_loss"], rel=RTOL)
    assert got["loss"] == pytest.approx(ref_log[0]["loss"], rel=RTOL)
    assert got["grad_norm"] == pytest.approx(ref_log[0]["grad_norm"], rel=RTOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp_backend", ["torch", "ulysses"])
def test_sequence_parallel_equals_one_process(moe_setup, tmp_path, sp_backend):
    """The router statistics of the whole row: summed over the sp group whether its ranks hold a slice of the
    tokens (gather) or, inside attention, all tokens for some heads (Ulysses: the MoE layers still see a slice)."""
    _, _, config = moe_setup
    ref_log, ref_grads = _in_process(config, tmp_path / "one")
    log, grads = _two_processes(config, tmp_path / "sp", tmp_path / "grads", "sequence_parallel_size=2",
                                f"sp_backend={sp_backend}", "launch.num_processes=2")
    assert len(log) == len(ref_log) == 1
    _assert_same_step(log[0], ref_log[0], grads[0], ref_grads[0], f"sp 2 ({sp_backend}) vs one process")


def test_filler_micro_batch_adds_nothing(moe_setup, tmp_path):
    """The last step of an epoch of 3 rows at 2 per step: one real micro-batch and a filler; the step equals its
    real row alone (the filler's tokens are no router rows, and the mean is over the real micro-batch only)."""
    _, rows, _ = moe_setup
    model = save_tiny_moe(tmp_path / "model")
    seed = next(s for s in range(100) if np.random.default_rng([s, 0]).permutation(3)[2] == 2)

    def first_step_of(name, step_rows, step, **values):
        data = write_packed(tmp_path / f"data_{name}", step_rows)
        config = write_config(tmp_path / f"{name}.yaml", data_path=str(data), model_path=str(model), lr=1e-3,
                              max_grad_norm=0.0, loss_chunk_size=8, plot=False, output_dir=str(tmp_path / name),
                              **values)
        trainer = Trainer(load_config(config), console=lambda *_: None)
        grads = {}
        trainer.grad_hook = lambda tr: grads.update(
            {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        )
        plan = trainer.sampler.plan(step)
        return plan, trainer.train_step(plan), grads

    plan, with_filler, grads = first_step_of("filler", rows[:3], 1, grad_accum=2, num_epochs=1, seed=seed)
    assert [mb.filler for mb in plan.micro_batches] == [False, True] and plan.n_real_micro_batches == 1
    _, alone, alone_grads = first_step_of("alone", [rows[2]], 0, max_steps=1)
    _assert_same_step(with_filler, alone, grads, alone_grads, "filler step vs its real row alone")


def test_train_key_false_turns_it_off(moe_setup, tmp_path):
    _, _, config = moe_setup
    trainer = Trainer(load_config(config, [f"output_dir={tmp_path}", "output_router_logits=false"]),
                      console=lambda *_: None)
    record = trainer.train_step(trainer.sampler.plan(0))
    assert trainer.plan.loss.router_aux is None and "aux_loss" not in record and np.isfinite(record["loss"])
