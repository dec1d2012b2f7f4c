"""Tiny random-init configs of every causal-LM family of the installed transformers, for the conformance suite.

`tiny_config(model_type)` starts from the family's default config and shrinks every size it knows (hidden 64,
2-4 layers, 4 heads, 2 kv heads, head dim 16, vocab 128, small experts and states), keeps one layer of every
kind the default has (`layer_types`), zeroes dropout, and sets the features the suite must see bite: sliding
windows shorter than the test sequences, attention softcaps small enough to matter, and the logit transform of the
family's spec (train/families.py) with values that change the logits.
`FAMILY_OVERRIDES` holds what a family needs beyond that (its own size names, validated relations).
"""
from __future__ import annotations

from typing import Any

from train.families import FAMILIES, LogitOp

VOCAB = 128
WINDOW = 4  # shorter than the conformance sequences, so a dropped window shows

SHRINK: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": VOCAB, "max_position_embeddings": 256, "sliding_window": WINDOW,
    "d_model": 64, "n_layer": 2, "n_head": 4, "n_embd": 64, "num_layers": 2, "ffn_dim": 96,
    "decoder_layers": 2, "encoder_layers": 2, "decoder_attention_heads": 4, "encoder_attention_heads": 4,
    "decoder_ffn_dim": 96, "encoder_ffn_dim": 96, "num_decoder_layers": 2, "n_positions": 256, "n_ctx": 256,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "global_head_dim": 16, "num_global_key_value_heads": 2, "intermediate_size_mlp": 96,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
    "attn_logit_softcapping": 0.5,
}
# the value of each attribute of the family's logit transform, by how it applies (a padded vocabulary keeps its own)
LOGIT_VALUES = {LogitOp.SOFTCAP: 0.3, LogitOp.MULTIPLY: 0.3, LogitOp.DIVIDE: 4.0, LogitOp.DIVIDE_HIDDEN: 4.0}


def _layer_types(default_types: list, n_layers: int) -> list:
    """`n_layers` layer types that include every kind of the default, in the default's order."""
    kinds = list(dict.fromkeys(default_types))
    return [kinds[i % len(kinds)] for i in range(max(n_layers, len(kinds)))]


FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "codegen": {"rotary_dim": 8},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("sliding_attention", "full_attention")}},
    "qwen2_moe": {"use_sliding_window": True, "max_window_layers": 2, "layer_types": ["sliding_attention",
                                                                                     "full_attention"]},
    "gemma3n_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 0,
                     "laurel_rank": 8, "intermediate_size": [96, 96], "activation_sparsity_pattern": [0.0, 0.0]},
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
    "gemma4_unified_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16},
    "gptj": {"rotary_dim": 8},
    "hrm_text": {"prefix_lm": False},  # a prefix-LM config is refused (train/model/support.py ATTENTION_SETTINGS)
    **{mt: {"head_dim": 8} for mt in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
                                      "longcat_flash", "minicpm3", "youtu", "axk1", "axk2")},
}


LINEAR_THEN_FULL = ["linear_attention", "full_attention"]
MLA = dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, num_key_value_heads=4)
MAMBA2_HEADS = dict(mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=8)  # 4 heads x 32 = expand 2 x hidden 64
# per family: what COMMON does not settle (a recurrent and an attention layer where the family has both)
RECURRENT_FAMILIES = {
    "qwen3_next": dict(layer_types=LINEAR_THEN_FULL),
    "qwen3_5_text": dict(layer_types=LINEAR_THEN_FULL),
    "qwen3_5_moe_text": dict(layer_types=LINEAR_THEN_FULL),
    # its attention layers are indexed (QSA) attention, which needs a mask the packsft attention does not build
    "qwen4_exp_text": dict(layer_types=["linear_attention", "linear_attention"]),
    "olmo_hybrid": dict(layer_types=LINEAR_THEN_FULL),
    "kimi_linear": dict(layer_types=LINEAR_THEN_FULL, linear_num_heads=4, linear_head_dim=16, q_lora_rank=None, **MLA),
    "bailing_hybrid": dict(layer_types=LINEAR_THEN_FULL, q_lora_rank=16, num_mtp_layers=0, first_k_dense_replace=2,
                           **MLA),
    "falcon_h1": dict(mamba_d_head=32, mamba_d_ssm=None, **MAMBA2_HEADS),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], shared_intermediate_size=32, **MAMBA2_HEADS),
    "bamba": dict(attn_layer_indices=[1], **MAMBA2_HEADS),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, use_mamba_kernels=False),
    "nemotron_h": dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=32,
                       ssm_state_size=8, n_groups=1, chunk_size=8, use_mamba_kernels=False),
    "zamba": dict(layers_block_type=["mamba", "hybrid"], tie_word_embeddings=False, n_mamba_heads=2, mamba_d_state=8, attention_head_dim=32,
                  use_mamba_kernels=False),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=4, mamba_d_state=8, chunk_size=8,
                   use_mamba_kernels=False),
    "mamba": dict(state_size=8),
    "mamba2": dict(num_heads=4, head_dim=32, state_size=8, n_groups=1, chunk_size=8),
    "falcon_mamba": dict(state_size=8),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64, attention_window_size=64),
    "minimax": dict(layer_types=LINEAR_THEN_FULL, block_size=4),
    "xlstm": dict(embedding_dim=64, num_heads=4, num_blocks=2, mode="train", chunk_size=1,
                  autocast_kernel_dtype="float32"),
    "rwkv": dict(attention_hidden_size=64, context_length=64),
    "zaya": dict(num_experts_per_tok=1),
}
FAMILY_OVERRIDES.update(RECURRENT_FAMILIES)


