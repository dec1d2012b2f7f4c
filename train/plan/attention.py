"""One attention plan per run: how a row splits over the sequence-parallel ranks, which kernel each kind of layer
runs, and which of the model's attention features each path honours, decided once at start; the model's attention
then calls the callables the plan chose (train/attention/function.py `LayerKernels`), and nothing is chosen again per
micro-batch or per layer.

Two steps, because the mesh depends on the first:
1. `plan_sp_layout(parallel, launch, model_config, sp_size)`, before the mesh (train/plan/layout.py): the Ulysses degree of the sp groups
   (`choose_sp_layout`, by the config, the model's heads and the processes per machine; the rules are
   train/config/sp_rules.py's), and the refusal of model features no SP path honours (recurrent mixers, length-dependent
   ropes);
2. `plan_attention(model, parallel, layout, mesh, lm, structure)` (the config's sections), once the model is
   built: the kinds of attention layer (their AttentionFeatures, read from the attention modules) and, per kind,
   the packed backend (`choose_backend`: `attn_backend`, or `auto`'s first of train/attention/function.py's BACKENDS that
   can run it), then what a training micro-batch runs: that backend; the Parallel-R1 mask (structure data); a
   gather / ring backend over the sp group (`choose_ring_backend`, train/attention/sequence_parallel.py; for `torch` its
   varlen kernel per kind, `choose_varlen_kernel`); or Ulysses (train/attention/ulysses.py) around the packed backend or
   around the ring. A feature a path cannot honour (a window under ring-flash-attn, sinks under the Parallel-R1
   mask...) stops the run here.
`AttentionPlan.context(batch)` builds each micro-batch's AttentionContext (sharded under SP) with the chosen
kernels; `describe()` is the start line.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from common.config import ConfigError
from train.attention.function import BACKENDS, STRUCTURED_FLEX, STRUCTURED_SDPA, AttentionBackend, AttentionContext, Kernel
from train.attention.function import backend_problem
from train.attention.function import LayerKernels, layer_features
from train.config.backend_names import AUTO, LLAMA3, TORCH, ULYSSES
from train.model.composite import is_composite, text_decoder_of
from train.config.sections import LaunchSection, ModelSection, ParallelSection
from train.distributed import Mesh, ranks_per_machine
from train.model.patches.recurrent import sequence_parallel_problem as recurrent_sp_problem
from train.model.patches.rope import sequence_parallel_problem as rope_sp_problem
from train.attention.sequence_parallel import SP_BACKENDS, STRUCTURE_FIELDS, SPBackendUnavailable, shard_batch
from train.config.sp_rules import allowed_degrees, heads_problem, kv_heads_after_repeat, placement_problem
from train.config.sp_rules import TREE_SP_REFUSAL, ulysses_size_problem
from train.attention.structured import structure_feature_problems
from train.attention.ulysses import UlyssesSpec, ulysses_attention, ulysses_shard
from train.attention.varlen_kernels import KERNELS, NO_FEATURES, AttentionFeatures, VarlenKernel
from train.row import queued_copy
from train.steps.batch import MicroBatch
from data.shards.dataset import Structure


# ---------------------------------------------------------------------------------------------- 1. the SP layout
@dataclass(frozen=True)
class SPLayout:
    """How an sp group of `sp_size` ranks splits: Ulysses groups of `ulysses_size` (1: no Ulysses) times
    `sp_size // ulysses_size` ranks of the gather / ring backend; `reason` says why."""

    sp_size: int
    ulysses_size: int
    reason: str

    @property
    def ring_size(self) -> int:
        return self.sp_size // self.ulysses_size

    def describe(self, ring_backend: str | None) -> str:
        """e.g. 'ulysses 4', 'hybrid ulysses 2 x torch 2', 'torch 4' (`ring_backend`: the gather / ring backend)."""
        if self.ring_size == 1:
            return f"ulysses {self.ulysses_size}"
        if self.ulysses_size == 1:
            return f"{ring_backend} {self.ring_size}"
        return f"hybrid ulysses {self.ulysses_size} x {ring_backend} {self.ring_size}"


def choose_sp_layout(sp_backend: str, sp_size: int, ulysses_size: int | None, n_heads: int, n_kv_heads: int,
                     processes_per_machine: int) -> SPLayout:
    """The Ulysses degree of an sp group, from the config (`sp_backend`, `sp_ulysses_size`), the model's heads and
    the processes per machine. Raises ConfigError naming the numbers and the alternatives when the config asks for
    what the heads or the placement do not allow.

    - `sp_ulysses_size` set: that degree (1: no Ulysses; < sp: the hybrid);
    - `sp_backend: ulysses`: pure Ulysses (degree sp);
    - `sp_backend: auto`: the largest degree the heads allow that fits one machine: pure Ulysses when that is sp,
      the hybrid when it is smaller, no Ulysses (gather / ring) when the heads allow none;
    - `torch` / `llama3` / `zigzag`: no Ulysses."""
    if problem := (ulysses_size_problem(sp_backend, sp_size, ulysses_size)
                   or placement_problem(sp_backend, sp_size, ulysses_size, processes_per_machine)):
        raise ConfigError(problem)
    heads = f"{n_heads} heads / {n_kv_heads} kv heads"
    allowed = allowed_degrees(n_heads, n_kv_heads, sp_size)
    alternatives = (f"degrees these heads allow for sequence_parallel_size={sp_size}: "
                    f"{allowed or 'none'}; alternatives: sp_ulysses_size=<one of those> (the hybrid when smaller "
                    f"than {sp_size}) or sp_backend=torch (all-gathered K/V, any head count)")
    if ulysses_size is not None:
        if ulysses_size == 1:
            return SPLayout(sp_size, 1, "sp_ulysses_size=1: no Ulysses")
        if problem := heads_problem(n_heads, n_kv_heads, ulysses_size):
            raise ConfigError(f"sp_ulysses_size={ulysses_size}: {problem}; {alternatives}")
        return SPLayout(sp_size, ulysses_size, f"sp_ulysses_size={ulysses_size} set ({heads})")
    if sp_backend == ULYSSES:
        if problem := heads_problem(n_heads, n_kv_heads, sp_size):
            raise ConfigError(f"sp_backend=ulysses with sequence_parallel_size={sp_size}: {problem}; {alternatives}")
        return SPLayout(sp_size, sp_size, f"sp_backend=ulysses ({heads})")
    if sp_backend != AUTO:
        return SPLayout(sp_size, 1, f"sp_backend={sp_backend} set")
    fitting = [d for d in allowed if processes_per_machine % d == 0]
    if not fitting:
        why = (f"no Ulysses degree > 1 of {sp_size} splits {heads}" if not allowed else
               f"no Ulysses degree of {sp_size} allowed by {heads} ({allowed}) divides the "
               f"{processes_per_machine} processes per machine")
        return SPLayout(sp_size, 1, f"auto: {why}")
    degree = fitting[-1]
    repeat = kv_heads_after_repeat(n_kv_heads, degree)
    kv = f", kv heads repeated to {repeat}" if repeat != n_kv_heads else ""
    if degree == sp_size:
        return SPLayout(sp_size, degree, f"auto: {heads} split over {degree} ranks{kv}; the group fits one machine "
                                         f"({processes_per_machine} processes)")
    limit = ("the largest degree the heads allow" if degree == allowed[-1]
             else f"the largest degree fitting one machine ({processes_per_machine} processes)")
    return SPLayout(sp_size, degree, f"auto: Ulysses over {degree} ranks ({heads}{kv}; {limit}) x "
                                     f"{sp_size // degree} groups")


def plan_sp_layout(parallel: ParallelSection, launch: LaunchSection, model_config, sp_size: int) -> SPLayout | None:
    """The split of an sp group of `sp_size` ranks (None without sequence parallelism), from the model config read at
    start: its heads, and the features no SP path honours; the processes per machine are the launcher's
    LOCAL_WORLD_SIZE, else the config's launch section."""
    if sp_size == 1:
        return None
    if problem := rope_sp_problem(model_config.get_text_config()) or recurrent_sp_problem(model_config):
        raise ConfigError(problem)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    n_heads = text.num_attention_heads
    n_kv_heads = getattr(text, "num_key_value_heads", None) or n_heads
    per_machine = ranks_per_machine(launch.processes_per_machine)
    return choose_sp_layout(parallel.sp_backend, sp_size, parallel.sp_ulysses_size, n_heads, n_kv_heads, per_machine)


