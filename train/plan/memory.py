"""`gradient_checkpointing: auto` on a GPU: checkpoint only when the activations of a micro-batch would not fit.

Pure functions of the model shape, the tokens of a micro-batch and the bytes free, so the decision is unit-tested
without a GPU. The estimate (bytes, `a` = activation element size: 2 under bf16, 4 in fp32):

    activations, no checkpointing  = tokens · n_layers · per_layer + tokens · a · hidden · 2   (embeddings, final norm)
    per_layer (bytes per token)    = a · (12·hidden + 4·kv_dim + 4·intermediate) + 8·hidden
    activations, checkpointing     = tokens · n_layers · a · hidden + tokens · per_layer       (layer inputs + one
                                                                                               layer recomputed)
    lm head (chunked loss)         = 3 · 4 · chunk · vocab + 4 · vocab · hidden               (fp32 logits, softmax,
                                                                                               grad of one chunk;
                                                                                               fp32 head gradient)
    model state                    = n_params · bytes_per_param (see `model_state_bytes`)

per_layer: what autograd keeps for a Qwen2/Llama decoder layer with a fused attention kernel (no T² term), per
token: the normed input (h), q/k/v after RoPE (h + 2·kv_dim), the attention output (h), the second normed input
(h), the two RMSNorm outputs before their weight (2·h), gate, up, act(gate) and act·up (4·intermediate), all in the
activation dtype, plus the fp32 inputs of the two RMSNorms (8·h bytes): 6·h + 2·kv_dim + 4·intermediate elements.
The h and kv_dim terms are doubled for autograd temporaries (dtype casts, residual copies). Checked against a
measurement: in benchmarks/results/memory.md (small-152k shape, fp32, chunked loss, no checkpointing, CPU) the
peak grows by 0.77 GiB from 4,096 to 16,384 tokens, 67.3 KB per token; the formula gives 2 · 32,768 + 2,048 =
67.6 KB. Under bf16 autocast it is unmeasured (no GPU lent). The decision keeps `headroom` (default 10%) of the
free memory for the allocator's fragmentation and the kernels' workspaces.

Long rows (docs/TRAINING.md, "Long rows"): `tiled_mlp` (train/model/patches/tiled_mlp.py) keeps the 4·intermediate term of one
tile only, once (a tile's intermediates are freed before the next tile or layer runs; the tiled function keeps just
its input, already counted in per_layer): per_layer less a·4·intermediate per token, plus a·4·intermediate·tile.
`activation_offload` (train/model/patches/offload.py) moves the checkpointed layer inputs to the host: of the
tokens·n_layers·a·hidden only two layers' inputs stay on the device (one copying out or prefetched back, one in
use). `longest_row` and `smallest_sp_degree` answer "does a row fit on one GPU, else over how many ranks" from the
same estimate; `choose_sp_degree` is `sequence_parallel_size: auto` (`python -m train.plan.memory` prints the
table of docs/TRAINING.md).

Mixture of experts (`ModelShape.n_experts` > 0): an MoE layer's feed-forward is its router (hidden · n_experts), its
shared experts (3 · hidden · shared_intermediate) and its routed experts (3 · hidden · moe_intermediate each, the
`expert_params`); a dense layer (DeepSeek's first ones) keeps 3 · hidden · intermediate. Expert parallelism
(`expert_parallel_size: N`, train/model/experts.py) splits the routed experts over N ranks: `model_state_bytes`
counts the expert weights, gradients and AdamW state of expert_params / N on each rank — under the plain engine
that is the saving; under FSDP2 the N-th is further sharded over its world / N expert-data-parallel ranks, so the
resident share stays expert_params / world and what EP saves is the gathered unit (one layer's experts
all-gathered: `gathered_experts_bytes`, E / N of them) and the all-gather traffic. `all_to_all_bytes`: the
exchanges of one MoE layer, an estimate of 4 · tokens · top_k · hidden · a (the rows sent and received by the
dispatch, the outputs sent and received back), assuming balanced routing (a rank receives on average what it
sends; a skewed router can receive up to N times more); added to the model state when EP > 1. The activation
estimate above stays the dense layer's (`intermediate`); `python -m train.plan.memory --moe` prints the
Qwen3-30B-A3B shape on 8 GPUs with and without EP (`--expert-parallel`).

Media towers (`ModelShape.towers`, image / video / audio conversations, train/model/media.py): a rank runs a tower on
the media its tokens show, so its tower activations grow with its tokens too. Per tower (`TowerShape`, read from the
composite's config for the kinds the data holds), with p = tokens · positions_per_token tower positions (vision: the
merge² patches behind each media token; audio: the 2 encoder frames behind each audio token) and a tower block kept
per position like a decoder layer with full multi-head attention (kv_dim = hidden): per_block = a · (16·h + 4·i) +
8·h. A trained tower keeps p · layers · per_block (checkpointing: p · layers · a · h of block inputs plus one block
recomputed, p · per_block: transformers checkpoints the towers' blocks with the decoder's); a frozen one runs without
autograd and keeps nothing beyond its output. Every tower's output, the features placed at the media tokens,
tokens · a · text hidden, stays for the decoder. The bound takes all of a rank's tokens as media tokens of the tower
that costs most per token (a video row is nearly all video tokens); it leaves out a block's transient attention
scores (the towers' sdpa attends within a frame or an audio window), the one temporal patch a rank boundary makes two
ranks encode, and Qwen2-Audio's padding of each clip to its 30-s window (a row of many short clips there exceeds it).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from train.families import text_config


@dataclass(frozen=True)
class TowerShape:
    """A composite's media tower as the estimates see it (module docstring, "Media towers")."""

    name: str  # "vision" / "audio"
    hidden: int
    intermediate: int
    layers: int
    positions_per_token: int  # tower positions behind each media token of the row
    trained: bool  # not frozen: autograd keeps its activations

    def block_bytes(self, act_bytes: int) -> int:
        """Bytes one block keeps per tower position."""
        return act_bytes * (16 * self.hidden + 4 * self.intermediate) + 8 * self.hidden


