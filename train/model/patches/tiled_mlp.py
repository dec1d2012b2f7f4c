"""Tiled MLP (`tiled_mlp: true`): each decoder layer's feed-forward runs over the row in tiles of tokens, forward and
backward, so the [tokens x intermediate] activations of a long row never exist at once.

A feed-forward is a function of each token alone, so running it on row slices and concatenating is the same maths.
`TiledCall` (an autograd Function) runs the tiles under no_grad in forward and keeps only its inputs; backward
recomputes one tile at a time with grad enabled and takes that tile's input and parameter gradients with
`torch.autograd.grad`. The parameters are inputs of the Function, so their summed gradients leave it once per layer
through the ordinary graph (one AccumulateGrad per parameter and backward, which is what DeepSpeed ZeRO-1/2's
gradient hooks expect). The RNG state and autocast state of the forward are replayed in backward (dropout in an
adapter stays the same mask).

What is tiled is found from the model's structure (`tiling_plan`): in every decoder layer, its feed-forward child
(`FEED_FORWARD_NAMES`); a dense one is tiled whole; a mixture-of-experts block is not (its router's logits feed the
load-balancing loss of train/model/moe.py, which must see the whole row once and with gradients): only its experts module
(transformers' `use_experts_implementation` modules, forward(hidden_states, top_k_index, top_k_weights), one row
per token) is tiled, so the router, the aux loss and any shared expert run as before. A block with a router and no
such experts module, a feed-forward that mixes tokens (a recurrent mixer of the family's spec) and the families whose
spec says `untileable_mlp` are refused with the reason. The forward is replaced on the instance (`module.forward`):
the module tree and state-dict names stay the model's own, so LoRA targets, checkpoints and exports are unchanged.
"""
from __future__ import annotations

import contextlib
import inspect
import torch
from torch import nn

from train.families import FAMILIES, text_config
from train.model.lm_head import causal_lm_of, decoder_of
from train.model.support import UnsupportedModelError

# a decoder layer's feed-forward child, by the names transformers' decoder layers give it
FEED_FORWARD_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")


def intermediate_size(config) -> int:
    """The feed-forward width a token's tile holds (train.plan.memory.default_tile_tokens): the dense
    `intermediate_size`, else the routed experts' (`moe_intermediate_size` x experts per token), else 4 x hidden."""
    cfg = text_config(config)
    width = getattr(cfg, "intermediate_size", None)
    if isinstance(width, (list, tuple)):
        width = max(width)
    if not isinstance(width, int):
        width = (getattr(cfg, "moe_intermediate_size", None) or 0) * (getattr(cfg, "num_experts_per_tok", None) or 1)
    return width or 4 * cfg.hidden_size


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed(rng: tuple, device: torch.device, autocast: tuple):
    """The forward's RNG and autocast state, without disturbing the caller's RNG streams."""
    cpu_state, cuda_state = rng
    devices = [device] if cuda_state is not None else []
    enabled, dtype = autocast
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        with torch.autocast(device.type, dtype=dtype, enabled=enabled):
            yield


class TiledCall(torch.autograd.Function):
    """run(*tiled[s:e]) over tiles of `tile` rows (dim 0), concatenated; `params`: the tensors run reads that need
    gradients (returned summed over tiles)."""

    @staticmethod
    def forward(ctx, run, tile: int, n_tiled: int, *tensors):
        tiled, params = tensors[:n_tiled], tensors[n_tiled:]
        ctx.run, ctx.tile, ctx.params = run, tile, params
        ctx.save_for_backward(*tiled)
        device = tiled[0].device
        ctx.rng = _rng_state(device)
        ctx.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        rows = tiled[0].shape[0]
        out = None
        for start in range(0, rows, tile):
            piece = run(*(t[start:start + tile] for t in tiled))
            if out is None:
                out = piece.new_empty((rows, *piece.shape[1:]))
            out[start:start + piece.shape[0]] = piece
        return out

    @staticmethod
    def backward(ctx, grad_out):
        tiled, params, tile = ctx.saved_tensors, ctx.params, ctx.tile
        needs = ctx.needs_input_grad[3:]
        tiled_needs, param_needs = needs[:len(tiled)], needs[len(tiled):]
        input_grads = [torch.zeros_like(t) if need else None for t, need in zip(tiled, tiled_needs)]
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        wanted_params = [p for p, need in zip(params, param_needs) if need]
        device = tiled[0].device
        with torch.enable_grad(), _replayed(ctx.rng, device, ctx.autocast):
            for start in range(0, tiled[0].shape[0], tile):
                pieces = [t[start:start + tile].detach().requires_grad_(need) for t, need in zip(tiled, tiled_needs)]
                out = ctx.run(*pieces)
                wrt = [p for p, need in zip(pieces, tiled_needs) if need] + wanted_params
                grads = iter(torch.autograd.grad(out, wrt, grad_out[start:start + out.shape[0]], allow_unused=True))
                for i, need in enumerate(tiled_needs):
                    grad = next(grads) if need else None
                    if grad is not None:
                        input_grads[i][start:start + out.shape[0]] = grad
                for i, need in enumerate(param_needs):
                    grad = next(grads) if need else None
                    if grad is not None:
                        param_grads[i] = grad if param_grads[i] is None else param_grads[i] + grad
        return (None, None, None, *input_grads, *param_grads)