# ---------------------------------------------------------------------------------------------- 2. the choices
def choose_backend(requested: str, query: torch.Tensor, features: AttentionFeatures = NO_FEATURES
                   ) -> AttentionBackend:
    """The packed backend of a kind of layer: `auto`, the first exact backend of BACKENDS with no reasons; a name,
    that backend, or its reasons raised. Only the device, dtype and the layer's features matter, so an empty
    `query` of the training device and dtype will do."""
    if requested == AUTO:
        for backend in BACKENDS.values():
            if backend.exact and not backend.reasons(query, features):
                return backend
        raise ConfigError("no attention backend can run here: " + "; ".join(
            f"{name}: {', '.join(backend.reasons(query, features))}" for name, backend in BACKENDS.items()))
    if requested not in BACKENDS:
        raise ValueError(f"attn_backend must be one of {[AUTO, *BACKENDS]}, got {requested!r}")
    problem = backend_problem(requested, query, features)
    if problem:
        raise ConfigError(problem)
    return BACKENDS[requested]


def choose_ring_backend(requested: str, structure: bool, half_precision: bool) -> str:
    """The gather / ring backend of sequence parallelism (without Ulysses, or across the Ulysses groups of the
    hybrid, where `ulysses` asks for it as `auto` does): `auto`, llama3 (ring-flash-attn) when it can run, else
    torch. Structure (Parallel-R1) data needs the mask of `torch`, which `auto` then picks; an explicit flash backend
    is a config error there, and one that cannot run raises its reason."""
    if requested in (AUTO, ULYSSES):
        if structure or SP_BACKENDS[LLAMA3].reasons(half_precision):
            return TORCH
        return LLAMA3
    if structure and requested != TORCH:
        raise ConfigError(f"sp_backend={requested!r} runs causal flash kernels only; the data has structure ids "
                          "(Parallel-R1 mask): use sp_backend=torch or auto")
    if reasons := SP_BACKENDS[requested].reasons(half_precision):
        raise SPBackendUnavailable("; ".join(reasons))
    return requested


