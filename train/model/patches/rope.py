"""Rotary embeddings whose frequencies depend on the sequence length, computed per packed sequence.

transformers' rotary embeddings choose the frequencies of two rope types from the longest position of the call,
`max(position_ids) + 1` (`modeling_rope_utils.dynamic_rope_update`; PhiMoE's forward picks its scale the same way):
- `longrope` (Phi-3 / Phi-3.5 / Phi-4-mini, PhiMoE): the long factors when that length exceeds
  `original_max_position_embeddings`, else the short ones;
- `dynamic` (dynamic NTK): past `max_position_embeddings`, a rope base scaled to that length.
Positions restart at every packed sequence, so on a packed row that length is the row's longest sequence: every
shorter sequence would train with the longest one's frequencies. `install_per_sequence_rope` wraps each such
rotary module (as train/model/patches/recurrent.py wraps recurrent mixers); while a packed row is set, the wrapper gives every
token the rotary embedding its sequence gets alone: the module's own forward on positions 0..n-1, n the length of
the token's sequence, read at the token's position. One call per set of frequencies, not per sequence: longrope
has two (sequences up to the switch point, longer ones), dynamic NTK one up to it and one per longer length
(those lengths are read to the host once per forward).

The state of dynamic NTK: transformers keeps the frequencies of the longest length it has seen (they return to the
original ones only for a call shorter than max_position_embeddings), so what a sequence gets alone depends on
what ran before it. PackSFT gives each sequence what a fresh model gives it, the frequencies of its own length:
the wrapper first calls the module with one position (its reset), then the longer lengths in increasing order
(each grows it to exactly that length). train/model/self_check.py's unpacked reference runs its sequences shortest
first for the same reason.

How the trainer uses it::

    ropes = install_per_sequence_rope(lm)      # once, in PackedCausalLM (empty for other ropes)
    ropes.set_row(attn.bounds)                 # before each packed decoder call
    ropes.clear()                              # the model's own unpacked forward (train/model/self_check.py)

Sequence parallelism gives a rank a slice of each sequence, not its length: `sequence_parallel_problem` refuses
these ropes there before the model loads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from train.attention.function import document_ids
from train.row import Row, RowHolder

LONGROPE = "longrope"


def length_dependent(rope_type) -> bool:
    """transformers' rule (dynamic_rope_update): `longrope`, or any rope type naming `dynamic`."""
    return isinstance(rope_type, str) and (rope_type == LONGROPE or "dynamic" in rope_type)


def length_dependent_ropes(config) -> list[dict]:
    """The rope parameters (the model's, or one per layer type) of the config's length-dependent ropes."""
    params = getattr(config, "rope_parameters", None) or {}
    entries = [params] if "rope_type" in params else params.values()  # else one entry per layer type
    return [entry for entry in entries if isinstance(entry, dict) and length_dependent(entry.get("rope_type"))]


def switch_points(config) -> list[int]:
    """The sequence lengths past which the config's ropes change their frequencies, increasing: longrope's
    `original_max_position_embeddings`, dynamic NTK's `max_position_embeddings` (read from the config, not from
    the wrappers, so that the start-up self-check does not take them from the code it checks)."""
    return sorted({int(entry["original_max_position_embeddings"]) if entry["rope_type"] == LONGROPE
                   else int(config.max_position_embeddings) for entry in length_dependent_ropes(config)})


def sequence_parallel_problem(config) -> str | None:
    """Why sequence parallelism cannot train this config's rope exactly (None: it can)."""
    ropes = length_dependent_ropes(config)
    if not ropes:
        return None
    kinds = ", ".join(sorted({entry["rope_type"] for entry in ropes}))
    return (
        f"sequence_parallel_size > 1 cannot train model_type {getattr(config, 'model_type', None)!r} with "
        f"rope_type {kinds} exactly: its rotary frequencies depend on the length of each sequence, and sequence "
        "parallelism gives each rank only a slice of every sequence. Set sequence_parallel_size=1"
    )


