"""A micro-batch's packed sequences: the one row type the attention kernels, the rope patch and the recurrent mixers
read.

`Row` holds the boundaries [0, l1, l1+l2, ..., T] of the packed sequences of one micro-batch (of this rank's tokens
under sequence parallelism: queries `cu_q`, keys `cu_k`) on the device and on the host, with their longest lengths,
built once per micro-batch (`Row.build`: one host->device copy per tensor), so that no layer syncs the host with the
device; and the index tensors the consumers derive from them, each built once per device and kept:
- the varlen attention kernels (train/attention/varlen_kernels.py): `cu_q`, `cu_k`, `max_q`, `max_k`, the host
  offsets `host_cu_q` / `host_cu_k`;
- the per-sequence rope (train/model/patches/rope.py): `cu_q`;
- the recurrent mixers (train/model/patches/recurrent.py, recurrent_kernels.py): `offsets`, `total`, `count`,
  `seq_idx`, `cu_seqlens` (int64), `chunk_ids`, `conv_indices`.
The micro-batch's `AttentionContext` carries it (`attn.bounds`); `PackedCausalLM.forward` hands it to the model's
patches (`RowHolder`: the one place rope and recurrent wrappers, which transformers calls without our arguments,
read it from).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def queued_copy(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device` without stalling the host: a blocking host→GPU copy synchronizes the stream (waits for
    the previous micro-batch's backward); from pinned memory it is queued and the host builds the next batch."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Row:
    """Boundaries of the packed sequences of one micro-batch, on the device and on the host, and the index tensors
    derived from them (cached per device)."""

    __slots__ = ("cu_q", "cu_k", "max_q", "max_k", "host_cu_q", "host_cu_k", "_cache")

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, host_cu_q: tuple[int, ...],
                 host_cu_k: tuple[int, ...]):
        self.cu_q = cu_q  # int32 [S+1], on the tensors' device
        self.cu_k = cu_k  # int32 [S+1]
        self.max_q = max_q
        self.max_k = max_k
        self.host_cu_q = host_cu_q
        self.host_cu_k = host_cu_k
        self._cache: dict = {}

    @classmethod
    def build(cls, cu_q: list[int] | tuple[int, ...], cu_k=None, device: torch.device | str = "cpu") -> "Row":
        """From host offsets (one host→device copy per tensor; call once per micro-batch, not per layer)."""
        host_q = tuple(int(x) for x in cu_q)
        host_k = host_q if cu_k is None else tuple(int(x) for x in cu_k)
        if len(host_q) != len(host_k) or len(host_q) < 2:
            raise ValueError(f"cu_seqlens_q/k need the same number (>= 2) of offsets, got {len(host_q)}, {len(host_k)}")
        lens_q = [hi - lo for lo, hi in zip(host_q[:-1], host_q[1:])]
        lens_k = [hi - lo for lo, hi in zip(host_k[:-1], host_k[1:])]
        if min(lens_q) < 0 or any(lk < lq for lq, lk in zip(lens_q, lens_k)):
            raise ValueError("every sequence needs at least as many keys as queries (bottom-right causal alignment)")
        cu_q_dev = queued_copy(torch.tensor(host_q, dtype=torch.int32), device)
        cu_k_dev = cu_q_dev if cu_k is None else queued_copy(torch.tensor(host_k, dtype=torch.int32), device)
        return cls(cu_q_dev, cu_k_dev, max(lens_q), max(lens_k), host_q, host_k)

    @classmethod
    def of_device_offsets(cls, cu_seqlens: torch.Tensor) -> "Row":
        """From device offsets (queries = keys): one host read of the tensor."""
        host = tuple(int(x) for x in cu_seqlens.tolist())
        cu = cu_seqlens.to(torch.int32)
        lengths = [hi - lo for lo, hi in zip(host[:-1], host[1:])]
        return cls(cu, cu, max(lengths), max(lengths), host, host)

    def to(self, device: torch.device | str) -> "Row":
        """The same row with its device offsets on `device` (the host ones shared)."""
        return Row(self.cu_q.to(device), self.cu_k.to(device), self.max_q, self.max_k, self.host_cu_q,
                   self.host_cu_k)

    def __repr__(self) -> str:
        return f"Row(host_cu_q={self.host_cu_q}, host_cu_k={self.host_cu_k})"

    # ------------------------------------------------------------------ the recurrent mixers' view (queries' offsets)
    @property
    def offsets(self) -> tuple[int, ...]:
        return self.host_cu_q

    @property
    def total(self) -> int:
        return self.host_cu_q[-1]

    @property
    def count(self) -> int:
        return len(self.host_cu_q) - 1

    def _cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def seq_idx(self, device) -> torch.Tensor:
        """[T] int32: the packed sequence of each token (mamba-ssm's and causal-conv1d's `seq_idx`, batch 1)."""
        def build():
            lengths = torch.tensor(self.offsets[1:]) - torch.tensor(self.offsets[:-1])
            return torch.repeat_interleave(torch.arange(self.count, dtype=torch.int32), lengths).to(device)
        return self._cached(("seq_idx", str(device)), build)

    def cu_seqlens(self, device) -> torch.Tensor:
        """[n + 1] int64 offsets (flash-linear-attention's `cu_seqlens`)."""
        return self._cached(("cu_seqlens", str(device)), lambda: torch.tensor(self.offsets, device=device))

    def chunk_ids(self, chunk_size: int, device) -> torch.Tensor:
        """[chunks, chunk_size]: `seq_idx` cut into chunks, the padding of the last chunk a sequence of its own."""
        def build():
            pad = -self.total % chunk_size
            return F.pad(self.seq_idx(device), (0, pad), value=self.count).view(-1, chunk_size)
        return self._cached(("chunk_ids", chunk_size, str(device)), build)

    def conv_indices(self, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """For a causal convolution of `width` taps: (gather, keep). `gather` [T + n (width - 1)] lays the row out
        with width - 1 zeros before each sequence (index 0: a zero column prepended to the row, t + 1: token t);
        `keep` [T] picks each token's output from an unpadded convolution of that layout."""
        def build():
            seq = self.seq_idx(device).long()
            tokens = torch.arange(self.total, device=device)
            gather = torch.zeros(self.total + self.count * (width - 1), dtype=torch.long, device=device)
            gather[tokens + (seq + 1) * (width - 1)] = tokens + 1
            return gather, tokens + seq * (width - 1)
        return self._cached(("conv", width, str(device)), build)


class RowHolder:
    """The micro-batch's `Row` while packed forwards run (None: plain HF calls), shared by the wrappers one patch
    put into a model (transformers calls them without our arguments, so they read the row here)."""

    __slots__ = ("row",)

    def __init__(self, row: Row | None = None):
        self.row = row