def choose_varlen_kernel(query: torch.Tensor, features: AttentionFeatures = NO_FEATURES) -> VarlenKernel:
    """The varlen kernel of the `torch` gather backend for a kind of layer: the first of KERNELS (fastest first)
    with no reasons; `sdpa_loop` always qualifies."""
    return next(kernel for kernel in KERNELS.values() if not kernel.reasons(query, features))


def layer_kinds(lm: torch.nn.Module) -> tuple[tuple[AttentionFeatures, int], ...]:
    """The kinds of attention layer of `lm` (features without dropout: `AttentionFeatures.layer_kind`), each with
    the largest dropout of its layers and how many layers it has, in order of first appearance."""
    found = layer_features(lm)
    counts = Counter(features.layer_kind for features in found)
    dropout: dict[AttentionFeatures, float] = {}
    for features in found:
        dropout[features.layer_kind] = max(dropout.get(features.layer_kind, 0.0), features.dropout)
    return tuple((AttentionFeatures(dropout[kind], kind.sliding_window, kind.softcap, kind.has_sinks), counts[kind])
                 for kind in dropout)


def packed_kernels(requested: str, query: torch.Tensor, kinds) -> LayerKernels:
    """The packed backend of every kind of layer (`kinds`: AttentionFeatures, with their training dropout): a
    named backend runs every layer once it can run each kind; `auto` chooses per kind."""
    chosen = [(features, choose_backend(requested, query, features)) for features in kinds]
    if requested != AUTO:
        return LayerKernels(every=BACKENDS[requested])
    return LayerKernels(tuple((features.layer_kind, backend) for features, backend in chosen))


