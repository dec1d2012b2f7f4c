"""`sh train.sh` on the embedded example (few steps): loss falls, checkpoint + HF export load and generate."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._train_helpers import ROOT
from train.metrics import read_log


@pytest.fixture(scope="module")
def example_data(tmp_path_factory) -> str:
    """The packed example of `sh data_process.sh` (built into a temp dir when the checkout has none)."""
    packed = ROOT / "outputs" / "example" / "packed"
    if (packed / "meta.json").is_file():
        return str(packed)
    out = tmp_path_factory.mktemp("example_data")
    subprocess.run(["sh", "data_process.sh", "configs/data/example.json", f"output_dir={out}"], cwd=ROOT,
                   check=True, capture_output=True, timeout=600)
    return str(out / "packed")


def _train_sh(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run(["sh", "train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_example_trains_and_exports(example_data, tmp_path):
    out = tmp_path / "run"
    proc = _train_sh("configs/train/example.yaml", f"data_path={example_data}", f"output_dir={out}", "max_steps=8",
                     "warmup_steps=2", "save_steps=4", "grad_accum=1", f"eval_data_path={example_data}",
                     "eval_steps=8")
    log = read_log(out)
    # the run ends with its summary (tests/train/test_metrics.py checks its wording), and without launcher notices
    summary = proc.stdout[proc.stdout.index("run summary: steps 1-8 in "):].splitlines()
    assert f"final loss {log[-1]['loss']:.4g}, eval loss {log[-1]['eval_loss']:.4g} (step 8)" in summary[0]
    assert summary[1:4] == [f"  checkpoint:  {out / 'checkpoints' / 'step-000008'}", f"  final model: {out / 'final'}",
                            f"  try it:      python -m train.chat {out / 'final'}   (one user turn per line; with "
                            ".venv active, from the project directory)"]
    for notice in ("were not passed to `accelerate launch`", "Setting accelerator to CPU"):
        assert notice not in proc.stdout + proc.stderr
    assert [r["step"] for r in log] == list(range(1, 9))
    for record in log:
        for key in ("epoch", "loss", "lr", "grad_norm", "tokens_per_s", "loss_tokens", "category_loss"):
            assert key in record
        assert set(record["category_loss"]) <= {"math", "code", "chat", "tools"}
    assert sum(r["loss"] for r in log[-2:]) / 2 < log[0]["loss"] - 0.5  # from ~ln(2048) = 7.6, visibly falling
    assert "eval_loss" in log[7] and "eval_loss" not in log[0]
    assert abs(log[7]["eval_loss"] - log[7]["loss"]) < 1.0  # the same data, one step apart
    assert (out / "loss.png").is_file() and (out / "tensorboard").is_dir()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-000004", "step-000008"]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = out / "final"
    assert (final / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 8 or int(gen[0, -1]) == tok.eos_token_id
    assert isinstance(tok.decode(gen[0, prompt["input_ids"].shape[1]:]), str)

    # the summary's command on this final/, its input piped: one answer per line, the greedy continuation
    chat = subprocess.run([sys.executable, "-m", "train.chat", str(final), "--max-new-tokens", "8"], cwd=ROOT,
                          input="What is 2 + 3?\n", capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    answer = tok.decode(gen[0, prompt["input_ids"].shape[1]:]).split("<|im_end|>")[0].strip()
    assert chat.stdout == f"assistant: {answer}\n"


def test_config_error_is_reported_before_training(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "train", "configs/train/example.yaml", f"data_path={tmp_path}/missing",
                           f"output_dir={tmp_path}/out"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"config error: data_path: {tmp_path}/missing is not a directory" in proc.stderr
    assert not (tmp_path / "out").exists()  # failed before anything was written


@pytest.mark.multiprocess
def test_sequence_parallel_example_matches_single_process(example_data, tmp_path):
    """`sh train.sh configs/train/example_sp.yaml`: 2 CPU processes, one row split over an sp group of 2, logs the
    same losses and gradient norms as the single-process example (labels shifted once on the whole row)."""
    steps = ["max_steps=3", "save_steps=0", "plot=false", "log_backends=[]", f"data_path={example_data}"]
    _train_sh("configs/train/example_sp.yaml", f"output_dir={tmp_path / 'sp'}", *steps)
    _train_sh("configs/train/example.yaml", f"output_dir={tmp_path / 'one'}", *steps)
    sp, one = read_log(tmp_path / "sp"), read_log(tmp_path / "one")
    assert [r["step"] for r in sp] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(sp, one):
        assert a["loss_tokens"] == b["loss_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["category_loss"].keys() == b["category_loss"].keys()
        for name in a["category_loss"]:
            assert a["category_loss"][name] == pytest.approx(b["category_loss"][name], rel=1e-5)


def test_train_sh_reports_config_errors_before_launching(tmp_path):
    """`sh train.sh` checks the config before `accelerate launch` starts any process: one clear line, exit 2."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(["sh", "train.sh", "configs/train/example_sp.yaml", "launch.num_processes=3",
                           f"output_dir={tmp_path}/out"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert "config error: world size 3 is not divisible by sequence_parallel_size=2" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_moe_example_trains_lora_on_experts_split_over_two_processes(example_data, tmp_path):
    """`sh train.sh configs/train/example_moe.yaml` (2 steps): a tiny Qwen3-MoE, expert_parallel_size 2 on 2 CPU
    processes, LoRA on the attention and on the routed experts. Its losses and gradient norms are one process's
    without expert parallelism on the same 2 rows a step (grad_accum 2); the adapter holds the experts' trained
    factors and final/merged/ loads as a causal LM."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tests._train_helpers import in_project_root
    from train.config.sections import load_config
    from train.trainer import Trainer

    steps = ["max_steps=2", "save_steps=0", "plot=false", f"data_path={example_data}"]
    proc = _train_sh("configs/train/example_moe.yaml", f"output_dir={tmp_path / 'ep2'}", *steps)
    assert "expert parallel 2: 4 of 8 experts per rank" in proc.stdout, proc.stdout[-3000:]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with in_project_root():
            Trainer(load_config("configs/train/example_moe.yaml", [
                f"output_dir={tmp_path / 'one'}", *steps, "expert_parallel_size=1", "launch.num_processes=1",
                "grad_accum=2"]), console=lambda *_: None).train()
    finally:
        torch.set_num_threads(before)
    ep2, one = read_log(tmp_path / "ep2"), read_log(tmp_path / "one")
    assert [r["step"] for r in ep2] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(ep2, one):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    final = tmp_path / "ep2" / "final"
    with safe_open(final / "adapter_model.safetensors", "pt") as adapter:
        experts_b = [adapter.get_tensor(k) for k in adapter.keys() if ".mlp.experts." in k and "lora_B" in k]
    assert len(experts_b) == 4 and all(float(t.abs().max()) > 0 for t in experts_b)  # 2 layers x 2 fused weights
    merged = AutoModelForCausalLM.from_pretrained(final / "merged")
    assert type(merged).__name__ == "Qwen3MoeForCausalLM"
