"""Expert parallelism (`expert_parallel_size: N`): each MoE layer's routed experts split over the N ranks of an
expert-parallel group (train/distributed.py), dropless, computing exactly what transformers' experts module computes.

Which module is swapped: the family table (train/families.py, `FamilySpec.experts`) names where the experts live in
each MoE decoder layer; there transformers has its experts module (a `use_experts_implementation` class: 3-D
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], or transposed, optional biases, its `_apply_gate`). The module
keeps its object, names and attributes: its class becomes a subclass of its own class with this module's forward
(as FSDP2's `fully_shard` does), and its 3-D parameters keep the rank's E / N contiguous experts (ep_rank r holds
experts r * E/N .. (r+1) * E/N - 1). The router, shared experts and the rest of the block run as transformers runs
them, on the rank's own tokens.

The forward on a rank's T tokens with top-k routing (`top_k_index`, `top_k_weights` [T, k]):
1. `plan_dispatch`: the T * k (token, slot) pairs sorted by expert (stable), and how many go to each expert;
2. the counts are exchanged (all-to-all of E integers), then the token rows by `all_to_all_single` with uneven
   splits: each owner receives, source rank by source rank, its experts' rows in expert order;
3. `receive_layout` groups the received rows by local expert; `local_experts` runs the experts over them: one
   grouped matrix product per projection (`torch._grouped_mm`, `moe_kernel: grouped_mm`) or one product per expert
   (`loop`); under `tiled_mlp` in tiles of those rows (`tiled_local_experts`: the exchange itself runs once per
   layer, the same number of times on every rank);
4. the outputs return by the reverse all-to-all, and `combine` sums each token's k outputs times their routing
   weights (transformers' loop adds them expert by expert: the same terms, summed in another order).
Backward runs through the same exchanges (`AllToAll`: the backward of an all-to-all is the reverse all-to-all). No
capacity: every pair is computed, as without EP.

Gradients (train/engines/build.py): an expert's gradient on its owner already holds every token of the ep group that
chose it; it is summed over the edp group (the ranks holding the same experts), a replicated weight's over the world.
Export: `gather_expert_state` puts the parts back together, so final/ is the model's own layout with every expert.

`moe_kernel` means the same at every degree (`choose_kernel`, decided here once): at expert_parallel_size 1 the
experts run as transformers' own experts module, and `set_experts_kernel` sets its `experts_implementation` from it
(grouped_mm -> grouped_mm, loop -> eager).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import ConfigError
from train.model.patches.tiled_mlp import TiledForward


# ---------------------------------------------------------------------------------------------- the pure pieces
def plan_dispatch(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, per_expert): the (token, slot) pairs of `top_k_index` [T, k] flattened and sorted by expert (stable,
    so a token's pairs keep their token order within an expert): pair p = token p // k, slot p % k; and the number of
    pairs per expert [E] (int64)."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts)


def receive_layout(received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`received` [N, L]: rows received from source rank n for local expert l, arriving source by source, each
    source's rows in expert order. Returns (perm, per_local_expert): `rows[perm]` groups them by local expert (stable:
    source order within an expert), and the rows of each local expert [L]."""
    n_sources, n_local = received.shape
    local_ids = torch.repeat_interleave(torch.arange(n_local, device=received.device).repeat(n_sources),
                                        received.reshape(-1))
    return torch.argsort(local_ids, stable=True), received.sum(dim=0)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def combine(returned: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The tokens' outputs [T, H] from the expert outputs of their pairs in `order` (plan_dispatch) order: each
    token's k outputs times their routing weights, summed."""
    tokens, k = top_k_weights.shape
    slots = returned[inverse_permutation(order)].reshape(tokens, k, -1)
    return (slots * top_k_weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: torch._grouped_mm's backward fails on a gradient with
    zero strides (an expanded one, e.g. from a sum)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class _ExpertBias(torch.autograd.Function):
    """`out + bias[expert_ids]` whose bias gradient sums each expert's rows in one product (accumulated in fp32)
    instead of indexing's backward, which adds row after row in the gradient's dtype: in bf16 an expert's thousand
    rows summed one by one lose several percent (the loop's `y + bias[e]` reduces with fp32 accumulation)."""

    @staticmethod
    def forward(ctx, out, bias, expert_ids):
        ctx.save_for_backward(expert_ids)
        ctx.num_experts = bias.shape[0]
        return out + bias[expert_ids]

    @staticmethod
    def backward(ctx, grad):
        (expert_ids,) = ctx.saved_tensors
        grad_bias = None
        if ctx.needs_input_grad[1]:
            rows = torch.arange(ctx.num_experts, device=grad.device)[:, None] == expert_ids[None, :]
            grad_bias = rows.to(grad.dtype) @ grad
        return grad, grad_bias, None


def _grouped_linear(x, weight, bias, offsets, expert_ids, transposed: bool, kernel: str) -> torch.Tensor:
    """x [S, in] grouped by expert (`offsets`: int32 cumulative row ends, `expert_ids`: each row's expert) through
    each expert's weight [L, out, in] (`transposed`: [L, in, out]) and bias [L, out]."""
    if kernel == "grouped_mm":
        w = weight if transposed else weight.transpose(-2, -1)
        out = _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w, offs=offsets))
        return out if bias is None else _ExpertBias.apply(out, bias, expert_ids)
    pieces, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            rows = x[start:end]
            w = weight[expert]
            y = rows @ w if transposed else F.linear(rows, w)
            pieces.append(y if bias is None else y + bias[expert])
        start = end
    out_features = weight.shape[-1] if transposed else weight.shape[-2]
    return torch.cat(pieces) if pieces else x.new_zeros(0, out_features)


