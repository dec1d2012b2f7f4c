"""Activation offload (`activation_offload: true`): the decoder layers' checkpointed inputs wait for backward in
pinned host memory instead of on the GPU.

With activation checkpointing a layer keeps only its inputs for backward; torch's non-reentrant checkpoint saves them
through the saved-tensor hooks active around the checkpoint call (what runs inside the layer is saved by the
checkpoint's own hooks). `HostOffload.install(lm)` wraps each decoder layer's `_gradient_checkpointing_func`
(transformers' per-layer checkpoint function) in those hooks, so exactly the checkpointed inputs move:
- pack (forward): a device tensor is copied into a pinned host buffer on a side stream that waits for the compute
  stream, so the copy overlaps the next layers' compute; the device memory is released when the copy is done
  (`record_stream`);
- unpack (backward, the recomputation of layer i): the buffer comes back to the device (waiting for the copy that
  `_prefetch` started while layer i+1 ran its backward), and layer i-1's copy back starts on the side stream.
On a CPU device there is nothing to move: pack keeps the tensor (`copy_on_cpu=True`, used by the tests, clones
it so the round trip is exercised), and the same hooks and bookkeeping run. Values are copied bit for bit, so
training is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Offloaded:
    """One packed tensor: its host copy (or the tensor itself on the CPU), the device it came from, the event that
    marks its device-to-host copy done, the tensor packed before it (backward's next) and its device copy fetched
    ahead of use."""

    host: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event | None = None
    previous: Offloaded | None = None
    fetched: torch.Tensor | None = None
    fetched_event: torch.cuda.Event | None = None


@dataclass
class HostOffload:
    copy_on_cpu: bool = False
    packed: int = 0  # tensors packed so far (the tests count them)
    stream: torch.cuda.Stream | None = None  # the copies' side stream, made at the first CUDA tensor
    _last: Offloaded | None = None  # the latest packed tensor: the next one packed links back to it

    # ------------------------------------------------------------------ hooks
    def pack(self, tensor: torch.Tensor) -> Offloaded:
        if tensor.device.type != "cuda":
            item = Offloaded(tensor.clone() if self.copy_on_cpu else tensor, tensor.device)
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            if self.stream is None:
                self.stream = torch.cuda.Stream(tensor.device)
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)  # its memory returns to the allocator once the copy has run
                copied = self.stream.record_event()
            item = Offloaded(host, tensor.device, copied)
        item.previous, self._last = self._last, item
        self.packed += 1
        return item

    def unpack(self, item: Offloaded) -> torch.Tensor:
        if item is self._last:
            self._last = None  # backward has begun: the next forward starts a new chain
        previous, item.previous = item.previous, None  # the chain holds no buffer past its use
        if item.copied is None:
            return item.host
        current = torch.cuda.current_stream(item.device)
        if item.fetched is None:
            current.wait_event(item.copied)
            tensor = item.host.to(item.device, non_blocking=True)
        else:
            current.wait_event(item.fetched_event)
            tensor, item.fetched = item.fetched, None
            tensor.record_stream(current)  # allocated on the side stream, used on this one
        if previous is not None:
            self._prefetch(previous)
        return tensor

    def _prefetch(self, item: Offloaded) -> None:
        """Start the copy back of `item` on the side stream (backward unpacks it next)."""
        if item.copied is None or item.fetched is not None:
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(item.copied)
            item.fetched = item.host.to(item.device, non_blocking=True)
            item.fetched_event = self.stream.record_event()

    # ------------------------------------------------------------------ wiring
    def checkpoint_through(self, checkpoint_fn):
        """`checkpoint_fn` (a layer's checkpoint function) with the offload hooks around it."""

        def checkpoint_offloaded(function, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return checkpoint_fn(function, *args, **kwargs)

        return checkpoint_offloaded

    def install(self, lm: nn.Module) -> int:
        """Wrap the checkpoint function of every checkpointed layer of `lm`; returns how many. Needs activation
        checkpointing enabled first (ValueError otherwise)."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        if not layers:
            raise ValueError("activation_offload needs activation checkpointing enabled on the model first")
        for layer in layers:
            layer._gradient_checkpointing_func = self.checkpoint_through(layer._gradient_checkpointing_func)
        return len(layers)

