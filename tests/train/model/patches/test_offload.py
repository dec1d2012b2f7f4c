"""Activation offload (train/model/patches/offload.py), a long-row option without sequence parallelism: the decoder
layers' checkpointed inputs wait for backward in host memory, and training stays exactly what activation checkpointing
alone trains (fp32 loss and every gradient, 1e-6 relative to the largest gradient), with the offload hooks seen to pack
every layer's input. The helpers are the tiled MLP's (test_tiled_mlp.py beside this file)."""
from __future__ import annotations

import pytest
import torch

from tests._train_helpers import one_thread  # noqa: F401  (a fixture)
from tests.model_zoo import tiny_config
from tests.train.model.patches.test_tiled_mlp import SDPA_KERNELS, _assert_same, _lm, _loss_and_grads, _row
from train.attention.function import AttentionContext
from train.model.packed import PackedCausalLM
from train.model.patches.offload import HostOffload

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("model_type", ["qwen2", "mixtral"])
def test_offload_equals_checkpointing_alone(model_type):
    config = tiny_config(model_type)
    results, offloads = [], []
    for offloaded in (False, True):
        lm = _lm(config)
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if offloaded:
            offload = HostOffload(copy_on_cpu=True)  # clones: the round trip through the hooks is exercised
            assert offload.install(lm) == config.num_hidden_layers
            offloads.append(offload)
        model = PackedCausalLM(lm, chunk_size=5, num_categories=1)
        results.append(_loss_and_grads(model, [_row(1), _row(2, (13, 3, 8))]))
    _assert_same(results[1], results[0], model_type)
    assert offloads[0].packed == 2 * config.num_hidden_layers  # every layer's input, in both micro-batches
    assert offloads[0]._last is None  # backward unpacked the chain: nothing held until the next forward


@pytest.mark.gpu
def test_offload_on_cuda_moves_the_layer_inputs_to_pinned_host_memory_and_stays_exact():
    """The CUDA path (device-to-host copies on a side stream, copies back prefetched in backward): fp32 loss and
    gradients those of checkpointing alone, and at the end of forward the layer inputs are off the GPU, in pinned
    host buffers."""
    device = torch.device("cuda")
    config = tiny_config("qwen2", num_hidden_layers=6, layer_types=["full_attention"] * 6)
    ids, positions, cu, weights = _row(3, (4096, 6000, 2000, 4288))  # 16,384 tokens: 4 MiB a layer input
    results, after_forward = [], []
    for offloaded in (False, True):
        lm = _lm(config).to(device)
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        offload = HostOffload() if offloaded else None
        if offload is not None:
            assert offload.install(lm) == 6
        model = PackedCausalLM(lm, chunk_size=1024, num_categories=1)
        attn = AttentionContext.for_micro_batch(cu, device, SDPA_KERNELS)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(ids[None].to(device), positions[None].to(device), torch.roll(ids, -1).to(device),
                     weights.to(device), torch.zeros(len(ids), dtype=torch.long, device=device), attn)[0]
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # the allocator takes back the blocks whose copies have finished
        after_forward.append(torch.cuda.memory_allocated() - before)
        if offload is not None:
            assert offload.packed == 6 and offload._last.host.is_pinned() and offload._last.host.device.type == "cpu"
        loss.backward()
        torch.cuda.synchronize()
        results.append((float(loss.detach()), {n: p.grad.cpu() for n, p in model.named_parameters()
                                               if p.grad is not None}))
        if offload is not None:
            assert offload._last is None  # backward unpacked the chain
    _assert_same(results[1], results[0], "qwen2 on CUDA")
    layer_input = len(ids) * config.hidden_size * 4
    assert after_forward[0] - after_forward[1] >= 4 * layer_input, after_forward


def test_offload_needs_checkpointing():
    with pytest.raises(ValueError, match="checkpointing"):
        HostOffload().install(_lm(tiny_config("qwen2")))