class PerSequenceRope(nn.Module):
    """The rotary module `rope` (a child), computed per packed sequence while a row is set, else as is."""

    def __init__(self, rope: nn.Module, row: RowHolder):
        super().__init__()
        self.rope = rope
        object.__setattr__(self, "row", row)
        # layer type (None: the model's one rope) -> (rope type, switch point: the longest length that keeps the
        # frequencies of short sequences)
        rope_types = rope.rope_type if isinstance(rope.rope_type, dict) else {None: rope.rope_type}
        self.switches = {layer_type: (rope_type, self._switch_point(rope_type, layer_type))
                         for layer_type, rope_type in rope_types.items() if length_dependent(rope_type)}

    def _switch_point(self, rope_type: str, layer_type: str | None) -> int:
        if rope_type == LONGROPE:
            params = self.rope.config.rope_parameters
            return int((params if layer_type is None else params[layer_type])["original_max_position_embeddings"])
        return int(self.rope.original_max_seq_len)  # dynamic NTK: max_position_embeddings

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the wrapped module's attributes (attention_scaling, rope_type, ...)
            if name == "rope" or "rope" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["rope"], name)

    def extra_repr(self) -> str:
        return f"per packed sequence: {self.switches}"

    @torch.no_grad()
    def forward(self, x, position_ids, *args, **kwargs):
        cu_seqlens = None if self.row.row is None else self.row.row.cu_q
        switch = self.switches.get(kwargs.get("layer_type", args[0] if args else None))
        if cu_seqlens is None or switch is None:
            return self.rope(x, position_ids, *args, **kwargs)
        if position_ids.ndim != 2 or position_ids.shape[0] != 1:
            raise ValueError(f"{type(self.rope).__name__} per packed sequence: position_ids must be [1, T], got "
                             f"{tuple(position_ids.shape)}")
        rope_type, switch_point = switch
        positions = position_ids[0]
        total = positions.shape[0]
        lengths = sequence_lengths(positions, cu_seqlens)

        def alone(n: int):  # the module's rotary embedding of a sequence of n tokens alone
            return self.rope(x, torch.arange(n, device=positions.device)[None], *args, **kwargs)

        if rope_type == LONGROPE:
            short = _at(alone(min(total, switch_point)), positions)
            return _where(lengths > switch_point, _at(alone(max(total, switch_point + 1)), positions), short)
        alone(1)  # dynamic NTK: back to the original frequencies (transformers resets below its switch point)
        out = _at(alone(min(total, switch_point)), positions)
        for n in torch.unique(lengths[lengths > switch_point]).tolist():  # increasing: each call grows to n
            out = _where(lengths == n, _at(alone(n), positions), out)
        return out


def sequence_lengths(positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T]: for every token, the largest position of its packed sequence + 1 (its length as transformers' rope
    sees it: `max(position_ids) + 1` of the sequence alone), on the device, without a host sync."""
    total = positions.shape[0]
    sequence = document_ids(cu_seqlens.to(positions.device), total).long()
    top = torch.zeros(cu_seqlens.shape[0] - 1, dtype=positions.dtype, device=positions.device)
    top = top.scatter_reduce(0, sequence, positions, "amax", include_self=False)
    return top[sequence] + 1


def _at(table, positions: torch.Tensor):
    """A rotary module's output for positions 0..n-1 ([1, n, ...] tensors: cos and sin, or complex frequencies)
    read at `positions` (clamped to the table: tokens past it are replaced by `_where`)."""
    if isinstance(table, (tuple, list)):
        return type(table)(_at(t, positions) for t in table)
    return table[:, positions.clamp(max=table.shape[1] - 1)]


def _where(mask: torch.Tensor, chosen, other):
    if isinstance(chosen, (tuple, list)):
        return type(chosen)(_where(mask, a, b) for a, b in zip(chosen, other))
    return torch.where(mask.view(1, -1, *[1] * (chosen.ndim - 2)), chosen, other)


@dataclass
class PerSequenceRopes:
    """The wrappers `install_per_sequence_rope` put into a model (empty for a model without such ropes)."""

    row: RowHolder = field(default_factory=RowHolder)
    wrapped: dict[str, PerSequenceRope] = field(default_factory=dict)  # module name -> wrapper

    def __bool__(self) -> bool:
        return bool(self.wrapped)

    def set_row(self, row: Row | None) -> None:
        """The packed row of the next forward (`AttentionContext.bounds`; it stays set until replaced or cleared)."""
        if row is None:
            raise ValueError("length-dependent ropes (train/model/patches/rope.py) cannot run under sequence parallelism: a rank "
                             "holds a slice of each sequence, not its length")
        self.row.row = row

    def clear(self) -> None:
        """Back to transformers' behaviour (one call covers one unpacked sequence)."""
        self.row.row = None


def install_per_sequence_rope(lm: nn.Module) -> PerSequenceRopes:
    """Wrap every rotary module of `lm` (a causal LM, its body or a PEFT wrapper) whose rope type depends on the
    sequence length (a `rope_type` attribute, or one per layer type, that `length_dependent` accepts) in a
    `PerSequenceRope` sharing one row holder. Idempotent: already wrapped modules join the returned holder."""
    ropes = PerSequenceRopes()
    modules = dict(lm.named_modules())
    for name, module in modules.items():
        if any(name.startswith(wrapped + ".") for wrapped in ropes.wrapped):
            continue
        if isinstance(module, PerSequenceRope):
            object.__setattr__(module, "row", ropes.row)
            ropes.wrapped[name] = module
            continue
        rope_type = getattr(module, "rope_type", None)
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if any(length_dependent(kind) for kind in kinds):
            parent_name, _, child_name = name.rpartition(".")
            wrapper = PerSequenceRope(module, ropes.row)
            setattr(modules[parent_name], child_name, wrapper)
            ropes.wrapped[name] = wrapper
    return ropes