def media_towers(config, kinds, trained_vision: bool = False, trained_audio: bool = False) -> tuple[TowerShape, ...]:
    """The towers a composite of `config` runs for data holding the media `kinds` (image / video / audio), trained
    or frozen as configured (freeze_vision_tower / freeze_audio_tower)."""
    towers = []
    if {"image", "video"} & set(kinds):
        vision = config.vision_config
        hidden = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL's width is `embed_dim`
        intermediate = getattr(vision, "intermediate_size", None) or int(hidden * vision.mlp_ratio)
        towers.append(TowerShape("vision", hidden, intermediate, vision.depth, vision.spatial_merge_size ** 2,
                                 trained_vision))
    if "audio" in kinds:
        audio = config.audio_config
        towers.append(TowerShape("audio", audio.d_model, audio.encoder_ffn_dim, audio.encoder_layers, 2,
                                 trained_audio))
    return tuple(towers)


def tower_activation_bytes(shape: "ModelShape", tokens: int, act_bytes: int, checkpointing: bool) -> int:
    """What `shape.towers` keep for a `tokens`-long micro-batch per rank (module docstring, "Media towers"); 0 for
    a text model."""
    if not shape.towers:
        return 0
    kept = []
    for tower in shape.towers:
        positions = tokens * tower.positions_per_token
        if not tower.trained:
            kept.append(0)
        elif checkpointing:
            kept.append(positions * tower.layers * act_bytes * tower.hidden + positions * tower.block_bytes(act_bytes))
        else:
            kept.append(positions * tower.layers * tower.block_bytes(act_bytes))
    return max(kept) + tokens * act_bytes * shape.hidden


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need from a decoder-only transformer config (and a composite's media towers)."""

    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = True
    qkv_bias: bool = True  # Qwen2 has biases on q/k/v
    # mixture of experts (0: a dense model): routed experts, chosen per token, each one's width, the layers with
    # experts (the others dense, `intermediate` wide), the shared experts' total width
    n_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    moe_layers: int = 0
    shared_intermediate: int = 0
    towers: tuple[TowerShape, ...] = ()  # the media towers the data runs (`media_towers`); none for text

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        cfg = text_config(config)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            hidden=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim=head_dim,
            intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2")),
            **_moe_fields(cfg),
        )

    @property
    def expert_params(self) -> int:
        """The routed experts' weights over all MoE layers (what expert parallelism splits)."""
        return self.moe_layers * self.n_experts * 3 * self.hidden * self.moe_intermediate

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        q_dim = self.n_heads * self.head_dim
        attn = self.hidden * (q_dim + 2 * self.kv_dim) + q_dim * self.hidden
        if self.qkv_bias:
            attn += q_dim + 2 * self.kv_dim
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + the two RMSNorm weights

    def _moe_change(self, experts_per_layer: int) -> int:
        """What the MoE layers change in the layer count: their dense MLP out, their router, shared experts and
        `experts_per_layer` routed experts in."""
        if not self.n_experts:
            return 0
        mlp = 3 * self.hidden * (self.shared_intermediate + experts_per_layer * self.moe_intermediate)
        return self.moe_layers * (self.hidden * self.n_experts + mlp - 3 * self.hidden * self.intermediate)

    @property
    def n_params(self) -> int:
        """All parameters (the embedding once when tied)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.n_layers * self.layer_params + embeddings + self.hidden + self._moe_change(self.n_experts)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: every layer weight plus the lm head (the input
        embedding is a lookup); of the routed experts, the top_k a token runs. The N of the 6·N·tokens FLOP count."""
        return self.n_layers * self.layer_params + self.vocab * self.hidden + self._moe_change(self.top_k)


