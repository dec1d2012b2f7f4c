"""What the memory plan (train/plan/memory.py, memory_plan.py, layout.py) knows of the long-row options: the
activations a tiled MLP and activation offload keep, the default tile, the host memory offload pins and the refusal
when the host cannot hold it, the smallest sequence-parallel degree that fits, and `sequence_parallel_size: auto`
(the memory estimate's choice, in the layout and through the trainer). The tiled MLP and activation offload
themselves: tests/train/model/patches/."""
from __future__ import annotations

import pytest
import torch

from common.config import ConfigError
from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_packed  # noqa: F401
from tests.train.model.patches.test_tiled_mlp import _config
from train.plan.memory import (
    LONG_ROW_SHAPES,
    LongRowOptions,
    ModelShape,
    activation_bytes,
    choose_sp_degree,
    default_tile_tokens,
    host_offload_problem,
    longest_row,
    model_state_bytes,
    offload_host_bytes,
    row_fits,
    smallest_sp_degree,
)

pytestmark = pytest.mark.usefixtures("one_thread")

QWEN_15B = LONG_ROW_SHAPES["Qwen2.5-1.5B"]
GB = 10**9
GIB = 2**30


def test_tiled_mlp_keeps_one_tile_of_intermediates():
    tokens, tile = 65536, 4096
    plain = activation_bytes(QWEN_15B, tokens, 2, checkpointing=False, loss_chunk=4096)
    tiled = activation_bytes(QWEN_15B, tokens, 2, checkpointing=False, loss_chunk=4096, tile=tile)
    mlp = 2 * 4 * QWEN_15B.intermediate
    assert plain - tiled == QWEN_15B.n_layers * tokens * mlp - tile * mlp
    ckpt = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096)
    ckpt_tiled = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096, tile=tile)
    assert ckpt - ckpt_tiled == (tokens - tile) * mlp


def test_offload_leaves_two_layer_inputs():
    tokens = 65536
    kept = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096)
    offloaded = activation_bytes(QWEN_15B, tokens, 2, checkpointing=True, loss_chunk=4096, offload=True)
    assert kept - offloaded == (QWEN_15B.n_layers - 2) * tokens * 2 * QWEN_15B.hidden


def test_default_tile():
    assert default_tile_tokens(8960, 2) == 3584  # Qwen2.5-1.5B, bf16: 3584 x 4 x 8960 x 2 B <= 256 MiB
    assert default_tile_tokens(8960, 2) * 4 * 8960 * 2 <= 256 << 20
    assert default_tile_tokens(10**7, 4) == 1024  # never below 1024 tokens