def local_experts(experts: torch.nn.Module, x: torch.Tensor, per_expert: torch.Tensor, kernel: str) -> torch.Tensor:
    """transformers' per-expert function of the experts module `experts` (its layout flags, its `_apply_gate`) on
    rows `x` grouped by its (local) experts, `per_expert` rows each: the unweighted expert outputs."""
    offsets = torch.cumsum(per_expert, dim=0).to(torch.int32)
    expert_ids = torch.repeat_interleave(torch.arange(per_expert.numel(), device=x.device), per_expert)
    transposed, has_bias = experts.is_transposed, experts.has_bias
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
    cast = (lambda t: t.to(dtype)) if dtype is not None and kernel == "grouped_mm" else (lambda t: t)

    def param(name):
        return cast(getattr(experts, name)) if name is not None else None

    first = "gate_up_proj" if experts.has_gate else "up_proj"
    h = _grouped_linear(cast(x), param(first), param(f"{first}_bias" if has_bias else None), offsets, expert_ids,
                        transposed, kernel)
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    y = _grouped_linear(cast(h), param("down_proj"), param("down_proj_bias" if has_bias else None), offsets,
                        expert_ids, transposed, kernel)
    if getattr(experts, "has_post_expert_norm", False):
        y = experts.post_expert_norm(y)
    return y


def tiled_local_experts(experts: torch.nn.Module, x: torch.Tensor, per_expert: torch.Tensor, kernel: str,
                        tile: int | None) -> torch.Tensor:
    """`local_experts` over the rows `x` in tiles of `tile` rows (None: whole), forward and backward
    (train/model/patches/tiled_mlp.py's TiledCall: a tile's [rows x intermediate] activations recomputed in backward):
    `tiled_mlp` under expert parallelism. The rows are grouped by expert, so a tile's rows are too: its per-expert
    counts are those of its slice of each row's expert. Each row's output depends on that row alone: the same maths
    as one call."""
    if tile is None or x.shape[0] <= tile:
        return local_experts(experts, x, per_expert, kernel)
    from train.model.patches.tiled_mlp import TiledCall

    expert_ids = torch.repeat_interleave(torch.arange(per_expert.numel(), device=x.device), per_expert)

    def run(rows, ids):
        return local_experts(experts, rows, torch.bincount(ids, minlength=per_expert.numel()), kernel)

    params = [p for p in experts.parameters() if p.requires_grad]
    return TiledCall.apply(run, tile, 2, x, expert_ids, *params)


# ---------------------------------------------------------------------------------------------- the exchange
class AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with uneven splits (rows); backward: the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def exchange_counts(per_expert: torch.Tensor, group) -> torch.Tensor:
    """Each rank's pairs per expert [E] -> the pairs this rank receives [N, L] (from each source, per local expert)."""
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert.contiguous(), group=group)
    return received.reshape(dist.get_world_size(group), -1)


