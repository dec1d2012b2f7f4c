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
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the estimates need from a decoder-only transformer config."""

    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = True
    qkv_bias: bool = True  # Qwen2 has biases on q/k/v

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            hidden=cfg.hidden_size, n_layers=cfg.num_hidden_layers, n_heads=cfg.num_attention_heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim=head_dim,
            intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2")),
        )

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

    @property
    def n_params(self) -> int:
        """All parameters (the embedding once when tied)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.n_layers * self.layer_params + embeddings + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: every layer weight plus the lm head (the input
        embedding is a lookup). The N of the 6·N·tokens FLOP count."""
        return self.n_layers * self.layer_params + self.vocab * self.hidden


def activation_bytes_per_token_layer(shape: ModelShape, act_bytes: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (module docstring)."""
    return act_bytes * (12 * shape.hidden + 4 * shape.kv_dim + 4 * shape.intermediate) + 8 * shape.hidden


def activation_bytes(shape: ModelShape, tokens: int, act_bytes: int, checkpointing: bool, loss_chunk: int) -> int:
    per_layer = activation_bytes_per_token_layer(shape, act_bytes)
    if checkpointing:
        body = tokens * shape.n_layers * act_bytes * shape.hidden + tokens * per_layer
    else:
        body = tokens * shape.n_layers * per_layer
    edges = tokens * act_bytes * shape.hidden * 2
    head = 3 * 4 * min(loss_chunk, tokens) * shape.vocab + 4 * shape.vocab * shape.hidden
    return body + edges + head


def model_state_bytes(n_params: int, n_trainable: int, deepspeed_stage: int | None, dp_size: int = 1,
                      offload_optimizer: bool = False, bf16: bool = True) -> int:
    """Weights + gradients + AdamW state on one GPU.

    Plain torch (no DeepSpeed): fp32 weights (bf16 runs under autocast), fp32 gradients, two fp32 Adam moments:
    4·N + 12·trainable. DeepSpeed bf16: bf16 weights and gradients, fp32 master weights and moments (12 bytes per
    trainable parameter), partitioned over dp ranks by the ZeRO stage (1: optimizer, 2: + gradients,
    3: + weights); offload_optimizer moves the 12 bytes to the CPU.
    """
    if deepspeed_stage is None:
        return 4 * n_params + 12 * n_trainable
    w = 2 if bf16 else 4
    stage = deepspeed_stage
    weights = w * n_params / (dp_size if stage >= 3 else 1)
    grads = w * n_trainable / (dp_size if stage >= 2 else 1)
    optim = 0 if offload_optimizer else (12 if bf16 else 8) * n_trainable / (dp_size if stage >= 1 else 1)
    return int(weights + grads + optim)


@dataclass(frozen=True)
class CheckpointingDecision:
    enabled: bool
    needed_bytes: int  # estimated peak without checkpointing
    available_bytes: int  # free memory times (1 - headroom)

    def describe(self) -> str:
        gib = 1 << 30
        verdict = "on" if self.enabled else "off"
        return (f"{verdict} (auto: estimated peak without it {self.needed_bytes / gib:.1f} GiB, "
                f"usable {self.available_bytes / gib:.1f} GiB)")


def choose_checkpointing(shape: ModelShape, tokens: int, free_bytes: int, state_bytes: int, act_bytes: int,
                         loss_chunk: int, headroom: float = 0.1) -> CheckpointingDecision:
    """Checkpoint iff the model state plus the activations of a `tokens`-long micro-batch without checkpointing
    exceed the free memory less `headroom`."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    needed = state_bytes + activation_bytes(shape, tokens, act_bytes, checkpointing=False, loss_chunk=loss_chunk)
    available = int(free_bytes * (1.0 - headroom))
    return CheckpointingDecision(needed > available, needed, available)