def test_smallest_sp_degree_is_the_first_that_fits():
    state = model_state_bytes(QWEN_15B.n_params, QWEN_15B.n_params, 3, 8, bf16=True)
    options = LongRowOptions(checkpointing=True)
    row = 1 << 20
    k = smallest_sp_degree(QWEN_15B, row, 80 * GB, state, options)
    assert k is not None and k > 1
    assert row_fits(QWEN_15B, row // k, 80 * GB, state, options)
    assert not row_fits(QWEN_15B, -(-row // (k // 2)), 80 * GB, state, options)
    both = LongRowOptions(True, default_tile_tokens(QWEN_15B.intermediate, 2), True)
    assert smallest_sp_degree(QWEN_15B, row, 80 * GB, state, both) < k  # the options save sp ranks
    assert smallest_sp_degree(QWEN_15B, row, 80 * GB, 10**12, options) is None  # the state alone does not fit
    longest = longest_row(QWEN_15B, 80 * GB, state, options)
    assert row_fits(QWEN_15B, longest, 80 * GB, state, options)
    assert not row_fits(QWEN_15B, longest + 1024, 80 * GB, state, options)
    assert smallest_sp_degree(QWEN_15B, longest, 80 * GB, state, options) == 1


def test_offload_host_memory_is_every_layer_input_in_power_of_two_buffers():
    llama = LONG_ROW_SHAPES["Llama-3-8B"]
    assert offload_host_bytes(llama, 524288, 2) == 32 * 524288 * 4096 * 2 == 128 * GIB  # 4 GiB a layer
    assert offload_host_bytes(llama, 393216, 2) == 128 * GIB  # 3 GiB a layer, rounded up to 4 by torch's allocator
    assert offload_host_bytes(llama, 262144, 2) == 64 * GIB
    assert offload_host_bytes(QWEN_15B, 131072, 2) == 28 * 512 * 2**20  # 384 MiB a layer, in 512 MiB buffers
    assert host_offload_problem(llama, 262144, 2, None) is None  # the host unknown: not checked
    assert host_offload_problem(llama, 262144, 2, 80 * GIB) is None  # 64 GiB <= 90% of 80
    problem = host_offload_problem(llama, 262144, 2, 140 * GIB, ranks=2)  # two ranks share the machine
    assert problem == ("activation_offload: a 262,144-token micro-batch per rank keeps 64.0 GiB of pinned host memory "
                       "(32 layers × 2.00 GiB: 262,144 tokens × 4096 hidden × 2 bytes, rounded up to a power of two by "
                       "torch's pinned allocator); this machine has 140.0 GiB available, 63.0 GiB usable per rank for "
                       "its 2 ranks")


def test_the_host_bounds_offload_in_the_plan():
    llama = LONG_ROW_SHAPES["Llama-3-8B"]
    state = model_state_bytes(llama.n_params, 0, 3, 8, bf16=True)  # adapters only: the frozen base's state
    options = LongRowOptions(True, default_tile_tokens(llama.intermediate, 2), True)
    row = 1 << 19
    assert row_fits(llama, row // 4, 80 * GB, state, options)  # 128K per rank (32 GiB pinned): the GPU holds it
    assert row_fits(llama, row // 4, 80 * GB, state, options, host_bytes=120 * GIB, host_ranks=4) is False  # 27 each
    assert row_fits(llama, row // 4, 80 * GB, state, options, host_bytes=120 * GIB, host_ranks=1)  # 108 GiB usable
    assert row_fits(llama, row // 4, 80 * GB, state, LongRowOptions(True), host_bytes=1) == row_fits(
        llama, row // 4, 80 * GB, state, LongRowOptions(True))  # no offload: nothing asked of the host
    gpu_only = choose_sp_degree(llama, row, 8, 80 * GB, state, options).degree
    roomy = 8 * offload_host_bytes(llama, row // gpu_only, 2) * 10 // 9 + GIB  # 8 ranks on one machine
    assert choose_sp_degree(llama, row, 8, 80 * GB, state, options, host_bytes=roomy, host_ranks=8).degree == gpu_only
    tight = choose_sp_degree(llama, row, 8, 80 * GB, state, options, host_bytes=roomy // 2, host_ranks=8)
    assert tight.degree == 2 * gpu_only  # the host, not the GPU, asks for more ranks
    with pytest.raises(ValueError, match=r"over all 8 ranks \(sp degrees tried: \[1, 2, 4, 8\]\), activation_offload: "
                                         r"a 65,536-token micro-batch per rank keeps 16.0 GiB.* usable per rank for its "
                                         r"8 ranks; try more GPUs \(more machines\), activation_offload: false"):
        choose_sp_degree(llama, row, 8, 80 * GB, state, options, host_bytes=40 * GIB, host_ranks=8)


def test_the_memory_plan_refuses_an_offload_the_host_cannot_hold(tmp_path, monkeypatch):
    """Checked before any weight loads, on a GPU only (CUDA faked: the device type and the host query are used)."""
    import train.plan.memory_plan as memory_plan
    from train.preflight import preflight

    cfg = _config(tmp_path, "offload", activation_offload=True)
    model_config = preflight(cfg, 1).model_config
    shape = ModelShape.from_hf_config(model_config)
    assert cfg.steps.micro_batch_rows == 1
    need = offload_host_bytes(shape, 4096 // 2, 2 if cfg.model.bf16 else 4)
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: int(need / 0.9) - 1)

    def plan(device):
        return memory_plan.plan_memory(cfg, model_config, 1, 1, 4096 // 2, False, device=torch.device(device))

    plan("cpu")  # on a CPU device the offload keeps its tensors: nothing to check
    monkeypatch.setattr(memory_plan, "_choose_checkpointing", lambda *args: (True, None, "on"))  # no GPU to query
    with pytest.raises(ConfigError, match=r"a 2,048-token micro-batch per rank keeps .*; set a larger "
                                          r"sequence_parallel_size \(or auto\), shorter rows \(max_length\) or "
                                          r"activation_offload: false"):
        plan("cuda")
    monkeypatch.setattr(memory_plan, "available_host_bytes", lambda: int(need / 0.9) + 8)
    plan("cuda")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share that memory
    with pytest.raises(ConfigError, match="usable per rank for its 2 ranks"):
        plan("cuda")


def test_offload_without_checkpointing_is_not_a_plan():
    with pytest.raises(ValueError, match="checkpointing"):
        LongRowOptions(checkpointing=False, offload=True)


# ---------------------------------------------------------------------------------------------- sequence_parallel_size: auto
def test_sp_auto_is_the_smallest_degree_of_the_world_that_fits():
    state = model_state_bytes(QWEN_15B.n_params, QWEN_15B.n_params, 3, 8, bf16=True)
    options = LongRowOptions(checkpointing=True)
    row = 1 << 20
    choice = choose_sp_degree(QWEN_15B, row, 8, 80 * GB, state, options)
    assert choice.degree == smallest_sp_degree(QWEN_15B, row, 80 * GB, state, options) > 1
    assert row_fits(QWEN_15B, row // choice.degree, 80 * GB, state, options)
    assert not row_fits(QWEN_15B, row // (choice.degree // 2), 80 * GB, state, options)
    assert f"{row // choice.degree:,} tokens per rank fit" in choice.describe()
    assert choose_sp_degree(QWEN_15B, 4096, 8, 80 * GB, state, options).degree == 1  # short rows: data parallel
    # only degrees dividing the world: 6 GPUs offer 1 and 2, not enough for this row
    with pytest.raises(ValueError, match=r"1,048,576-token row does not fit .* all 6 ranks .*\[1, 2\].*tiled_mlp: true"):
        choose_sp_degree(QWEN_15B, row, 6, 80 * GB, state, options)


def test_sp_auto_in_the_layout(tmp_path, monkeypatch):
    """The layout sizes the data's rows against the least free GPU memory (the memory plan's estimate): with just
    enough for half a row it picks 2 (CUDA faked: only the memory query is used); on CPU it keeps 1 and says why; the
    config it was given stays `auto`."""
    import train.plan.memory_plan as memory_plan
    from train.plan.layout import plan_layout
    from train.preflight import preflight

    row = 4096
    write_packed(tmp_path / "data", random_rows(5, 2), meta_extra={"max_length": row})
    save_tiny_model(tmp_path / "model")
    cfg = _config(tmp_path, "auto", sequence_parallel_size="auto", launch={"num_processes": 2})
    cfg.validate(world_size=3)  # auto: no divisibility rule before the degree is chosen
    model_config = preflight(cfg, 2).model_config
    layout = plan_layout(cfg, model_config, 2, row, False)
    assert (layout.sp, layout.sp_reason) == (1, "auto: no CUDA device to size the rows against")
    assert cfg.parallel.sequence_parallel_size == "auto"

    shape = ModelShape.from_hf_config(model_config)
    state = memory_plan._model_state_bytes(cfg, shape, 2, False)
    options = LongRowOptions(checkpointing=True)
    needed = state + activation_bytes(shape, row // 2, 4, True, cfg.steps.loss_chunk_size)
    free = int(needed / 0.9) + 1  # the plan keeps 10% headroom
    assert not row_fits(shape, row, free, state, options, act_bytes=4, loss_chunk=cfg.steps.loss_chunk_size)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(memory_plan.dist, "is_initialized", lambda: False)  # one rank's memory (a group of earlier tests)
    layout = plan_layout(cfg, model_config, 2, row, False)
    assert layout.sp == 2 and layout.sp_reason.startswith("auto: 4,096-token micro-batches, 2,048 tokens per rank fit")
    assert layout.dp == 1 and cfg.parallel.sequence_parallel_size == "auto"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state, 2 * state))
    with pytest.raises(ConfigError, match="sequence_parallel_size: auto: a 4,096-token row does not fit"):
        plan_layout(cfg, model_config, 2, row, False)


def test_sp_auto_trains_and_says_so(tmp_path):
    from train.trainer import Trainer

    lines = []
    trainer = Trainer(_config(tmp_path, "auto_run", sequence_parallel_size="auto"),
                      console=lambda *_: None)
    trainer._console_write = lines.append
    trainer.train()
    assert trainer.mesh.sp_size == 1 and trainer.plan.layout.sp == 1
    assert trainer.cfg.parallel.sequence_parallel_size == "auto"  # the config as written: the choice is the plan's
    assert "sp 1 [auto: no CUDA device to size the rows against]" in next(l for l in lines if l.startswith("training"))
    with pytest.raises(ConfigError, match="sp_ulysses_size=2 needs a fixed sequence_parallel_size"):
        _config(tmp_path, "auto_u", sequence_parallel_size="auto", sp_ulysses_size=2).validate()