# ---------------------------------------------------------------------------------------------- the module
@dataclass
class ExpertParallelState:
    group: dist.ProcessGroup
    size: int  # N
    rank: int  # this rank's part
    num_experts: int  # E, over the group
    kernel: str  # grouped_mm | loop
    tile: int | None = None  # tiled_mlp: the tile in tokens (the local experts run in tiles of tile x top-k pairs)

    @property
    def local(self) -> int:
        return self.num_experts // self.size


class ExpertParallelExperts:
    """Mixed into transformers' experts class (see `shard_experts`): the forward of the module docstring."""

    _ep: ExpertParallelState

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        ep = self._ep
        k = top_k_index.shape[-1]
        order, per_expert = plan_dispatch(top_k_index, ep.num_experts)
        received = exchange_counts(per_expert, ep.group)  # [N, L]
        send_splits = per_expert.reshape(ep.size, ep.local).sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
        rows = AllToAll.apply(hidden_states[order // k], recv_splits, send_splits, ep.group)
        perm, per_local = receive_layout(received)
        tile = None if ep.tile is None else ep.tile * k  # the pairs of `tile` tokens: the memory plan's tile
        out = tiled_local_experts(self, rows[perm], per_local, ep.kernel, tile)[inverse_permutation(perm)]
        returned = AllToAll.apply(out, send_splits, recv_splits, ep.group)
        return combine(returned, order, top_k_weights).to(hidden_states.dtype)


def _class_with(mixin: type, cls: type) -> type:
    """`cls` with `mixin`'s methods first (one class per pair)."""
    cached = _CLASSES.get((mixin, cls))
    if cached is None:
        cached = _CLASSES[(mixin, cls)] = type(f"{mixin.__name__.removesuffix('Experts')}{cls.__name__}",
                                               (mixin, cls), {"__module__": __name__})
    return cached


def _expert_parallel_class(cls: type) -> type:
    return _class_with(ExpertParallelExperts, cls)


_CLASSES: dict[tuple[type, type], type] = {}


def expert_parameter_names(experts: torch.nn.Module, num_experts: int) -> list[str]:
    """The experts module's own parameters with one slice per expert (first dimension num_experts)."""
    return [name for name, p in experts.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == num_experts]


def keep_part(experts: torch.nn.Module, names: list[str], first: int, count: int) -> None:
    """Replace the expert parameters `names` of `experts` by their experts first .. first + count - 1 (new
    parameters, marked for the engine's edp reduction)."""
    for name in names:
        full = getattr(experts, name)
        part = torch.nn.Parameter(full.detach()[first:first + count].clone(), requires_grad=full.requires_grad)
        part._expert_parallel = True
        setattr(experts, name, part)


def grouped_mm_problem(experts: torch.nn.Module, names: list[str]) -> str | None:
    """Why torch._grouped_mm cannot run this module's experts here (None: it can)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm"
    if not names:
        return f"{type(experts).__name__} has no 3-D expert weights for it"
    weight = getattr(experts, names[0])
    if weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) < (8, 0):
        return "torch._grouped_mm needs a GPU of compute capability 8.0 or newer"
    for name in names:  # every row of its operands starts on a 16-byte boundary
        p = getattr(experts, name)
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 loading partitioned: the whole tensor's shape
        if len(shape) == 3 and any(d * p.element_size() % 16 for d in shape[1:]):
            return (f"torch._grouped_mm needs 16-byte aligned rows: {name} has shape {tuple(shape[1:])} per expert "
                    f"in {p.dtype}")
    return None


def choose_kernel(experts: torch.nn.Module, names: list[str], kernel: str) -> str:
    """`moe_kernel` (auto | grouped_mm | loop) -> the kernel the experts run (grouped_mm | loop), at every
    expert_parallel_size: auto is grouped_mm where it runs on this module's weights (`grouped_mm_problem`), else
    loop; grouped_mm where it cannot run is a ConfigError naming why."""
    problem = grouped_mm_problem(experts, names)
    if kernel == "grouped_mm" and problem:
        raise ConfigError(f"moe_kernel=grouped_mm: {problem}; use moe_kernel=auto or loop")
    return kernel if kernel != "auto" else ("loop" if problem else "grouped_mm")


# moe_kernel's kernel -> the transformers `experts_implementation` running it (expert_parallel_size 1)
EXPERTS_IMPLEMENTATION = {"grouped_mm": "grouped_mm", "loop": "eager"}


def experts_modules(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' experts modules of `lm` (`use_experts_implementation` classes: the decorator sets `has_gate` on
    the instance; peft's wrappers around one are not counted), in module order."""
    return [m for m in lm.modules() if "has_gate" in vars(m) and "is_transposed" in vars(m)]


def set_experts_kernel(lm: torch.nn.Module, model_config, kernel: str) -> dict | None:
    """expert_parallel_size 1: the experts run as transformers' own experts module, whose kernel is the model's
    `experts_implementation`; set it from `moe_kernel` (`choose_kernel`: loop -> eager, grouped_mm -> grouped_mm).
    Returns what the start line says ({"layers", "kernel", "implementation"}), None for a model without transformers'
    experts modules (dense, or experts as a list of linear layers: moe_kernel=grouped_mm is then a ConfigError)."""
    from train.config.ep_rules import expert_count_keys
    from train.families import text_config

    found = experts_modules(lm)
    if not found:
        text = text_config(model_config)
        if kernel == "grouped_mm" and expert_count_keys(text):
            raise ConfigError(f"moe_kernel=grouped_mm: {getattr(text, 'model_type', 'the model')!r} has no "
                              "transformers experts module (fused 3-D expert weights) for it to run on; use "
                              "moe_kernel=auto or loop")
        return None
    names = [name for name, p in found[0].named_parameters(recurse=False)
             if len(getattr(p, "ds_shape", p.shape)) == 3]  # ZeRO-3 loading partitioned: the whole tensor's shape
    chosen = choose_kernel(found[0], names, kernel)
    implementation = EXPERTS_IMPLEMENTATION[chosen]
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # under peft's LoRA wrapper
    try:
        base.set_experts_implementation(implementation)
    except (ValueError, ImportError) as err:  # transformers will not dispatch grouped_mm for this class
        if kernel == "grouped_mm":
            raise ConfigError(f"moe_kernel=grouped_mm: {type(base).__name__} cannot run experts_implementation="
                              f"grouped_mm ({err}); use moe_kernel=auto or loop") from err
        chosen, implementation = "loop", EXPERTS_IMPLEMENTATION["loop"]
        base.set_experts_implementation(implementation)
    for module in found:  # every experts module reads the config it was built with (a composite: its text config)
        if module.config._experts_implementation != implementation:
            module.config._experts_implementation = implementation
    return {"layers": len(found), "kernel": chosen, "implementation": implementation}


def describe_experts_kernel(info: dict) -> str:
    """The start line's part at expert_parallel_size 1: `experts: grouped_mm (transformers' experts module, ...)`."""
    return (f"experts: {info['kernel']} (transformers' experts module, experts_implementation="
            f"{info['implementation']}, {info['layers']} MoE layers)")


def lora_wrappers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's ParamWrappers around an experts module (LoRA `target_parameters`: one per targeted parameter, nested),
    outermost first."""
    wrappers = []
    while hasattr(module, "parameter_name") and isinstance(getattr(module, "base_layer", None), torch.nn.Module):
        wrappers.append(module)
        module = module.base_layer
    return wrappers


def find_experts(lm: torch.nn.Module, path: str) -> list[torch.nn.Module]:
    """Every decoder layer's experts module at `path` (layers without one: a dense layer; through peft's
    ParamWrappers of LoRA on its parameters)."""
    from train.model.patches.tiled_mlp import decoder_layers

    found = []
    for layer in decoder_layers(lm):
        module = layer
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        wrappers = lora_wrappers(module) if module is not None else []
        module = wrappers[-1].base_layer if wrappers else module
        if module is not None and hasattr(module, "has_gate"):  # transformers' experts module (the decorator's flag)
            module._lora_wrappers = wrappers
            found.append(module)
    return found


class ExpertParallelLora:
    """Mixed into peft's ParamWrapper on an expert-parallel experts module (LoRA `target_parameters`): its adapters
    stay whole on every rank (one B·A per expert of all E: small, replicated, their gradients summed over the world
    like any replicated weight's), and the delta added to the rank's part of the weight is that of its experts."""

    _ep_experts: tuple[int, int]  # (first, count)

    def get_delta_factors(self, adapter_name):
        lhs, rhs, scaling = super().get_delta_factors(adapter_name)
        first, count = self._ep_experts
        return lhs[first:first + count], rhs[first:first + count], scaling

    def get_delta_weight(self, adapter_name, *args, **kwargs):
        first, count = self._ep_experts
        return super().get_delta_weight(adapter_name, *args, **kwargs)[first:first + count]


class _TiledLocalExperts(TiledForward):
    """tiled_mlp's forward of an experts module under expert parallelism: the module's own forward, whole. Tiling
    the tokens would run the block's token exchange once per tile, a different number of times on each rank (each
    has its own number of tokens); instead the exchange runs once and the experts' rows are tiled after it
    (`tiled_local_experts`, the module's `_ep.tile`). Still a TiledForward: the start line counts the module."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def _exchange_once(experts: torch.nn.Module) -> int | None:
    """The tile of tiled_mlp's forward on `experts` (train/model/patches/tiled_mlp.py), now a `_TiledLocalExperts`
    over the expert-parallel forward; None when it is not tiled."""
    tiled = experts.__dict__.get("forward")
    if not isinstance(tiled, TiledForward):
        return None
    experts.forward = _TiledLocalExperts(experts, type(experts).forward.__get__(experts), tiled.tile)
    return tiled.tile


def shard_experts(lm: torch.nn.Module, path: str, ep_size: int, ep_rank: int, group, kernel: str) -> dict:
    """Swap every MoE layer's experts module (at `path` in its decoder layer) for its expert-parallel form holding
    this rank's experts. Returns what the start line says: {"layers", "num_experts", "local", "kernel"}."""
    found = find_experts(lm, path)
    if not found:
        raise ConfigError(f"expert_parallel_size={ep_size}: the model has no experts module at `{path}` of its decoder "
                          "layers; set expert_parallel_size=1")
    chosen = None
    for experts in found:
        num_experts = experts.num_experts
        local = num_experts // ep_size
        names = expert_parameter_names(experts, num_experts)
        if chosen is None:
            chosen = choose_kernel(experts, names, kernel)
        keep_part(experts, names, ep_rank * local, local)
        experts.__class__ = _expert_parallel_class(type(experts))
        experts._ep = ExpertParallelState(group, ep_size, ep_rank, num_experts, chosen, _exchange_once(experts))
        for wrapper in experts.__dict__.pop("_lora_wrappers", []):
            wrapper.__class__ = _class_with(ExpertParallelLora, type(wrapper))
            wrapper._ep_experts = (ep_rank * local, local)
        experts.num_experts = local  # what the module holds (its forward reads _ep)
    return {"layers": len(found), "num_experts": num_experts, "local": local, "kernel": chosen}


def is_expert_parameter(p: torch.nn.Parameter) -> bool:
    return getattr(p, "_expert_parallel", False)


def describe(info: dict, ep_size: int) -> str:
    """The start line's part: `expert parallel 2: 4 of 8 experts per rank, grouped_mm`."""
    return (f"expert parallel {ep_size}: {info['local']} of {info['num_experts']} experts per rank, {info['kernel']} "
            f"({info['layers']} MoE layers)")


def gather_expert_state(model: torch.nn.Module, state: dict | None, group, is_main: bool) -> dict | None:
    """Collective over the world (every rank gathers from its ep group): `state` (the main rank's state dict of
    `model`, None elsewhere) with every expert parameter whole, the ep group's parts concatenated in rank order."""
    for name, p in model.named_parameters():
        if not is_expert_parameter(p):
            continue
        parts = [torch.empty_like(p.data) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, p.data.contiguous(), group=group)
        if is_main:
            state[name] = torch.cat(parts).cpu()
    return state


def apply_expert_parallel(lm: torch.nn.Module, model_config, mesh, kernel: str) -> dict | None:
    """Shard the experts of `lm` over the mesh's ep group (train/distributed.py) where the family table says they
    live (preflight has checked the family and the counts); None without expert parallelism."""
    from train.families import FAMILIES, text_config

    if mesh.ep_size == 1:
        return None
    text = text_config(model_config)
    spec = FAMILIES[text.model_type].experts
    return shard_experts(lm, spec.path, mesh.ep_size, mesh.ep_rank, mesh.ep_group, kernel)


def apply_experts(lm: torch.nn.Module, model_config, mesh, parallel: int, kernel: str) -> dict | None:
    """The routed experts as the start-up planned them (train/plan/startup.py `ExpertsPlan`): split over `parallel`
    ranks (`apply_expert_parallel`), else transformers' experts module with `moe_kernel` (`set_experts_kernel`).
    Returns what the start line says of them (None: a dense model)."""
    if parallel > 1:
        return apply_expert_parallel(lm, model_config, mesh, kernel)
    return set_experts_kernel(lm, model_config, kernel)
