"""The router load-balancing (aux) loss of mixture-of-experts models, exact over packed rows, GA, DP and SP.

Definition: transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6), which the MoE causal LMs of
transformers (mixtral, qwen2_moe, qwen3_moe, qwen3_next, gpt_oss, olmoe, ...) add when `output_router_logits` is
set. With one router row per token and MoE layer, p = softmax(router logits) and the top-k experts of p:

    aux = num_experts * sum_e (count_e / R) * (prob_e / R)

count_e: top-k assignments to expert e, prob_e: the summed p_e, R: the rows. Only the micro-batch's REAL tokens
are rows, as in HF with an attention_mask: sequence-parallel padding and filler rows are not data.

count, prob and R are sums over tokens: under sequence parallelism each rank sums its own tokens, the sums are
all-reduced over the sp group (differentiably), so every rank gets the aux of the whole row, and each adds
aux / sp_size: the ranks' shares sum to the micro-batch's value, as their LM losses do. The step's aux term
(train/trainer.py) is the mean over the step's real micro-batches of all dp ranks of coef * aux, so gradient
accumulation and data parallelism over the same micro-batches give the same step.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common.config import ConfigError
from train.distributed import differentiable_all_reduce_sum
from train.families import DEFAULT_COEF_KEY, FAMILIES

if TYPE_CHECKING:
    from train.attention.sequence_parallel import SPContext

# the signature of transformers' load_balancing_loss_func that computes the definition above (doge's, with
# `num_keys`, and the encoder-decoder routers' are other losses)
HF_SIGNATURE = ["gate_logits", "num_experts", "top_k", "attention_mask"]


@dataclass(frozen=True)
class RouterAux:
    num_experts: int
    top_k: int
    coef: float  # the train key router_aux_loss_coef, else the model config's (coef_key)

    def share(self, router_logits: Sequence[torch.Tensor], real_tokens: torch.Tensor,
              sp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """This rank's share of coef * aux of the micro-batch: the whole value without sequence parallelism, else
        1/sp_size of the aux of the whole row. `router_logits`: one [tokens, num_experts] tensor per MoE layer
        (this rank's tokens); `real_tokens`: [tokens] 1.0 for a real token, 0.0 for padding or a filler row."""
        if not router_logits:
            raise RuntimeError("the model returned no router logits: its decoder does not record them")
        stats = router_statistics(router_logits, real_tokens, self.num_experts, self.top_k)
        if sp_group is None:
            return self.coef * load_balancing_loss(stats, self.num_experts)
        stats = differentiable_all_reduce_sum(stats, sp_group)
        return self.coef * load_balancing_loss(stats, self.num_experts) / dist.get_world_size(sp_group)


def router_statistics(router_logits: Sequence[torch.Tensor], real_tokens: torch.Tensor, num_experts: int,
                      top_k: int) -> torch.Tensor:
    """[2 * num_experts + 1] float32, summed over the layers and the real tokens: top-k assignments per expert,
    routing probability per expert, router rows. Differentiable through the probabilities only (as HF's)."""
    mask = real_tokens.reshape(-1, 1).float()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=mask.device)
    for logits in router_logits:
        routing = torch.softmax(logits.reshape(-1, num_experts).float(), dim=-1)
        selected = torch.topk(routing, top_k, dim=-1).indices
        counts = counts + (F.one_hot(selected, num_experts).sum(dim=1).float() * mask).sum(dim=0)
        probs = probs + (routing * mask).sum(dim=0)
    rows = mask.sum().reshape(1) * len(router_logits)
    return torch.cat([counts, probs, rows])


def load_balancing_loss(statistics: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The aux loss from `router_statistics` (summed over ranks or not); 0 without a real token (a filler)."""
    counts, probs, rows = statistics.split([num_experts, num_experts, 1])
    rows = rows.clamp(min=1.0)
    return num_experts * torch.sum(counts / rows * (probs / rows))


def real_tokens(n_tokens: int, sp_ctx: SPContext | None, filler: bool) -> torch.Tensor:
    """[n_tokens] float32 on the CPU: 1.0 for this rank's tokens of the data, 0.0 for sequence-parallel padding
    and for every token of a filler row."""
    if filler:
        return torch.zeros(n_tokens)
    if sp_ctx is None:
        return torch.ones(n_tokens)
    return (sp_ctx.source_index[sp_ctx.local_index] >= 0).float().cpu()


def _causal_lm(lm: nn.Module) -> nn.Module:
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # through a PEFT wrapper


def hf_load_balancing(lm: nn.Module) -> tuple[int, int] | None:
    """(num_experts, top_k) when transformers' causal LM class of `lm` adds the load-balancing loss above (its
    module defines `load_balancing_loss_func` with HF_SIGNATURE and the model carries num_experts and
    num_experts_per_tok, which its forward passes to it), else None: e.g. deepseek_v3, whose routers balance with
    a score-correction bias and which has no aux loss in transformers."""
    causal_lm = _causal_lm(lm)
    func = getattr(sys.modules.get(type(causal_lm).__module__), "load_balancing_loss_func", None)
    if func is None or list(inspect.signature(func).parameters) != HF_SIGNATURE:
        return None
    text = causal_lm.config.get_text_config()  # a composite's forward passes its text config's (qwen3_vl_moe)
    num_experts = getattr(causal_lm, "num_experts", None) or getattr(text, "num_experts", None) or getattr(
        text, "num_local_experts", None)
    top_k = getattr(causal_lm, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
    if not isinstance(num_experts, int) or not isinstance(top_k, int):
        return None
    return num_experts, top_k


def records_router_logits(decoder: nn.Module) -> bool:
    """Whether the decoder's output can carry router logits (transformers' output recorders)."""
    return "router_logits" in (getattr(decoder, "_can_record_outputs", None) or {})


def resolve_router_aux(lm: nn.Module, output_router_logits: bool | None,
                       coef: float | None) -> tuple[RouterAux | None, str | None]:
    """(the router aux loss to train with, or None; a warning for the log, or None).

    `output_router_logits` / `coef`: the train config's keys, None: the model config's (the coefficient under the
    family's own key, `coef_key`). An explicit `true` for a model transformers computes no load-balancing loss for
    is an error; the model config's `true` for such a model trains without one and says so."""
    causal_lm = _causal_lm(lm)
    config = causal_lm.config.get_text_config()  # a composite's MoE keys live in its text config
    requested = output_router_logits
    if requested is None:
        requested = bool(getattr(config, "output_router_logits", False))
    if not requested:
        return None, None
    model = f"{type(causal_lm).__name__} (model_type {getattr(causal_lm.config, 'model_type', None)!r})"
    shape = hf_load_balancing(lm)
    if shape is None:
        if output_router_logits:
            raise ConfigError(
                f"output_router_logits: true, but transformers adds no router load-balancing loss to {model}; set "
                "output_router_logits to false or null"
            )
        return None, (f"the model config sets output_router_logits, but transformers adds no router load-balancing "
                      f"loss to {model}: training without one")
    if coef is None:
        key = coef_key(config)
        coef = getattr(causal_lm, key, getattr(config, key, None))
        if coef is None:
            raise ConfigError(f"{model} has no {key} in its config: set router_aux_loss_coef")
    return RouterAux(*shape, coef=float(coef)), None


def coef_key(config) -> str:
    """The model config key of the family's aux-loss coefficient (its `aux_coef_key` in train/families.py, else
    router_aux_loss_coef)."""
    spec = FAMILIES.get(getattr(config, "model_type", None))
    return DEFAULT_COEF_KEY if spec is None else spec.aux_coef_key