def _moe_fields(cfg) -> dict:
    """The MoE fields of ModelShape from a (text) config; {} for a dense one."""
    from train.config.ep_rules import MOE_COUNT_KEYS
    from train.families import FAMILIES

    spec = FAMILIES.get(getattr(cfg, "model_type", None))
    keys = (spec.experts.count_key,) if spec is not None and spec.experts is not None else MOE_COUNT_KEYS
    n_experts = next((getattr(cfg, k) for k in keys if isinstance(getattr(cfg, k, None), int)), 0)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if n_experts <= 1 or not isinstance(top_k, int):
        return {}
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0) + len(getattr(cfg, "mlp_only_layers", None) or ())
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    moe_layers = sum(1 for i in range(dense, cfg.num_hidden_layers) if (i + 1) % step == 0)
    shared = (getattr(cfg, "shared_expert_intermediate_size", None)
              or (getattr(cfg, "n_shared_experts", None) or 0) * width)
    return dict(n_experts=n_experts, top_k=top_k, moe_intermediate=width, moe_layers=moe_layers,
                shared_intermediate=shared)


def activation_bytes_per_token_layer(shape: ModelShape, act_bytes: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (module docstring)."""
    return act_bytes * (12 * shape.hidden + 4 * shape.kv_dim + 4 * shape.intermediate) + 8 * shape.hidden


def mlp_bytes_per_token(shape: ModelShape, act_bytes: int) -> int:
    """The per_layer share of a SwiGLU MLP's intermediates: gate, up, act(gate), act·up."""
    return act_bytes * 4 * shape.intermediate


def default_tile_tokens(intermediate: int, act_bytes: int, budget_bytes: int = 256 << 20) -> int:
    """tiled_mlp's tile when `tiled_mlp_tile` is null: the tokens whose four [tile, intermediate] intermediates fit
    `budget_bytes`, a multiple of 256, at least 1024 (Qwen2.5-1.5B bf16: 3,584; Llama-3-8B: 2,304)."""
    return max(1024, budget_bytes // (4 * intermediate * act_bytes) // 256 * 256)


def mlp_tile(model, intermediate: int) -> int | None:
    """The tile of tiled_mlp for a config's model section (`tiled_mlp`, `tiled_mlp_tile`, `bf16`); None: untiled."""
    if not model.tiled_mlp:
        return None
    return model.tiled_mlp_tile or default_tile_tokens(intermediate, 2 if model.bf16 else 4)


def activation_bytes(shape: ModelShape, tokens: int, act_bytes: int, checkpointing: bool, loss_chunk: int,
                     tile: int | None = None, offload: bool = False, checkpointed_layers: int | None = None) -> int:
    """Activation bytes of a `tokens`-long micro-batch (module docstring); `tile`: tiled_mlp's tile (None: untiled),
    `offload`: activation_offload (with checkpointing only); `checkpointed_layers`: with checkpointing, only the
    first k layers are checkpointed (None: all). The first k, not the last: backward reaches them after the other
    layers' activations are freed, so one recomputed layer is never held beside them:
    k · hidden + max(n - k, 1) · per_layer per token."""
    per_layer = activation_bytes_per_token_layer(shape, act_bytes)
    mlp_transient = 0
    if tile is not None:
        per_layer -= mlp_bytes_per_token(shape, act_bytes)
        mlp_transient = min(tile, tokens) * mlp_bytes_per_token(shape, act_bytes)
    layers = shape.n_layers if checkpointed_layers is None or not checkpointing else checkpointed_layers
    if offload and layers != shape.n_layers:
        raise ValueError("activation offload moves the inputs of every checkpointed layer: checkpoint all layers")
    if checkpointing and layers > 0:
        inputs_kept = 2 if offload else layers
        body = tokens * inputs_kept * act_bytes * shape.hidden + tokens * max(shape.n_layers - layers, 1) * per_layer
    else:
        body = tokens * shape.n_layers * per_layer
    body += mlp_transient + tower_activation_bytes(shape, tokens, act_bytes, checkpointing and layers > 0)
    edges = tokens * act_bytes * shape.hidden * 2
    head = 3 * 4 * min(loss_chunk, tokens) * shape.vocab + 4 * shape.vocab * shape.hidden
    return body + edges + head


def offload_host_bytes(shape: ModelShape, tokens: int, act_bytes: int) -> int:
    """Pinned host memory `activation_offload` holds at the end of a `tokens`-long micro-batch's forward: every
    decoder layer's input, each buffer rounded up to a power of two as torch's pinned-memory allocator rounds it (a
    384 MiB buffer takes 512)."""
    return shape.n_layers * (1 << (tokens * shape.hidden * act_bytes - 1).bit_length())


def available_host_bytes() -> int | None:
    """The machine's MemAvailable (/proc/meminfo), None where there is none: the one input of the plan read from
    the machine rather than given."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_offload_problem(shape: ModelShape, tokens: int, act_bytes: int, host_bytes: int | None, ranks: int = 1,
                         headroom: float = 0.1) -> str | None:
    """Why `activation_offload` cannot hold a `tokens`-long micro-batch per rank when `ranks` processes share a
    machine with `host_bytes` available (None: unknown, not checked), or None when it can. The same headroom as
    the GPU plan is kept for the rest of the process (data, the tokenizer, pinned staging buffers)."""
    if host_bytes is None:
        return None
    need = offload_host_bytes(shape, tokens, act_bytes)
    usable = int(host_bytes * (1.0 - headroom)) // max(ranks, 1)
    if need <= usable:
        return None
    gib = 1 << 30
    per_layer = need // shape.n_layers
    return (f"activation_offload: a {tokens:,}-token micro-batch per rank keeps {need / gib:.1f} GiB of pinned host "
            f"memory ({shape.n_layers} layers × {per_layer / gib:.2f} GiB: {tokens:,} tokens × {shape.hidden} hidden × "
            f"{act_bytes} bytes, rounded up to a power of two by torch's pinned allocator); this machine has "
            f"{host_bytes / gib:.1f} GiB available, {usable / gib:.1f} GiB usable per rank for its {ranks} "
            f"rank{'s' if ranks != 1 else ''}")


def model_state_bytes(n_params: int, n_trainable: int, deepspeed_stage: int | None, dp_size: int = 1,
                      offload_optimizer: bool = False, bf16: bool = True, expert_params: int = 0,
                      expert_parallel_size: int = 1) -> int:
    """Weights + gradients + AdamW state on one GPU.

    Plain torch (no DeepSpeed): fp32 weights (bf16 runs under autocast), fp32 gradients, two fp32 Adam moments:
    4·N + 12·trainable. DeepSpeed bf16: bf16 weights and gradients, fp32 master weights and moments (12 bytes per
    trainable parameter), partitioned over dp ranks by the ZeRO stage (1: optimizer, 2: + gradients,
    3: + weights); offload_optimizer moves the 12 bytes to the CPU.
    Expert parallelism (`expert_parallel_size` N > 1): of the `expert_params` (all trainable: LoRA is refused under
    EP), a rank holds expert_params / N, partitioned by the same rules over its dp_size / N expert-data-parallel
    ranks; the other parameters as above.
    """
    if expert_parallel_size > 1 and expert_params:
        ep = expert_parallel_size
        rest = model_state_bytes(n_params - expert_params, n_trainable - expert_params, deepspeed_stage, dp_size,
                                 offload_optimizer, bf16)
        return rest + model_state_bytes(expert_params // ep, expert_params // ep, deepspeed_stage,
                                        max(dp_size // ep, 1), offload_optimizer, bf16)
    if deepspeed_stage is None:
        return 4 * n_params + 12 * n_trainable
    w = 2 if bf16 else 4
    stage = deepspeed_stage
    weights = w * n_params / (dp_size if stage >= 3 else 1)
    grads = w * n_trainable / (dp_size if stage >= 2 else 1)
    optim = 0 if offload_optimizer else (12 if bf16 else 8) * n_trainable / (dp_size if stage >= 1 else 1)
    return int(weights + grads + optim)


def all_to_all_bytes(shape: ModelShape, tokens: int, act_bytes: int, expert_parallel_size: int) -> int:
    """The exchanges of one MoE layer under expert parallelism for a `tokens`-token micro-batch per rank (module
    docstring: 4 · tokens · top_k · hidden · a, balanced routing); 0 without EP or experts."""
    if expert_parallel_size <= 1 or not shape.n_experts:
        return 0
    return 4 * tokens * shape.top_k * shape.hidden * act_bytes


def gathered_experts_bytes(shape: ModelShape, expert_parallel_size: int, param_bytes: int = 4) -> int:
    """One MoE layer's routed experts held whole on a rank while a fully sharded engine (FSDP2, fp32) runs it:
    n_experts / N of them."""
    if not shape.moe_layers:
        return 0
    return param_bytes * shape.expert_params // shape.moe_layers // expert_parallel_size


@dataclass(frozen=True)
class CheckpointingDecision:
    layers: int  # decoder layers checkpointed (the first ones), 0: none
    n_layers: int
    needed_bytes: int  # estimated peak without checkpointing
    planned_bytes: int  # estimated peak with `layers` checkpointed
    available_bytes: int  # free memory times (1 - headroom)

    @property
    def enabled(self) -> bool:
        return self.layers > 0

    def describe(self) -> str:
        gib = 1 << 30
        verdict = "off" if not self.layers else "on" if self.layers == self.n_layers else (
            f"on for the first {self.layers} of {self.n_layers} layers")
        planned = f", with it {self.planned_bytes / gib:.1f} GiB" if self.layers else ""
        return (f"{verdict} (auto: estimated peak without it {self.needed_bytes / gib:.1f} GiB{planned}, "
                f"usable {self.available_bytes / gib:.1f} GiB)")


def choose_checkpointing(shape: ModelShape, tokens: int, free_bytes: int, state_bytes: int, act_bytes: int,
                         loss_chunk: int, headroom: float = 0.1, tile: int | None = None) -> CheckpointingDecision:
    """Checkpoint the fewest decoder layers (the first k) with which the model state plus the activations of a
    `tokens`-long micro-batch (tiled_mlp's `tile` counted) fit the free memory less `headroom`: none when all
    activations fit, else the k of the smallest estimate. Each layer left out saves its recomputation (one more
    forward: a third of the layer's forward + backward FLOPs). The last layer is never worth checkpointing: its own activations are what one recomputed
    layer would hold (k = n - 1 estimates less than k = n)."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    available = int(free_bytes * (1.0 - headroom))

    def peak(layers: int) -> int:
        return state_bytes + activation_bytes(shape, tokens, act_bytes, checkpointing=layers > 0,
                                              loss_chunk=loss_chunk, tile=tile, checkpointed_layers=layers)

    peaks = [peak(k) for k in range(shape.n_layers + 1)]
    layers = next((k for k, bytes_ in enumerate(peaks) if bytes_ <= available), peaks.index(min(peaks)))
    return CheckpointingDecision(layers, shape.n_layers, peaks[0], peaks[layers], available)


@dataclass(frozen=True)
class LongRowOptions:
    """The activation options of one long-row plan: checkpointing, tiled_mlp's tile (None: untiled), offload."""

    checkpointing: bool = True
    tile: int | None = None
    offload: bool = False

    def __post_init__(self):
        if self.offload and not self.checkpointing:
            raise ValueError("activation offload moves the checkpointed layer inputs: it needs checkpointing")

    def describe(self) -> str:
        parts = ["checkpointing" if self.checkpointing else "no checkpointing"]
        if self.tile is not None:
            parts.append(f"tiled MLP ({self.tile})")
        if self.offload:
            parts.append("offload")
        return " + ".join(parts)


def row_fits(shape: ModelShape, tokens: int, gpu_bytes: int, state_bytes: int, options: LongRowOptions,
             act_bytes: int = 2, loss_chunk: int = 4096, headroom: float = 0.1, host_bytes: int | None = None,
             host_ranks: int = 1) -> bool:
    """Whether a micro-batch of `tokens` tokens per rank fits: model state + activations <= gpu_bytes less headroom,
    and with offload, its pinned buffers in `host_bytes` shared by `host_ranks` ranks (None: not checked)."""
    needed = state_bytes + activation_bytes(shape, tokens, act_bytes, options.checkpointing, loss_chunk,
                                            tile=options.tile, offload=options.offload)
    if needed > int(gpu_bytes * (1.0 - headroom)):
        return False
    return not options.offload or host_offload_problem(shape, tokens, act_bytes, host_bytes, host_ranks,
                                                       headroom) is None


def smallest_sp_degree(shape: ModelShape, row: int, gpu_bytes: int, state_bytes: int, options: LongRowOptions,
                       degrees: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), **estimate) -> int | None:
    """The smallest sequence-parallel degree of `degrees` whose share of a `row`-token row (ceil(row / k) tokens)
    fits one GPU, or None when none does. `state_bytes`: the model state per GPU (it does not depend on the sp
    degree under ZeRO-3 over the same world); `estimate`: act_bytes, loss_chunk, headroom, host_bytes, host_ranks
    of `row_fits`. The
    collectives' transient buffers of the SP backends are not counted (a few percent, docs/TRAINING.md §9)."""
    return next((k for k in degrees if row_fits(shape, -(-row // k), gpu_bytes, state_bytes, options, **estimate)),
                None)


@dataclass(frozen=True)
class SPDegreeChoice:
    """`sequence_parallel_size: auto`: the degree chosen and why (the start line prints `describe()`)."""

    degree: int
    row: int
    gpu_bytes: int
    options: LongRowOptions

    def describe(self) -> str:
        tokens = -(-self.row // self.degree)
        fits = f"{tokens:,} tokens per rank fit {self.gpu_bytes / (1 << 30):.1f} GiB with {self.options.describe()}"
        return f"auto: {self.row:,}-token micro-batches, {fits}" + (
            "" if self.degree == 1 else f"; {-(-self.row // (self.degree // 2)):,} would not")


def choose_sp_degree(shape: ModelShape, row: int, world: int, gpu_bytes: int, state_bytes: int,
                     options: LongRowOptions, act_bytes: int = 2, loss_chunk: int = 4096, headroom: float = 0.1,
                     host_bytes: int | None = None, host_ranks: int = 1) -> SPDegreeChoice:
    """`sequence_parallel_size: auto`: the smallest degree dividing `world` (a power of two, so the hybrid Ulysses
    layouts stay available) whose share of a `row`-token micro-batch fits one GPU of `gpu_bytes` next to
    `state_bytes` of model state, and with offload the host's `host_bytes` shared by `host_ranks` ranks; every other
    factor of the world stays data parallel, which is cheaper than sequence parallelism at equal memory. Raises
    ValueError naming the row, the memory and what could help when no degree fits."""
    degrees = tuple(k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= world and world % k == 0)
    estimate = dict(act_bytes=act_bytes, loss_chunk=loss_chunk, headroom=headroom)
    degree = smallest_sp_degree(shape, row, gpu_bytes, state_bytes, options, degrees=degrees, **estimate,
                                host_bytes=host_bytes, host_ranks=host_ranks)
    if degree is not None:
        return SPDegreeChoice(degree, row, gpu_bytes, options)
    tried = f"over all {world} ranks (sp degrees tried: {list(degrees)})"
    widest = -(-row // degrees[-1])
    if options.offload and row_fits(shape, widest, gpu_bytes, state_bytes, options, **estimate):
        # the GPU would hold the widest split: the host's pinned memory is what runs out
        problem = host_offload_problem(shape, widest, act_bytes, host_bytes, host_ranks, headroom)
        raise ValueError(f"sequence_parallel_size: auto: {tried}, {problem}; try more GPUs (more machines), "
                         "activation_offload: false, or shorter rows (max_length)")
    helps = [name for name, off in (("gradient_checkpointing: true", not options.checkpointing),
                                    ("tiled_mlp: true", options.tile is None),
                                    ("activation_offload: true", not options.offload)) if off]
    raise ValueError(
        f"sequence_parallel_size: auto: a {row:,}-token row does not fit {gpu_bytes / (1 << 30):.1f} GiB per GPU "
        f"with {options.describe()} even {tried}; "
        + (f"try {', '.join(helps)}, " if helps else "") + "more GPUs, or shorter rows (max_length)")


def longest_row(shape: ModelShape, gpu_bytes: int, state_bytes: int, options: LongRowOptions, granularity: int = 1024,
                **estimate) -> int:
    """The longest row (a multiple of `granularity` tokens) that fits one GPU without sequence parallelism."""
    low, high = 0, granularity
    while row_fits(shape, high, gpu_bytes, state_bytes, options, **estimate):
        low, high = high, high * 2
    while high - low > granularity:
        middle = (low + high) // 2 // granularity * granularity
        low, high = (middle, high) if row_fits(shape, middle, gpu_bytes, state_bytes, options, **estimate) else (
            low, middle)
    return low


# published configs: (hidden, layers, heads, kv heads, head dim, intermediate, vocab, tied, qkv bias)
LONG_ROW_SHAPES = {
    "Qwen2.5-1.5B": ModelShape(1536, 28, 12, 2, 128, 8960, 151936, True, True),
    "Llama-3-8B": ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False, False),
}
H100_BYTES = 80 * 10**9


def long_row_table(world: int = 8, gpu_bytes: int = H100_BYTES) -> list[str]:
    """The longest row per GPU of each shape under each option (bf16, DeepSpeed ZeRO-3 over `world` GPUs, loss
    chunk 4096, 10% headroom), and the smallest sp degree for 128K and 1M-token rows: the plan's figures, computed."""
    lines = ["| model | option | longest row per GPU (sp 1) | sp for 128K | sp for 1M |", "|---|---|---|---|---|"]
    for name, shape in LONG_ROW_SHAPES.items():
        tile = default_tile_tokens(shape.intermediate, 2)
        variants = [LongRowOptions(False), LongRowOptions(False, tile), LongRowOptions(True),
                    LongRowOptions(True, tile), LongRowOptions(True, None, True), LongRowOptions(True, tile, True)]
        state = model_state_bytes(shape.n_params, shape.n_params, 3, world, bf16=True)
        for options in variants:
            longest = longest_row(shape, gpu_bytes, state, options)
            sp = [smallest_sp_degree(shape, row, gpu_bytes, state, options) for row in (128 * 1024, 1024 * 1024)]
            cells = ["–" if k is None else str(k) for k in sp]
            lines.append(f"| {name} | {options.describe()} | {longest // 1024}K | {cells[0]} | {cells[1]} |")
    return lines


# Qwen3-30B-A3B (config.json of the released model): 48 layers, all MoE, 128 experts top-8, no shared expert
MOE_SHAPES = {
    "Qwen3-30B-A3B": ModelShape(2048, 48, 32, 4, 128, 6144, 151936, False, False, n_experts=128, top_k=8,
                                moe_intermediate=768, moe_layers=48),
}


def expert_parallel_table(world: int = 8, degrees: tuple[int, ...] = (1, 8), tokens: int = 8192,
                          gpu_bytes: int = H100_BYTES) -> list[str]:
    """Per-rank model state of each MoE shape on `world` GPUs under each expert-parallel degree, for the plain
    engine (fp32 weights + AdamW, replicated) and FSDP2 (fp32, sharded over every rank), with the all-to-all
    buffers of a `tokens`-token micro-batch (bf16) and, under FSDP2, one layer's experts gathered."""
    gib = 1 << 30
    lines = [f"| model | engine | expert_parallel_size | experts per rank | expert state per rank | other state "
             f"per rank | all-to-all ({tokens // 1024}K tokens) | gathered experts (1 layer) | total | fits "
             f"{gpu_bytes / 1e9:.0f} GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, shape in MOE_SHAPES.items():
        dense = shape.n_params - shape.expert_params
        for engine, stage in (("plain", None), ("fsdp2", 3)):
            for ep in degrees:
                if world % ep or shape.n_experts % ep:
                    continue
                state = model_state_bytes(shape.n_params, shape.n_params, stage, world, bf16=False,
                                          expert_params=shape.expert_params, expert_parallel_size=ep)
                other = model_state_bytes(dense, dense, stage, world, bf16=False)
                buffers = all_to_all_bytes(shape, tokens, 2, ep)
                gathered = gathered_experts_bytes(shape, ep) if stage == 3 else 0
                total = state + buffers + gathered
                lines.append(f"| {name} | {engine} | {ep} | {shape.n_experts // ep} of {shape.n_experts} | "
                             f"{(state - other) / gib:.1f} GiB | {other / gib:.1f} GiB | {buffers / gib:.2f} GiB | "
                             f"{gathered / gib:.2f} GiB | {total / gib:.1f} GiB | "
                             f"{'yes' if total <= gpu_bytes * 0.9 else 'no'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="The longest row per GPU with each long-row option, or (--moe) "
                                                 "the model state per GPU of a Qwen3-30B-A3B shape with and without "
                                                 "expert parallelism (the memory plan's estimate, not a "
                                                 "measurement).")
    parser.add_argument("--world", type=int, default=8, help="GPUs the model state is partitioned over")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory, GB (10^9 bytes)")
    parser.add_argument("--moe", action="store_true", help="the MoE table: Qwen3-30B-A3B, EP 1 and --expert-parallel")
    parser.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                        help="the expert-parallel degree to show beside 1 (implies --moe; default: the world)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch per rank (--moe)")
    args = parser.parse_args()
    gpu_bytes = int(args.gpu_gb * 10**9)
    if args.moe or args.expert_parallel is not None:
        ep = args.expert_parallel or args.world
        if ep < 1 or args.world % ep:
            parser.error(f"--expert-parallel must divide --world ({args.world}), got {ep}")
        print("\n".join(expert_parallel_table(args.world, tuple(sorted({1, ep})), args.tokens, gpu_bytes)))
        return
    print("\n".join(long_row_table(args.world, gpu_bytes)))


if __name__ == "__main__":
    main()