def tiny_config(model_type: str, **overrides):
    """The family's tiny config (a PretrainedConfig), or raises if the family cannot be built small. `overrides`:
    config values set on top (a feature a test turns on)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kwargs = {k: v for k, v in SHRINK.items() if _has(default, k)}
    spec = FAMILIES.get(model_type)
    for attribute, op in spec.logits if spec is not None else ():
        if op in LOGIT_VALUES:  # a derived attribute (a property, MiniCPM3's) is dropped below
            kwargs[attribute] = LOGIT_VALUES[op]
    if _has(default, "kv_lora_rank"):  # multi-head latent attention: as many kv heads as heads
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(default, key, None)
        if isinstance(value, int) and value >= VOCAB:
            kwargs[key] = {"pad_token_id": 0, "bos_token_id": 1}.get(key, 2)
    for key in dir(default):
        if key.startswith("_"):
            continue
        if ("dropout" in key or "pdrop" in key or "jitter" in key) and isinstance(_get(default, key), float):
            kwargs[key] = 0.0  # dropout and router jitter: random in training mode
    default_types = _get(default, "layer_types")
    if isinstance(default_types, list) and default_types and model_type not in RECURRENT_FAMILIES:
        kwargs["layer_types"] = _layer_types(default_types, kwargs.get("num_hidden_layers", 2))
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    kwargs.update(FAMILY_OVERRIDES.get(model_type, {}))
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if not isinstance(getattr(cls, k, None), property)}  # derived
    if isinstance(kwargs.get("layer_types"), list) and _has(default, "num_hidden_layers"):
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    config = cls(**kwargs)
    config.use_cache = False
    return config


def _get(config, key):
    try:
        return getattr(config, key, None)
    except Exception:  # per-layer attributes of composite configs raise on global access
        return None


def _has(config, key) -> bool:
    try:
        return hasattr(config, key)
    except Exception:
        return False


# a modality tower of a composite checkpoint, shrunk: text rows never run it, it only has to build small
TOWER_SHRINK: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "depth": 1, "num_heads": 2, "embed_dim": 32, "num_layers": 1,
    "encoder_layers": 1, "d_model": 32, "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "projection_dim": 32,
}


def _mrope(sections: list[int], **extra) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections, **extra}}


# text decoders of composites with multimodal rotary positions: sections over the 8 frequencies of head dim 16
# (GLM-4V rotates half of it: 4)
FAMILY_OVERRIDES.update({
    "qwen2_vl_text": _mrope([2, 3, 3]), "qwen2_5_vl_text": _mrope([2, 3, 3]),
    "qwen3_vl_text": _mrope([2, 3, 3], mrope_interleaved=True),
    "qwen3_vl_moe_text": _mrope([2, 3, 3], mrope_interleaved=True),
    "qwen2_5_omni_text": _mrope([2, 3, 3]),
    "glm4v_text": _mrope([1, 1, 2], partial_rotary_factor=0.5),
    "glm4v_moe_text": _mrope([1, 1, 2], partial_rotary_factor=0.5),
})


# a composite's own sizes beyond its towers' TOWER_SHRINK keys (a large tower left there costs seconds to initialise)
COMPOSITE_OVERRIDES: dict[str, dict[str, Any]] = {
    "ovis2": {"hidden_size": 64, "vocab_size": VOCAB},  # its visual embedding table: visual vocab x hidden_size
    "janus": {"vq_config": {"base_channels": 32, "channel_multiplier": [1, 1], "num_res_blocks": 1,
                            "num_embeddings": 64, "latent_channels": 32, "projection_dim": 64,
                            "image_token_embed_dim": 64}},
}


def tiny_composite_config(model_type: str, **text_overrides):
    """A composite checkpoint's tiny config: the text decoder of `tiny_config(text family)` (train/families.py's
    `text_family`), every modality tower shrunk by TOWER_SHRINK, the composite's own settings left as they are."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    text = tiny_config(FAMILIES[model_type].text_family, **text_overrides)
    kwargs: dict[str, Any] = {"text_config": text.to_dict()}
    default = cls()
    for key in getattr(cls, "sub_configs", {}):
        tower = _get(default, key)
        if key == "text_config" or tower is None or not hasattr(tower, "to_dict"):
            continue
        shrunk = tower.to_dict()
        shrunk.update({k: v for k, v in TOWER_SHRINK.items() if k in shrunk})
        if isinstance(shrunk.get("layer_types"), list):  # rebuilt for the shrunk depth (LFM3-VL's tower)
            shrunk["layer_types"] = None
        for k in ("out_hidden_size", "text_hidden_size", "output_dim"):
            if k in shrunk:
                shrunk[k] = text.hidden_size
        kwargs[key] = shrunk
    for key in dir(default):
        if not key.startswith("_") and ("dropout" in key or "pdrop" in key) and isinstance(_get(default, key), float):
            kwargs[key] = 0.0
    for key, value in COMPOSITE_OVERRIDES.get(model_type, {}).items():
        kwargs[key] = {**kwargs[key], **value} if isinstance(value, dict) else value
    config = cls(**kwargs)
    config.use_cache = False
    config.get_text_config().use_cache = False
    return config
