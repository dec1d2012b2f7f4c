"""Which model families train exactly on packed rows, and why the others are refused.

The status of a family is its `FamilySpec` in train/families.py (every causal-LM family of the installed
transformers), which the conformance suite (tests/train/test_families.py) holds to account: an `exact` family
must train on a packed row exactly as transformers' own unpacked eager forward on each sequence alone (loss and
every parameter's gradient, fp32); a refused family must be refused by `check_model_support` before any weight is
loaded, with the family and the reason. A family the table does not know (a newer transformers, remote code)
trains only behind the start-up self-check (`self_check: true`, train/model/self_check.py), which compares the packed
path with the model's own forward on the user's data. Beyond the family, `check_model_support` reads the config: a
setting that changes which tokens attend to which (`ATTENTION_SETTINGS`: bidirectional attention, prefix-LM) is
refused in any family.

`UnsupportedModelError` is the one error for a model PackSFT does not train: a refused family or setting here, a
head train/model/lm_head.py cannot reproduce, recurrent mixers train/model/patches/recurrent.py cannot restart.

`python -m train.model.support` prints the supported-models table of docs/TRAINING.md from the family table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from common.errors import PackSFTError
from train.families import FAMILIES, MEDIA_KINDS, MEDIA_NAMES, MediaInputs, exact_media_families, text_config


class UnsupportedModelError(PackSFTError, ValueError):
    """A model PackSFT cannot train exactly on packed rows (or not with the requested setup)."""

    label = "model not supported"
    exit_code = 2


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


def model_type_of(config) -> str:
    return str(getattr(config, "model_type", "") or "")


def check_model_support(config, *, self_check: bool = True) -> str:
    """Raise UnsupportedModelError for a family that cannot train exactly on packed rows, or a config setting
    (ATTENTION_SETTINGS) that no family can; return the family's status, `exact` or `unverified` (not in
    train/families.py: only the start-up self-check vouches for it).

    An unverified family passes only with the start-up self-check on (it then proves the packed path on the
    user's own data before step 1)."""
    model_type = model_type_of(config)
    spec = FAMILIES.get(model_type)
    if spec is not None and spec.refusal is not None:
        refusal = spec.refusal
        raise UnsupportedModelError(
            f"model family {model_type!r} cannot be trained on packed rows: {refusal.why}. "
            f"What to do: {refusal.what_to_do.replace('<family>', model_type)}."
        )
    if spec is not None and spec.composite_only:
        raise UnsupportedModelError(
            f"model family {model_type!r} is the text decoder of a composite checkpoint, which transformers builds "
            "only inside it (no causal LM of its own). What to do: set model_path to the composite checkpoint "
            "(docs/TRAINING.md, 'Composite checkpoints').")
    text = text_config(config)
    if spec is None and text is not config:
        raise UnsupportedModelError(
            f"model family {model_type!r} cannot be trained on packed rows: a composite checkpoint (its text decoder "
            f"is {model_type_of(text)!r}) that PackSFT's table (train/families.py) does not list, so nothing "
            "says which of its modules run on text. What to do: train its text-only model type or a listed composite.")
    for setting, value in ((s, getattr(c, s.key, None)) for s in ATTENTION_SETTINGS for c in (config, text)):
        if setting.applies(value):
            raise UnsupportedModelError(
                f"model family {model_type!r} cannot be trained on packed rows with `{setting.key}: {value}`: "
                f"{setting.why}. What to do: {setting.what_to_do}."
            )
    if spec is None and not self_check:
        raise UnsupportedModelError(
            f"model family {model_type!r} is not in PackSFT's verified table (train/families.py) and "
            "self_check=false: nothing would show whether packed rows train it exactly. Set self_check: true "
            "(the default): it compares the packed path with the model's own unpacked forward before step 1."
        )
    return "unverified" if spec is None else spec.status


# the forward arguments through which a composite class takes each media kind (what `takes_media` looks for)
MEDIA_ARGUMENTS = {
    "image": ("pixel_values", "image_embeds"),
    "video": ("pixel_values_videos", "video_values"),
    "audio": ("input_features", "input_values", "audio_values", "input_audio_embeds", "audio_input_features",
              "audio_input_ids"),
}


def takes_media(config, kind: str) -> bool:
    """Whether the class transformers builds for `config` (a composite's, from the multimodal-LM mapping; else the
    causal LM's; no weights) has a forward argument for `kind` (MEDIA_ARGUMENTS): what a refusal says, 'not
    verified' or 'takes none'."""
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MULTIMODAL_LM_MAPPING

    for mapping in (MODEL_FOR_MULTIMODAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING):
        if type(config) in mapping:
            parameters = inspect.signature(mapping[type(config)].forward).parameters
            return any(arg in parameters for arg in MEDIA_ARGUMENTS[kind])
    return True  # a type transformers cannot build here: say it is not verified


def check_media_support(config, kinds) -> MediaInputs:
    """How image / video / audio conversations (`kinds`: those the data holds) train on this model (its family's
    `media`), or UnsupportedModelError naming the family, the kind and the reason: read from the config, before any
    weight loads."""
    model_type = model_type_of(config)
    spec = FAMILIES.get(model_type)
    kinds = [kind for kind in MEDIA_KINDS if kind in set(kinds)]
    listed = " / ".join(MEDIA_NAMES[kind] for kind in kinds)
    if spec is None:
        raise UnsupportedModelError(
            f"model family {model_type!r} cannot train on {listed} (the data holds them): not in PackSFT's table "
            "(train/families.py), so nothing says how its towers, media tokens and positions run on packed rows. "
            f"What to do: use a checkpoint of {', '.join(exact_media_families(kinds[0]))}, or data without them.")
    if spec.refusal is not None:
        raise UnsupportedModelError(
            f"model family {model_type!r} cannot be trained on packed rows: {spec.refusal.why}. "
            f"What to do: {spec.refusal.what_to_do.replace('<family>', model_type)}.")
    for kind in kinds:
        refusal = spec.media_refusal(kind, takes_media(config, kind))
        if refusal is not None:
            raise UnsupportedModelError(
                f"model family {model_type!r} cannot train on {kind} conversations (the data holds "
                f"{MEDIA_NAMES[kind]}): {refusal.why}. What to do: {refusal.what_to_do.replace('<family>', model_type)}.")
    return spec.media


def check_family(config, self_check: bool, warn) -> str:
    """The model family of `config`, checked before any weight loads: a family that cannot train exactly on packed
    rows stops here (UnsupportedModelError naming the family and the reason); one outside the verified table is
    named through `warn` (the start-up self-check decides)."""
    status = check_model_support(config, self_check=self_check)
    if status == "unverified":
        warn(f"model family {model_type_of(config)!r} is not in PackSFT's verified table: the start-up "
             "self-check decides whether it trains exactly")
    return model_type_of(config)


def supported_models_table() -> str:
    """The Markdown table of docs/TRAINING.md: every family of the table, with its status and notes."""
    rows = ["| family | packed training | notes |", "|---|---|---|"]
    for model_type, spec in sorted(FAMILIES.items()):
        rows.append(f"| `{model_type}` | {spec.status} | {spec.docs_note()} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(supported_models_table())