@dataclass(frozen=True)
class _Sharded:
    """A gather / ring backend as a Kernel's fn: it attends over the micro-batch's SPContext (`ctx.sp`)."""

    attention: Callable[..., torch.Tensor]
    varlen: VarlenKernel | None  # the kernel of the `torch` contiguous path

    def __call__(self, query, key, value, ctx: AttentionContext, scaling, features, sinks) -> torch.Tensor:
        sp = ctx.sp
        if query.shape[0] != 1 or query.shape[2] != sp.local_length:
            raise ValueError(f"sequence-parallel attention: query {tuple(query.shape)}, but the SPContext shards "
                             f"{sp.local_length} tokens of one row; feed the model the local batch of the plan")
        return self.attention(query, key, value, sp, scaling, features, sinks, self.varlen)


def ring_kernel(name: str, query: torch.Tensor, features: AttentionFeatures, structure: bool) -> Kernel:
    """What a kind of layer runs under the gather / ring backend `name`."""
    varlen = None
    if name == TORCH and not structure:
        varlen = choose_varlen_kernel(query, features)
        label = f"all-gathered K/V, one {varlen.name} varlen call"
    elif name == TORCH:
        label = "all-gathered K/V, SDPA with the Parallel-R1 mask"
    else:
        label = f"{name} ring (ring-flash-attn)"
    return Kernel(label, _Sharded(SP_BACKENDS[name].attention, varlen))




# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class AttentionPlan:
    """What every attention layer of the run runs, decided once at start (`plan_attention`)."""

    kinds: tuple[tuple[AttentionFeatures, int], ...]  # the model's kinds of attention layer and their layer counts
    packed: LayerKernels  # per kind, the packed backend (no SP; pure Ulysses' local attention; the self-check)
    train: LayerKernels  # per kind, what a training micro-batch runs
    requested: str  # attn_backend of the config
    structure: Structure  # the data's: Parallel-R1's or a tree's mask (train/attention/structured.py)
    layout: SPLayout | None  # None: no sequence parallelism
    ring_backend: str | None  # the gather / ring backend (SP without Ulysses, or across the Ulysses groups)
    ulysses: UlyssesSpec | None  # the Ulysses groups and their local kernels
    mesh: Mesh

    def context(self, batch: MicroBatch) -> tuple[MicroBatch, AttentionContext]:
        """This rank's part of a full micro-batch (train/steps/batch.py `make_batch`) and its AttentionContext on the
        mesh's device: the varlen bounds (and structure ids) go to the device once here, never inside a layer;
        under sequence parallelism the row is sharded first (`shard_batch`, `ulysses_shard`)."""
        device, mesh = self.mesh.device, self.mesh
        if self.layout is None:
            structure = {}
            if self.structure is not Structure.NONE:
                structure = {k: queued_copy(getattr(batch, k), device) for k in STRUCTURE_FIELDS}
            if self.structure is Structure.TREE:  # stepwise trees (data/shards/prefix_tree.py)
                structure["tree_spans"] = queued_copy(batch.tree_spans, device)
            return batch, AttentionContext.for_micro_batch(batch.cu_seqlens, device, self.train, **structure)
        if self.structure is Structure.TREE:  # refused at start (train/plan/startup.py); a direct caller too
            raise ValueError(TREE_SP_REFUSAL)
        if self.ulysses is not None:
            fields, sp = ulysses_shard(batch, mesh.sp_rank, mesh.sp_size, self.ulysses, group=mesh.sp_group)
        else:
            fields, sp = shard_batch(batch, mesh.sp_rank, mesh.sp_size, self.ring_backend, group=mesh.sp_group)
        sp = sp.to(device)
        return batch.local(fields), AttentionContext(sp.cu_seqlens.to(device), sp.max_seqlen, self.train, sp=sp)

    def describe(self) -> str:
        """The start line: the SP layout and why, then per kind of layer the kernel and the features it honours."""
        requested = f"attn_backend={self.requested}"
        if self.layout is None:
            return f"attention: {self._per_kind(self.train)} ({requested}); no sequence parallelism"
        layout = f"sequence parallelism {self.layout.describe(self.ring_backend)} ({self.layout.reason})"
        if self.ulysses is None:
            return f"attention: {layout}: {self._per_kind(self.train)}"
        where = "on the whole row" if self.layout.ring_size == 1 else "across the Ulysses groups"
        local = self._per_kind(self.ulysses.local)
        return f"attention: {layout}: all-to-all of heads, then {where} {local}" + (
            f" ({requested})" if self.layout.ring_size == 1 and self.structure is Structure.NONE else "")

    def _per_kind(self, kernels: LayerKernels) -> str:
        if not self.kinds:
            return "no attention layer"
        by_name: dict[str, list[str]] = {}
        for features, count in self.kinds:
            layers = f"{count} layer{'s' if count != 1 else ''}"
            by_name.setdefault(kernels.for_layer(features).name, []).append(
                f"{layers}: {', '.join(features.names()) or 'causal'}")
        return ", ".join(f"{name} on {'; '.join(kinds)}" for name, kinds in by_name.items())


