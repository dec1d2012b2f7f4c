"""Which model families train exactly on packed rows, and why the others are refused.

Every causal-LM family of the installed transformers (its auto mapping) is classified here, and the conformance
suite (tests/test_model_conformance.py) holds each classification to account: an `EXACT` family must train on a
packed row exactly as transformers' own unpacked eager forward on each sequence alone (loss and every parameter's
gradient, fp32); a refused family must be refused by `check_model_support` before any weight is loaded, with the
family and the reason. A family the table does not know (a newer transformers, remote code) trains only behind the
start-up self-check (`self_check: true`, train/model_check.py), which compares the packed path with the model's own
forward on the user's data. Beyond the family, `check_model_support` reads the config: a setting that changes which
tokens attend to which (`ATTENTION_SETTINGS`: bidirectional attention, prefix-LM) is refused in any family.

`python -m train.model_support` prints the supported-models table of docs/TRAINING.md from this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class UnsupportedModelError(ValueError):
    """A model family PackSFT cannot train exactly on packed rows (or not with the requested setup)."""


@dataclass(frozen=True)
class Refusal:
    why: str  # what breaks on a packed row
    what_to_do: str = "train another family (docs/TRAINING.md, 'Supported models')"


_ENCODER = Refusal(
    "a BERT-style encoder used as a decoder: its self-attention is bidirectional unless `is_decoder` is set and its "
    "position / token-type embeddings are not restarted per packed sequence, so packed sequences leak into each "
    "other")
_ENCODER_DECODER = Refusal(
    "the decoder of an encoder-decoder model: its position embeddings are computed from the row length (not "
    "`position_ids`) and its layers expect encoder states, so every packed sequence after the first gets wrong "
    "positions")
_OWN_ATTENTION = Refusal(
    "its attention does not go through transformers' AttentionInterface (its own attention classes and masks), so "
    "the packed boundaries never reach it and packed sequences attend to each other")
_NO_CAUSAL_MASK = Refusal(
    "its attention is not routed through transformers' AttentionInterface and builds no causal mask there "
    "(ALiBi inside its own attention): future tokens and other packed sequences leak into every position")
_MULTIMODAL = Refusal(
    "a multimodal (composite) checkpoint: PackSFT trains text decoders on packed text and has not verified this "
    "family's vision/audio towers and multimodal position ids on packed rows",
    "train its text-only model type (e.g. `<family>_text` where transformers has one) or another family")
_SPARSE_INDEXER = Refusal(
    "sparse attention with a learned indexer (DeepSeek Sparse Attention): the indexer scores and selects keys over "
    "the whole row outside the attention function, across packed sequences")
_CHUNKED_ATTENTION = Refusal(
    "chunked local attention (`attention_chunk_size`): its chunks are counted from the start of the row, not of "
    "each packed sequence")
_UNPACKED_ONLY = Refusal(
    "no sequence length limit / relative-position attention that its own modules compute over the whole row")

# model_type -> Refusal, for families that cannot be made exact (filled per family below)
REFUSED: dict[str, Refusal] = {}
for _family in ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm",
                "xlm-roberta", "xlm-roberta-xl", "xmod"):
    REFUSED[_family] = _ENCODER
for _family in ("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                "plbart", "prophetnet", "trocr", "musicgen", "musicgen_melody"):
    REFUSED[_family] = _ENCODER_DECODER
for _family in ("codegen", "gptj", "gpt_neo", "gpt_neox_japanese", "falcon", "mpt", "openai-gpt", "reformer", "cpmant", "nemotron",
                "stablelm", "dbrx", "modernbert-decoder", "xglm"):
    REFUSED[_family] = _OWN_ATTENTION
REFUSED["bloom"] = _NO_CAUSAL_MASK
REFUSED["xlnet"] = _UNPACKED_ONLY
for _family in ("emu3", "fuyu", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "git", "got_ocr2", "llama4",
                "mllama", "moss_transcribe_diarize", "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
                "dots3_note"):
    REFUSED[_family] = _MULTIMODAL
for _family in ("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "dots3_note_text"):
    REFUSED[_family] = _SPARSE_INDEXER
REFUSED["llama4_text"] = _CHUNKED_ATTENTION
REFUSED["blt"] = Refusal(
    "a byte-level text model whose local encoder, global transformer and local decoder work on patches of bytes cut "
    "over the whole row (its entropy patcher sees the row as one sequence): the byte-group hash embeddings of a "
    "sequence's first bytes read the bytes before it, a patch can span two packed sequences, and the global "
    "transformer numbers the row's patches from the row's start, so packed sequences leak into each other")
REFUSED["minimax_m3_vl_text"] = Refusal(
    "a lightning indexer selects key blocks over the whole row and passes them to attention (`block_indices`), "
    "across packed sequences")
REFUSED["deepseek_v4"] = Refusal(
    "its attention compresses keys and values over blocks of neighbouring tokens (compressed / hyper-connection "
    "attention) outside the attention function, across packed sequences")
REFUSED["doge"] = Refusal(
    "its attention builds its own learned dynamic mask over the whole row and passes it to the attention function, "
    "which packed attention cannot combine with the packed boundaries")
for _family in ("inkling_text", "inkling2_text"):
    REFUSED[_family] = Refusal(
        "its attention adds a learned relative-position bias (`position_bias`) that PackSFT's attention backends do "
        "not implement")
for _family in ("gemma4_assistant", "gemma4_unified_assistant"):
    REFUSED[_family] = Refusal(
        "a draft (assistant) model for speculative decoding that reads the target model's hidden states: not a "
        "standalone causal LM", "fine-tune the target model (`gemma4_text`)")


@dataclass(frozen=True)
class SettingRefusal:
    """A model config setting PackSFT refuses in whichever family has it."""

    key: str
    applies: Callable[[Any], bool]  # the config's value -> refused
    why: str
    what_to_do: str


# Settings that change which tokens a token attends to. Packed attention is causal within each sequence, and
# neither transformers' masks nor a layer's `is_causal` reach it: with one of these set, a packed row would
# silently train another model. First match wins.
ATTENTION_SETTINGS = (
    SettingRefusal(
        "use_bidirectional_attention", lambda value: value is True or value == "all",
        "it makes the attention layers bidirectional (embedding models such as EmbeddingGemma; the layers' "
        "`is_causal = False`), so every "
        "token attends to the tokens after it, the one it is trained to predict included; PackSFT's packed attention "
        "is causal",
        "set use_bidirectional_attention to false / null in the model config (a causal LM) or train another model"),
    SettingRefusal(
        "prefix_lm", bool,
        "the tokens its `token_type_ids` mark (the instruction) attend to each other bidirectionally; packed rows "
        "carry no token_type_ids and PackSFT's packed attention is causal, so the instruction would train as causal "
        "text, not as the prefix-LM the model is",
        "set prefix_lm: false in the model config to fine-tune it as a plain causal LM (its instruction then attends "
        "causally), or train another family"),
    SettingRefusal(
        "is_causal", lambda value: value is False,
        "transformers then builds a bidirectional mask (every token attends to the tokens after it); PackSFT's "
        "packed attention is causal",
        "remove is_causal: false from the model config"),
)

# model_type -> what the conformance suite exercises beyond plain causal attention
EXACT: dict[str, str] = {}
for _family in ("apertus", "arcee", "aria_text", "biogpt", "bitnet", "ctrl", "diffllama", "dots1", "ernie4_5",
                "ernie4_5_moe", "flex_olmo", "gemma", "glm", "glm4", "glm4_moe", "gpt-sw3", "gpt2", "gpt_bigcode",
                "gpt_neox", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3",
                "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe", "laguna", "llama", "mellum",
                "minimax_m2", "moshi", "olmo", "olmo2", "olmoe", "opt", "persimmon", "phi",
                "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "solar_open", "whisper",
                "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "youtu", "axk1"):
    EXACT[_family] = "causal attention"
EXACT["hrm_text"] = "causal attention (`prefix_lm: false`; a prefix-LM config is refused)"
for _family in ("granite", "granitemoe", "granitemoeshared"):
    EXACT[_family] = "logits divided by `logits_scaling` (train/lm_head.py)"
EXACT["cohere"] = "logits multiplied by `logit_scale` (train/lm_head.py)"
EXACT["minicpm3"] = "hidden states divided by hidden_size / dim_model_base before the head (train/lm_head.py)"
EXACT["nanochat"] = "final-logit softcap (train/lm_head.py)"
EXACT["xlstm"] = "mLSTM layers restarted per sequence (train/recurrent.py), output-logit softcap"
for _family in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text", "olmo_hybrid", "kimi_linear",
                "bailing_hybrid"):
    EXACT[_family] = "linear-attention layers restarted per sequence (train/recurrent.py)"
for _family in ("granitemoehybrid", "bamba", "jamba", "nemotron_h", "zamba", "zamba2", "mamba", "mamba2",
                "falcon_mamba", "falcon_h1"):
    EXACT[_family] = "Mamba layers restarted per sequence (train/recurrent.py)"
for _family in ("lfm2", "lfm2_moe", "lfm3"):
    EXACT[_family] = "short convolutions restarted per sequence (train/recurrent.py)"
_WINDOW = "sliding-window layers (window shorter than the sequences in the suite)"
for _family in ("mistral", "ministral", "ministral3", "mixtral", "phi3", "phimoe", "starcoder2", "olmo3", "exaone4",
                "exaone_moe", "afmoe", "cwm", "kolibri1", "beam", "qwen2_moe", "cohere_compass_text"):
    EXACT[_family] = _WINDOW
for _family in ("phi3", "phimoe"):  # their long-context checkpoints use longrope
    EXACT[_family] = _WINDOW + ", longrope frequencies per packed sequence (train/rope.py)"
EXACT["cohere2"] = EXACT["cohere2_moe"] = _WINDOW + ", logits multiplied by `logit_scale`"
for _family in ("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "vaultgemma"):
    EXACT[_family] = _WINDOW + ", attention-logit and final-logit softcaps where the family has them"
for _family in ("gpt_oss", "flint", "mimo_v2_flash", "granite_swa", "granitemoe_swa"):
    EXACT[_family] = _WINDOW + ", attention sinks (trained)"
EXACT["recurrent_gemma"] = "RG-LRU and convolutions restarted per sequence, local attention window, logit softcap"
EXACT["minimax"] = "lightning (linear) attention restarted per sequence, sliding-window layers"
EXACT["rwkv"] = "token shift and WKV state restarted per sequence (train/recurrent.py)"
EXACT["zaya"] = "attention-side convolution restarted per sequence (train/recurrent.py)"


def model_type_of(config) -> str:
    return str(getattr(config, "model_type", "") or "")


def family_status(model_type: str) -> str:
    """`exact`, `refused` or `unverified` (not in the table: only the start-up self-check vouches for it)."""
    if model_type in EXACT:
        return "exact"
    if model_type in REFUSED:
        return "refused"
    return "unverified"


def check_model_support(config, *, self_check: bool = True) -> str:
    """Raise UnsupportedModelError for a family that cannot train exactly on packed rows, or a config setting
    (ATTENTION_SETTINGS) that no family can; return the family's status.

    An unverified family passes only with the start-up self-check on (it then proves the packed path on the
    user's own data before step 1)."""
    model_type = model_type_of(config)
    status = family_status(model_type)
    if status == "refused":
        refusal = REFUSED[model_type]
        raise UnsupportedModelError(
            f"model family {model_type!r} cannot be trained on packed rows: {refusal.why}. "
            f"What to do: {refusal.what_to_do.replace('<family>', model_type)}."
        )
    for setting in ATTENTION_SETTINGS:
        value = getattr(config, setting.key, None)
        if setting.applies(value):
            raise UnsupportedModelError(
                f"model family {model_type!r} cannot be trained on packed rows with `{setting.key}: {value}`: "
                f"{setting.why}. What to do: {setting.what_to_do}."
            )
    if status == "unverified" and not self_check:
        raise UnsupportedModelError(
            f"model family {model_type!r} is not in PackSFT's verified table (train/model_support.py) and "
            "self_check=false: nothing would show whether packed rows train it exactly. Set self_check: true "
            "(the default): it compares the packed path with the model's own unpacked forward before step 1."
        )
    return status


def supported_models_table(features: dict[str, str] | None = None) -> str:
    """The Markdown table of docs/TRAINING.md: every family of the installed transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = ["| family | packed training | notes |", "|---|---|---|"]
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        status = family_status(model_type)
        if status == "exact":
            rows.append(f"| `{model_type}` | exact | {EXACT[model_type]} |")
        elif status == "refused":
            rows.append(f"| `{model_type}` | refused | {REFUSED[model_type].why} |")
        else:
            rows.append(f"| `{model_type}` | unverified | self-check only |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(supported_models_table())
