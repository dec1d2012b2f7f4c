"""Optional step paths: compiled decoder layers and compiled loss chunks (same losses and gradients as eager),
Liger kernels (GPU), and their config checks."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from common.config import ConfigError
from tests._train_helpers import (  # noqa: F401  (one_thread is a fixture)
    one_thread,
    random_rows,
    save_tiny_model,
    write_config,
    write_packed,
)


def _steps(tmp_path, tag, n_steps, **cfg_values):
    """`n_steps` optimizer steps of the real Trainer: (records, gradients of the last step)."""
    from train.config.sections import load_config
    from train.trainer import Trainer

    data = tmp_path / "data"
    if not data.exists():  # rows of different lengths: the compiled layers see several shapes
        write_packed(data, random_rows(21, 3, seqs_per_row=3, min_len=6, max_len=30))
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        save_tiny_model(model_dir)
    cfg = write_config(tmp_path / f"{tag}.yaml", data_path=str(data), model_path=str(model_dir),
                       output_dir=str(tmp_path / f"out_{tag}"), lr=1e-3, max_grad_norm=0.0, loss_chunk_size=8,
                       plot=False, max_steps=n_steps, **cfg_values)
    trainer = Trainer(load_config(cfg), console=lambda *_: None)
    grads = {}
    trainer.grad_hook = lambda tr: grads.update(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    )
    records = [trainer.train_step(trainer.sampler.plan(s)) for s in range(n_steps)]
    return trainer, records, grads


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_compiled_layers_train_like_eager(tmp_path, monkeypatch):
    """compile_layers: three steps over rows of three lengths equal eager (1e-5). On CPU the layers compile with
    the aot_eager backend (dynamo capture + AOT autograd, the graph breaks at the attention call): inductor's C++
    code generation takes minutes on two cores; the GPU test below runs the default backend."""
    eager, eager_records, eager_grads = _steps(tmp_path, "eager", 3)
    monkeypatch.setattr(torch.nn.Module, "compile",
                        functools.partialmethod(torch.nn.Module.compile, backend="aot_eager"))
    compiled, records, grads = _steps(tmp_path, "compiled", 3, compile_layers=True)
    layers = compiled.lm.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in eager_records], rtol=1e-5)
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-5, atol=1e-7)


@pytest.mark.usefixtures("one_thread")
def test_compiled_loss_trains_like_eager(tmp_path, monkeypatch):
    """compile_loss: the trainer's loss runs train.model.loss's compiled chunk function (aot_eager on the CPU, as above);
    two steps equal eager (1e-5)."""
    import train.model.loss

    _, eager_records, eager_grads = _steps(tmp_path, "eager", 2)
    captured = torch.compile(train.model.loss.chunk_ce_grad, dynamic=True, backend="aot_eager")
    calls = []
    monkeypatch.setattr(train.model.loss, "_compiled_chunk_ce_grad", lambda *a: calls.append(1) or captured(*a))
    _, records, grads = _steps(tmp_path, "fused", 2, compile_loss=True)
    assert calls, "the compiled chunk function was not used"
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in eager_records], rtol=1e-5)
    for name in eager_grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-5, atol=1e-7)


def test_liger_needs_a_gpu_and_the_package(tmp_path):
    from train.config.sections import load_config

    cfg_path = write_config(tmp_path / "c.yaml", data_path=str(tmp_path), output_dir=str(tmp_path / "out"),
                            model_config="configs/model/tiny_qwen2.json", liger=True)
    from train.preflight import check_machine

    cfg = load_config(cfg_path)
    with pytest.raises(ConfigError, match="liger"):
        check_machine(cfg)


@pytest.mark.parametrize("name", ["auto", "flash_varlen", "torch_varlen", "flex", "sdpa"])
def test_attn_backend_choices(tmp_path, name):
    from train.config.sections import load_config

    cfg_path = write_config(tmp_path / "c.yaml", data_path=str(tmp_path), output_dir=str(tmp_path / "out"),
                            model_config="configs/model/tiny_qwen2.json", attn_backend=name)
    assert load_config(cfg_path).model.attn_backend == name


def test_unknown_attn_backend_is_a_config_error(tmp_path):
    from train.config.sections import load_config

    cfg_path = write_config(tmp_path / "c.yaml", data_path=str(tmp_path), output_dir=str(tmp_path / "out"),
                            model_config="configs/model/tiny_qwen2.json", attn_backend="xformers")
    with pytest.raises(ConfigError, match="xformers"):
        load_config(cfg_path)


@pytest.mark.gpu
@pytest.mark.parametrize("option", ["compile_layers", "compile_loss", "liger"])
def test_fused_paths_match_eager_on_gpu(tmp_path, option):
    """Inductor-compiled layers / loss chunks / Liger's RMSNorm, SwiGLU and RoPE: bf16 losses of three steps equal the plain
    path within bf16 tolerance."""
    if option == "liger":
        pytest.importorskip("liger_kernel")
    _, plain, _ = _steps(tmp_path, "plain", 3, bf16=True, compile_loss=False)  # auto would compile it on CUDA
    _, fused, _ = _steps(tmp_path, option, 3, bf16=True, **{"compile_loss": False, option: True})
    np.testing.assert_allclose([r["loss"] for r in fused], [r["loss"] for r in plain], rtol=2e-2)