def plan_attention(model: ModelSection, parallel: ParallelSection, layout: SPLayout | None, mesh: Mesh,
                   lm: torch.nn.Module, structure: Structure) -> AttentionPlan:
    """The plan of a run: the config's model and parallel sections, the layout `plan_sp_layout` chose (the mesh was
    built from it), the model (its attention modules) and whether the data carries structure ids. Raises before the
    first step when a named backend cannot run here or a path cannot honour a feature of the model."""
    structured = structure is not Structure.NONE
    dtype = torch.bfloat16 if model.bf16 else torch.float32
    probe = torch.empty((1, 1, 0, 1), device=mesh.device, dtype=dtype)
    kinds = layer_kinds(text_decoder_of(lm) if is_composite(lm.config) else lm)  # a composite's towers: their own
    features = [f for f, _ in kinds]
    packed = packed_kernels(model.attn_backend, probe, features)
    ring = None
    if layout is not None and layout.ring_size > 1:
        ring = choose_ring_backend(parallel.sp_backend, structured, half_precision=model.bf16)
    problems = []
    for f in features:
        if structured:
            problems += structure_feature_problems(f, sequence_parallel=ring is not None)
        if ring is not None:
            problems += SP_BACKENDS[ring].feature_problems(f)
    if problems:
        raise ConfigError("; ".join(dict.fromkeys(problems)))
    local = LayerKernels(every=STRUCTURED_FLEX if mesh.device.type == "cuda" else STRUCTURED_SDPA) if structured \
        else packed
    ulysses = None
    if layout is None:
        train = local
    else:
        ringed = LayerKernels(tuple((f.layer_kind, ring_kernel(ring, probe, f, structured)) for f in features)) \
            if ring is not None else None
        if layout.ulysses_size > 1:
            ulysses = UlyssesSpec(layout.ulysses_size, mesh.ulysses_group, mesh.ring_group, ring or TORCH,
                                  local if ring is None else ringed)
            train = LayerKernels(every=Kernel(f"ulysses {layout.ulysses_size}", ulysses_attention))
        else:
            train = ringed
    return AttentionPlan(kinds, packed, train, model.attn_backend, structure, layout, ring, ulysses, mesh)