class TiledForward:
    """The replacement of one module's `forward`: its token-wise call split into tiles of `tile` tokens.

    The first argument is the hidden states [..., hidden] (flattened to rows, each tile given back with the input's
    rank: [1, tile, hidden] for [1, T, hidden]); every other tensor argument with as many rows (an experts module's
    top-k indices and weights) is sliced with it; anything else is passed whole."""

    def __init__(self, module: nn.Module, forward, tile: int):
        self.module, self.forward, self.tile = module, forward, tile

    @torch.compiler.disable  # compile_layers: the tiles and their recomputation run eagerly
    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if rows.shape[0] <= self.tile:
            return self.forward(hidden_states, *args, **kwargs)
        leading = (1,) * (hidden_states.dim() - 2)  # a tile keeps the input's rank
        names = list(range(len(args))) + list(kwargs)
        values = list(args) + list(kwargs.values())
        sliced = [i for i, v in enumerate(values)
                  if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == len(rows)]

        def run(piece, *pieces):
            call = list(values)
            for i, p in zip(sliced, pieces):
                call[i] = p
            positional = [v for n, v in zip(names, call) if isinstance(n, int)]
            keywords = {n: v for n, v in zip(names, call) if not isinstance(n, int)}
            out = self.forward(piece.reshape(*leading, -1, piece.shape[-1]), *positional, **keywords)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"tiled_mlp: {type(self.module).__name__}.forward returned {type(out).__name__}, "
                                "not a tensor: it cannot be tiled")
            return out.reshape(-1, *out.shape[len(leading) + 1:])

        params = [p for p in self.module.parameters() if p.requires_grad]
        out = TiledCall.apply(run, self.tile, 1 + len(sliced), rows, *(values[i] for i in sliced), *params)
        return out.reshape(*hidden_states.shape[:-1], *out.shape[1:])


def is_experts_module(module: nn.Module) -> bool:
    """transformers' experts modules (`use_experts_implementation`): forward(hidden_states, top_k_index,
    top_k_weights) with one row per token, whatever the experts implementation."""
    if not hasattr(type(module), "_apply_gate"):
        return False
    parameters = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters)
    return len(parameters) == 4


def _router_classes(lm: nn.Module) -> tuple[type, ...]:
    """The module classes whose outputs the decoder records as router logits (transformers' output recorders)."""
    recorders = getattr(decoder_of(lm), "_can_record_outputs", None) or {}
    target = recorders.get("router_logits")
    targets = target if isinstance(target, (list, tuple)) else [target]
    classes = [getattr(t, "target_class", t) for t in targets if t is not None]
    return tuple(c for c in classes if isinstance(c, type))


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder's repeated layers: its `layers`, else its longest ModuleList child (GPT-2's `h`)."""
    decoder = decoder_of(lm)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    lists = [child for child in decoder.children() if isinstance(child, nn.ModuleList)]
    if not lists:
        raise UnsupportedModelError(f"tiled_mlp: {type(decoder).__name__} has no list of decoder layers")
    return max(lists, key=len)


def tiling_plan(lm: nn.Module) -> dict[str, str]:
    """name -> "dense" | "experts" for every module to tile; UnsupportedModelError naming why a model's
    feed-forward cannot be tiled."""
    config = causal_lm_of(lm).config
    family = getattr(config, "model_type", None)
    spec = FAMILIES.get(family)
    if spec is not None and spec.untileable_mlp:
        raise UnsupportedModelError(f"tiled_mlp: model family {family!r}: {spec.untileable_mlp}; set tiled_mlp=false")
    mixers = set(spec.mixers) if spec is not None else set()
    routers = _router_classes(lm)
    names = {module: name for name, module in lm.named_modules()}
    plan: dict[str, str] = {}
    for layer in decoder_layers(lm):
        feed_forward = next((getattr(layer, n) for n in FEED_FORWARD_NAMES
                             if isinstance(getattr(layer, n, None), nn.Module)), None)
        if feed_forward is None:
            continue  # a layer without a feed-forward (a Mamba layer of a hybrid)
        where = f"{family!r} {names[feed_forward]} ({type(feed_forward).__name__})"
        inside = list(feed_forward.modules())
        if any(type(m).__name__ in mixers for m in inside):
            raise UnsupportedModelError(f"tiled_mlp: {where} mixes tokens (a recurrent mixer): it cannot run in "
                                        "tiles; set tiled_mlp=false")
        experts = [m for m in inside if is_experts_module(m)]
        if experts:
            plan.update({names[m]: "experts" for m in experts})
        elif routers and any(isinstance(m, routers) for m in inside):
            raise UnsupportedModelError(
                f"tiled_mlp: {where} routes tokens to experts without transformers' experts module: its router "
                "would run per tile and the router aux loss would change; set tiled_mlp=false")
        else:
            plan[names[feed_forward]] = "dense"
    if not plan:
        raise UnsupportedModelError(f"tiled_mlp: {family!r} has no decoder-layer feed-forward to tile; set "
                                    "tiled_mlp=false")
    return plan


def install_tiled_mlp(lm: nn.Module, tile: int) -> dict[str, str]:
    """Replace the forward of every module of `tiling_plan(lm)` by its `TiledForward` of `tile` tokens (>= 1);
    returns the plan."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    plan = tiling_plan(lm)
    modules = dict(lm.named_modules())
    for name in plan:
        module = modules[name]
        if not isinstance(module.forward, TiledForward):
            module.forward = TiledForward(module, module.forward, tile)
    return plan


def describe_tiling(lm: nn.Module) -> str:
    """The start line's words for the tiled modules of `lm` (found by their forward, so also through PEFT)."""
    tiled = [m.forward for m in lm.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]
    kinds = sorted({"experts" if is_experts_module(f.module) else "dense" for f in tiled})
    tiles = sorted({f.tile for f in tiled})
    return f"tiled MLP ({' and '.join(kinds)}, {len(tiled)} modules, {'/'.join(map(str, tiles))}-token tiles)"
