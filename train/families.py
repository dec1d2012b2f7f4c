"""What PackSFT knows about each model family: one `FamilySpec` per `config.model_type`, in one table (`FAMILIES`).

A spec holds the family's support status (exact, or refused with the reason and what to do instead) and every
per-family piece the trainer needs to train it exactly on packed rows; each module reads its piece from here:
- train/model/support.py: the status (`check_model_support`) and the docs table of docs/TRAINING.md;
- train/model/lm_head.py: the logit transform of the family's `*ForCausalLM.forward`, or why no LMHead reproduces it;
- train/model/patches/recurrent.py: the class names of its recurrent token mixers, restarted at each packed sequence;
- train/attention/function.py: whether its sliding window lives only in transformers' mask function;
- train/model/moe.py: the config key of its router aux-loss coefficient;
- train/model/patches/tiled_mlp.py: whether its decoder layers' feed-forwards can run in tiles of tokens (`untileable_mlp`);
- train/model/media.py: how a composite trains on image, video and audio conversations (`media`: a `MediaInputs`), or
  why it cannot;
- train/model/experts.py: where its experts module lives, for expert parallelism (`experts`: an `ExpertsSpec`).
The conformance suite (tests/train/test_families.py) is parametrized from this table: every `exact` family
trains on a packed row exactly as transformers' own unpacked forward (its length-dependent ropes included), every
refused one is stopped before any weight loads, and every causal LM of the installed transformers is in it;
tests/train/test_families_startup.py runs every `exact` one through the trainer's start-up (the CLI's) and one step on a
packed row of 56 sequences against transformers' unpacked forward.

The table covers every causal-LM model type of transformers 5.23 (its auto mapping) and the multimodal types whose
text head the loss knows (they are not causal LMs there: refused, their transform recorded for their text model).
A model type not in it (a newer transformers, remote code) is `unverified`: only the start-up self-check vouches
for it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Literal

DEFAULT_COEF_KEY = "router_aux_loss_coef"


class LogitOp(Enum):
    """How a config attribute (of the family's text config) applies between the hidden states and the logits; the
    value is the phrase of the docs table."""

    SOFTCAP = "final-logit softcap"  # logits = value * tanh(logits / value)
    MULTIPLY = "logits multiplied by"  # logits *= value
    DIVIDE = "logits divided by"  # logits /= value
    DIVIDE_HIDDEN = "hidden states before the head divided by"  # hidden /= value: DIVIDE for a head without bias
    VOCAB_SIZE = "vocabulary cut to"  # logits = logits[..., :value] (a padded output embedding)


# rope types whose frequencies depend on the sequence length (train/model/patches/rope.py), as the docs table names them
ROPE_NOTES = {"longrope": "`rope_type: longrope`", "dynamic": "`rope_type: dynamic` (NTK)"}


@dataclass(frozen=True)
class Refusal:
    """Why a family cannot train exactly on packed rows (`<family>` in what_to_do: its model type)."""

    why: str  # what breaks on a packed row
    what_to_do: str = "train another family (docs/TRAINING.md, 'Supported models')"


MEDIA_KINDS = ("image", "video", "audio")  # what a conversation's media items are (train/model/media_batch.py)


class Positions(Enum):
    """How a composite computes the rotary positions of a conversation with media (train/model/media.py calls its own
    function per packed sequence); the value is the phrase of the docs table."""

    ONE_D = "1-D positions"  # Qwen2-Audio: text and audio tokens numbered alike, restarted per sequence
    # Qwen2-VL / Qwen2.5-VL / Qwen3-VL: get_rope_index(ids, mm_token_type_ids, image_grid_thw, video_grid_thw
    # [, second_per_grid_ts])
    MROPE = "M-RoPE (its get_rope_index)"
    # the Qwen2.5-Omni thinker: get_rope_index(ids, image_grid_thw, video_grid_thw, attention_mask,
    # use_audio_in_video, audio_seqlens, second_per_grids): video and its audio aligned in time
    OMNI = "time-aligned M-RoPE (its get_rope_index, audio inside video)"


class AudioTower(Enum):
    """How a composite turns one audio's `input_features` into the features of its audio tokens."""

    GET_AUDIO_FEATURES = "get_audio_features"  # the Qwen2.5-Omni thinker's own function
    # Qwen2-Audio has none: its forward runs `audio_tower` (padding masked) then `multi_modal_projector` and keeps
    # each audio's first `_get_feat_extract_output_lengths` rows; train/model/media.py runs those same modules
    PROJECTED = "audio_tower + multi_modal_projector"


@dataclass(frozen=True)
class MediaInputs:
    """How a composite's image, video and audio conversations train on packed rows (train/model/media.py runs it): its
    towers run on the media items of each rank's tokens (`get_image_features`, `get_video_features`, the audio tower
    of `audio`), the features replace the embeddings of the items' placeholder tokens (`config.image_token_id`,
    `video_token_id`, `audio_token_id`), and the positions are its own (`positions`) per packed sequence with that
    sequence's items. `kinds`: the media kinds that train exactly; `refused`: kinds its checkpoints take that do not,
    and why (any other kind: it has no tower for it)."""

    kinds: tuple[str, ...]
    positions: Positions = Positions.MROPE
    deepstack: bool = False  # Qwen3-VL: features of some tower layers added to the first decoder layers' states
    audio: AudioTower | None = None
    refused: tuple[tuple[str, Refusal], ...] = ()

    def __post_init__(self):
        unknown = set(self.kinds) - set(MEDIA_KINDS)
        if unknown or ("audio" in self.kinds) != (self.audio is not None):
            raise ValueError(f"MediaInputs: kinds {self.kinds} (audio needs its AudioTower, got {self.audio})")


@dataclass(frozen=True)
class ExpertsSpec:
    """Where a mixture-of-experts family's routed experts live, for expert parallelism (train/model/experts.py): the
    module at `path` in each MoE decoder layer is transformers' experts module (a `use_experts_implementation` class:
    3-D `gate_up_proj` / `down_proj` weights, optional biases, `forward(hidden_states, top_k_index, top_k_weights)`
    returning the routing-weighted sum of the chosen experts), whose per-expert function its layout flags say
    (`is_transposed`, `has_bias`, `has_gate`, its `_apply_gate`: concatenated SiLU gate, gpt_oss's interleaved
    clamped SwiGLU). A layer without that module there (a dense first layer) keeps its MLP. The router, shared
    experts and everything else of the block stay as transformers runs them. `count_key`: the config key of the
    number of routed experts."""

    path: str = "mlp.experts"
    count_key: str = "num_experts"


@dataclass(frozen=True)
class FamilySpec:
    """One model type; every field defaults to what a plain causal-attention decoder needs."""

    model_type: str
    refusal: Refusal | None = None  # None: exact, the conformance suite checks it packed = unpacked
    note: str = ""  # exact: what the suite exercises beyond causal attention (attention features, recurrences)
    logits: tuple[tuple[str, LogitOp], ...] = ()  # the head's transform, in the order its forward applies it
    unreproducible_head: str | None = None  # what its forward does to the logits that no LMHead expresses
    mixers: tuple[str, ...] = ()  # class names of its recurrent token mixers, exact when run once per sequence
    mask_only_window: bool = False  # config.sliding_window on every layer, through the mask function alone
    aux_coef_key: str = DEFAULT_COEF_KEY  # config key of the router aux-loss coefficient its causal LM uses
    ropes: tuple[str, ...] = ()  # length-dependent rope types the suite checks per packed sequence
    # a composite (multimodal) checkpoint trained on text: the model type of its text decoder, whose spec holds the
    # decoder's pieces (mixers, window, ropes); `logits` stays the composite's own (its forward applies them)
    text_family: str | None = None
    composite_only: bool = False  # a text decoder transformers builds only inside its composite (no *ForCausalLM)
    untileable_mlp: str | None = None  # why tiled_mlp (train/model/patches/tiled_mlp.py) cannot run its feed-forwards in tiles
    # a composite's image / video / audio conversations: how they train (per kind), or why none can (None: a
    # composite's are not verified, `unverified_media`; a text model has no tower)
    media: MediaInputs | Refusal | None = None
    experts: ExpertsSpec | None = None  # expert parallelism: where its experts live (None: refused under EP)

    def media_refusal(self, kind: str, takes: bool = True) -> Refusal | None:
        """Why `kind` conversations (image, video, audio) cannot train on this family (None: they train exactly,
        `media`); `takes`: whether its checkpoints' forward takes that kind at all (train/model/support.py reads it
        from the class)."""
        if isinstance(self.media, MediaInputs):
            if kind in self.media.kinds:
                return None
            return dict(self.media.refused).get(kind, no_tower(kind))
        if self.media is not None:
            return self.media
        if not self.text_family:
            return no_tower(kind, text_only=True)
        return unverified_media(kind) if takes else no_tower(kind)

    @property
    def status(self) -> Literal["exact", "refused"]:
        return "exact" if self.refusal is None else "refused"

    def docs_note(self) -> str:
        """The notes column of the docs table: the refusal's reason, or what the suite checks (the note, the logit
        transform and the length-dependent ropes)."""
        if self.refusal is not None:
            return self.refusal.why
        parts = [self.note or "causal attention"]
        if self.text_family:
            parts = [f"composite: text rows train its `{self.text_family}` decoder, towers kept (train/model/composite.py)"]
            if isinstance(self.media, MediaInputs):
                parts.append(f"{' / '.join(self.media.kinds)} conversations: towers per micro-batch, "
                             f"{self.media.positions.value} per packed sequence (train/model/media.py)")
        elif self.composite_only:
            parts.append("trained inside its composite")
        if self.logits:
            steps = ", ".join(f"{op.value} `{attribute}`" for attribute, op in self.logits)
            parts.append(f"{steps} (train/model/lm_head.py)")
        if self.ropes:
            parts.append(f"{' and '.join(ROPE_NOTES[rope] for rope in self.ropes)} frequencies per packed "
                         "sequence (train/model/patches/rope.py)")
        return ", ".join(parts)


def _exact(model_type: str, note: str = "", **fields) -> FamilySpec:
    return FamilySpec(model_type, None, note, **fields)


def _refused(model_type: str, refusal: Refusal, **fields) -> FamilySpec:
    return FamilySpec(model_type, refusal, **fields)


def _composite(model_type: str, text_family: str, refusal: Refusal | None = None, note: str = "",
               **fields) -> FamilySpec:
    """A composite checkpoint (a `*ForConditionalGeneration` with towers) trained on packed text through its text
    decoder; exact when its text family is (`_table` refuses it otherwise)."""
    return FamilySpec(model_type, refusal, note, text_family=text_family, **fields)


def _table(*specs: FamilySpec) -> dict[str, FamilySpec]:
    table = {}
    for spec in specs:
        if spec.model_type in table:
            raise ValueError(f"train/families.py: {spec.model_type!r} has two specs")
        table[spec.model_type] = spec
    for model_type, spec in table.items():  # a composite is refused with its text decoder
        text = table.get(spec.text_family) if spec.text_family else None
        if spec.refusal is None and text is not None and text.refusal is not None:
            table[model_type] = replace(spec, refusal=Refusal(
                f"its text decoder `{spec.text_family}` is refused: {text.refusal.why}", text.refusal.what_to_do))
    return table


ENCODER = Refusal(
    "a BERT-style encoder used as a decoder: its self-attention is bidirectional unless `is_decoder` is set and its "
    "position / token-type embeddings are not restarted per packed sequence, so packed sequences leak into each "
    "other")
ENCODER_DECODER = Refusal(
    "the decoder of an encoder-decoder model: its position embeddings are computed from the row length (not "
    "`position_ids`) and its layers expect encoder states, so every packed sequence after the first gets wrong "
    "positions")
OWN_ATTENTION = Refusal(
    "its attention does not go through transformers' AttentionInterface (its own attention classes and masks), so "
    "the packed boundaries never reach it and packed sequences attend to each other")
NO_CAUSAL_MASK = Refusal(
    "its attention is not routed through transformers' AttentionInterface and builds no causal mask there "
    "(ALiBi inside its own attention): future tokens and other packed sequences leak into every position")
MULTIMODAL = Refusal(
    "a multimodal (composite) checkpoint whose text decoder is not a family PackSFT trains exactly on packed rows "
    "(or not where PackSFT trains a composite's: `model.language_model` beside `lm_head`)",
    "train its text-only model type (e.g. `<family>_text` where transformers has one) or another family")
NESTED_CAUSAL_LM = Refusal(
    "its language model is a whole causal LM nested in the composite (`language_model.lm_head`) and its forward "
    "requires image inputs: PackSFT trains a composite's text decoder at `model.language_model` beside `lm_head`")
TIMM_TOWER = Refusal(
    "its vision tower is a timm model (TimmWrapper), which the conformance suite cannot build where it runs (timm "
    "needs torchvision, which does not import beside the CPU build of torch): not verified packed = unpacked",
    "train its text-only model type (e.g. `<family>_text`) or another family")
PREFIX_IMAGE_TEXT = Refusal(
    "a prefix-LM: its image and prompt tokens (marked by `token_type_ids`) attend to each other bidirectionally, and "
    "packed text rows carry no token_type_ids, so the prompt would train as causal text, not as the model it is")
SPARSE_INDEXER = Refusal(
    "sparse attention with a learned indexer (DeepSeek Sparse Attention): the indexer scores and selects keys over "
    "the whole row outside the attention function, across packed sequences")
CHUNKED_ATTENTION = Refusal(
    "chunked local attention (`attention_chunk_size`): its chunks are counted from the start of the row, not of "
    "each packed sequence")
UNPACKED_ONLY = Refusal(
    "no sequence length limit / relative-position attention that its own modules compute over the whole row")
BYTE_PATCHES = Refusal(
    "a byte-level text model whose local encoder, global transformer and local decoder work on patches of bytes cut "
    "over the whole row (its entropy patcher sees the row as one sequence): the byte-group hash embeddings of a "
    "sequence's first bytes read the bytes before it, a patch can span two packed sequences, and the global "
    "transformer numbers the row's patches from the row's start, so packed sequences leak into each other")
BLOCK_INDEXER = Refusal(
    "a lightning indexer selects key blocks over the whole row and passes them to attention (`block_indices`), "
    "across packed sequences")
COMPRESSED_ATTENTION = Refusal(
    "its attention compresses keys and values over blocks of neighbouring tokens (compressed / hyper-connection "
    "attention) outside the attention function, across packed sequences")
DYNAMIC_MASK = Refusal(
    "its attention builds its own learned dynamic mask over the whole row and passes it to the attention function, "
    "which packed attention cannot combine with the packed boundaries")
POSITION_BIAS = Refusal(
    "its attention adds a learned relative-position bias (`position_bias`) that PackSFT's attention backends do not "
    "implement")
AUDIO_LM = Refusal(
    "an audio-language composite (an audio encoder and projector before a text decoder) that PackSFT has not "
    "verified on packed rows, neither its text rows nor its audio",
    "use a Qwen2-Audio checkpoint or a Qwen2.5-Omni thinker (docs/TRAINING.md, 'Video and audio conversations')")
SPEECH_ENCODER_DECODER = Refusal(
    "a speech encoder-decoder: the audio reaches the text decoder through cross-attention over the encoder's states, "
    "which packed rows do not carry, and its decoder's positions and layers expect those states",
    "use a Qwen2-Audio checkpoint or a Qwen2.5-Omni thinker (docs/TRAINING.md, 'Video and audio conversations')")
WHOLE_OMNI = Refusal(
    "the whole Omni model: its thinker (the text-generating composite) plus a talker and a speech generator that "
    "produce audio, which no text loss trains",
    "train its thinker: a `<family>_thinker` checkpoint (the `thinker_config` and the `thinker.*` weights)")
DRAFT_MODEL = Refusal(
    "a draft (assistant) model for speculative decoding that reads the target model's hidden states: not a "
    "standalone causal LM", "fine-tune the target model (`gemma4_text`)")

# why a composite's image / video / audio conversations cannot train (`media`, train/model/media.py)
MEDIA_NAMES = {"image": "images", "video": "videos", "audio": "audios"}  # the data's lists


def exact_media_families(kind: str) -> list[str]:
    """The model types whose `kind` conversations train exactly (the table's `media`), sorted."""
    return sorted(t for t, spec in FAMILIES.items() if isinstance(spec.media, MediaInputs) and kind in spec.media.kinds)


def unverified_media(kind: str) -> Refusal:
    """A composite whose `kind` path PackSFT does not reproduce (the default of a composite without `media`)."""
    exact = ", ".join(exact_media_families(kind))
    return Refusal(
        f"PackSFT trains {kind} conversations on the composites whose tower, {kind} tokens and positions it reproduces "
        f"exactly on packed rows ({exact}); this family's are not verified packed = unpacked",
        f"train it on text rows (no `{MEDIA_NAMES[kind]}` in the data), or use a checkpoint of {exact}")


def no_tower(kind: str, text_only: bool = False) -> Refusal:
    """A model that takes no `kind`: a text-only model (no tower at all), or a composite without that input."""
    why = (f"a text-only model: it has no {'audio' if kind == 'audio' else 'vision'} tower" if text_only
           else f"its forward takes no {kind} input")
    return Refusal(why, f"drop the `{MEDIA_NAMES[kind]}` from the data, or use a checkpoint of "
                        f"{', '.join(exact_media_families(kind))}")


BIDIRECTIONAL_IMAGES = Refusal(
    "the tokens of one image attend to each other bidirectionally (its forward builds that mask from "
    "`token_type_ids`), which PackSFT's causal packed attention does not express; and its SigLIP tower takes whole "
    "resized images, not the patch rows the data pipeline stores",
    "train it on text rows (no `images` in the data), or use a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint")
GEMMA3_MEDIA = MediaInputs((), refused=(("image", BIDIRECTIONAL_IMAGES),))
QWEN_VL_MEDIA = MediaInputs(("image", "video"))
QWEN3_VL_MEDIA = MediaInputs(("image", "video"), deepstack=True)
QWEN2_AUDIO_MEDIA = MediaInputs(("audio",), Positions.ONE_D, audio=AudioTower.PROJECTED)
OMNI_MEDIA = MediaInputs(("image", "video", "audio"), Positions.OMNI, audio=AudioTower.GET_AUDIO_FEATURES)

# why a family's feed-forwards cannot run in tiles (`untileable_mlp`, train/model/patches/tiled_mlp.py)
NO_MLP_MODULE = ("its decoder layers have no feed-forward module (`mlp`, `feed_forward`, `block_sparse_moe`, `ffn`) "
                 "of their own to tile")
NO_FEED_FORWARD = "its layers are state-space mixers without a feed-forward"
ROUTER_WITHOUT_EXPERTS = ("its mixture-of-experts block routes tokens without transformers' experts module: tiling "
                          "the block would run the router per tile and change the router aux loss")
SHIFTING_FEED_FORWARD = "its feed-forward shifts tokens (time mixing): not a function of each token alone"

MROPE = ("multimodal rotary positions (M-RoPE): all components the packed 1-D position, restarted per sequence, as "
         "its composite computes them for text")

WINDOW = "sliding-window layers (window shorter than the sequences in the suite)"
SINKS = WINDOW + ", attention sinks (trained)"
ATTENTION_SOFTCAP = WINDOW + ", attention-logit softcap"
LINEAR_ATTENTION = "linear-attention layers restarted per sequence (train/model/patches/recurrent.py)"
MAMBA = "Mamba layers restarted per sequence (train/model/patches/recurrent.py)"
SHORT_CONVOLUTION = "short convolutions restarted per sequence (train/model/patches/recurrent.py)"

SOFTCAPPED = (("final_logit_softcapping", LogitOp.SOFTCAP),)
LOGIT_SCALE = (("logit_scale", LogitOp.MULTIPLY),)
GRANITE_SCALING = (("logits_scaling", LogitOp.DIVIDE),)
MUSE_HEAD = (("output_multiplier", LogitOp.MULTIPLY), *SOFTCAPPED)
DRAFT_HEAD = "its forward projects the hidden states and may compute the logits from a masked embedding"

# Written from the transformers 5.23 sources; sorted by model type.
FAMILIES: dict[str, FamilySpec] = _table(
    _exact("afmoe", WINDOW),
    _exact("apertus"),
    _exact("arcee"),
    _exact("aria_text"),
    _exact("axk1"),
    _refused("axk2", SPARSE_INDEXER),
    _exact("bailing_hybrid", LINEAR_ATTENTION, mixers=("BailingHybridDeltaAttention",)),
    _exact("bamba", MAMBA, mixers=("BambaMixer",)),
    _refused("bart", ENCODER_DECODER),
    _exact("beam", WINDOW, logits=SOFTCAPPED),
    _refused("bert", ENCODER),
    _refused("bert-generation", ENCODER),
    _refused("big_bird", ENCODER),
    _refused("bigbird_pegasus", ENCODER_DECODER),
    _exact("biogpt", untileable_mlp=NO_MLP_MODULE),
    _exact("bitnet"),
    _refused("blenderbot", ENCODER_DECODER),
    _refused("blenderbot-small", ENCODER_DECODER),
    _refused("bloom", NO_CAUSAL_MASK),
    _refused("blt", BYTE_PATCHES),
    _refused("camembert", ENCODER),
    _refused("codegen", OWN_ATTENTION),
    _exact("cohere", logits=LOGIT_SCALE),
    _exact("cohere2", WINDOW, logits=LOGIT_SCALE),
    _exact("cohere2_moe", WINDOW, logits=LOGIT_SCALE),
    _exact("cohere_compass_text", WINDOW, logits=LOGIT_SCALE),
    _refused("cpmant", OWN_ATTENTION),
    _exact("ctrl"),
    _exact("cwm", WINDOW),
    _refused("data2vec-text", ENCODER),
    _refused("dbrx", OWN_ATTENTION),
    _exact("deepseek_v2", experts=ExpertsSpec(count_key="n_routed_experts")),
    _exact("deepseek_v3", experts=ExpertsSpec(count_key="n_routed_experts")),
    _refused("deepseek_v32", SPARSE_INDEXER),
    _refused("deepseek_v4", COMPRESSED_ATTENTION),
    _exact("diffllama"),
    _refused("doge", DYNAMIC_MASK),
    _exact("dots1"),
    _refused("dots3_note_text", SPARSE_INDEXER),
    _refused("electra", ENCODER),
    _refused("ernie", ENCODER),
    _exact("ernie4_5"),
    _exact("ernie4_5_moe"),
    _exact("exaone4", WINDOW),
    _exact("exaone_moe", WINDOW),
    _refused("falcon", OWN_ATTENTION),
    _exact("falcon_h1", MAMBA, logits=(("lm_head_multiplier", LogitOp.MULTIPLY),), mixers=("FalconH1Mixer",)),
    _exact("falcon_mamba", MAMBA, mixers=("FalconMambaMixer",), untileable_mlp=NO_FEED_FORWARD),
    _exact("flex_olmo"),
    _exact("flint", SINKS),
    _exact("gemma"),
    _exact("gemma2", ATTENTION_SOFTCAP, logits=SOFTCAPPED),
    _exact("gemma3_text", WINDOW, logits=SOFTCAPPED, ropes=("dynamic",)),
    _exact("gemma3n_text", WINDOW, logits=SOFTCAPPED),
    _refused("gemma4_assistant", DRAFT_MODEL, unreproducible_head=DRAFT_HEAD),
    _exact("gemma4_text", WINDOW, logits=SOFTCAPPED),
    _refused("gemma4_unified_assistant", DRAFT_MODEL, unreproducible_head=DRAFT_HEAD),
    _exact("gemma4_unified_text", WINDOW, logits=SOFTCAPPED),
    _exact("glm"),
    _exact("glm4"),
    _exact("glm4_moe", experts=ExpertsSpec(count_key="n_routed_experts")),
    _exact("glm4_moe_lite"),
    _refused("glm_moe_dsa", SPARSE_INDEXER),
    _exact("gpt-sw3"),
    _exact("gpt2"),
    _exact("gpt_bigcode"),
    _refused("gpt_neo", OWN_ATTENTION),
    _exact("gpt_neox"),
    _refused("gpt_neox_japanese", OWN_ATTENTION),
    _exact("gpt_oss", SINKS, experts=ExpertsSpec(count_key="num_local_experts")),
    _refused("gptj", OWN_ATTENTION),
    _exact("granite", logits=GRANITE_SCALING),
    _exact("granite_swa", SINKS, logits=GRANITE_SCALING),
    _exact("granitemoe", logits=GRANITE_SCALING,
           experts=ExpertsSpec("block_sparse_moe.experts", "num_local_experts")),
    _exact("granitemoe_swa", SINKS, logits=GRANITE_SCALING),
    _exact("granitemoehybrid", MAMBA, logits=GRANITE_SCALING, mixers=("GraniteMoeHybridMambaLayer",)),
    _exact("granitemoeshared", logits=GRANITE_SCALING),
    _exact("helium"),
    _exact("hrm_text", "causal attention (`prefix_lm: false`; a prefix-LM config is refused)",
           untileable_mlp=NO_MLP_MODULE),
    _exact("hunyuan_v1_dense"),
    _exact("hunyuan_v1_moe"),
    _exact("hy_v3"),
    _refused("hy_v4", SPARSE_INDEXER),
    _exact("hyperclovax", logits=(("logits_scaling", LogitOp.MULTIPLY),)),
    _refused("inkling2_text", POSITION_BIAS, logits=(*SOFTCAPPED, ("unpadded_vocab_size", LogitOp.VOCAB_SIZE)),
             mixers=("Inkling2ShortConvolution", "Inkling2DynamicShortConvolution")),
    _refused("inkling_text", POSITION_BIAS, logits=(("logits_mup_width_multiplier", LogitOp.DIVIDE_HIDDEN),
                                                    ("unpadded_vocab_size", LogitOp.VOCAB_SIZE)),
             mixers=("InklingShortConvolution",)),
    _exact("internlm3"),
    _exact("iquestcoder"),
    _exact("jais2"),
    _exact("jamba", MAMBA, mixers=("JambaMambaMixer",)),
    _exact("jetmoe", aux_coef_key="aux_loss_coef", untileable_mlp=ROUTER_WITHOUT_EXPERTS),
    _exact("kimi_linear", LINEAR_ATTENTION, mixers=("KimiLinearDeltaAttention",)),
    _exact("kolibri1", WINDOW),
    _exact("laguna"),
    _exact("lfm2", SHORT_CONVOLUTION, mixers=("Lfm2ShortConv",)),
    _exact("lfm2_moe", SHORT_CONVOLUTION, mixers=("Lfm2MoeShortConv",)),
    _exact("lfm3", SHORT_CONVOLUTION, mixers=("Lfm3ShortConv",)),
    _exact("llama", ropes=("dynamic",)),
    _refused("llama4_text", CHUNKED_ATTENTION),
    _exact("longcat_flash", untileable_mlp=ROUTER_WITHOUT_EXPERTS),
    _exact("mamba", MAMBA, mixers=("MambaMixer",), untileable_mlp=NO_FEED_FORWARD),
    _exact("mamba2", MAMBA, mixers=("Mamba2Mixer",), untileable_mlp=NO_FEED_FORWARD),
    _refused("marian", ENCODER_DECODER),
    _refused("mbart", ENCODER_DECODER),
    _refused("megatron-bert", ENCODER),
    _exact("mellum"),
    _exact("mimo_v2_flash", SINKS),
    _exact("minicpm3", logits=(("logits_scaling", LogitOp.DIVIDE_HIDDEN),)),  # hidden_size / dim_model_base
    _exact("minimax", "lightning (linear) attention restarted per sequence (train/model/patches/recurrent.py), sliding-window "
                      "layers", mixers=("MiniMaxLightningAttention",),
           experts=ExpertsSpec(count_key="num_local_experts")),
    _exact("minimax_m2"),
    _refused("minimax_m3_vl_text", BLOCK_INDEXER),
    _exact("ministral", WINDOW),
    _exact("ministral3", WINDOW),
    _exact("mistral", WINDOW),
    _exact("mixtral", WINDOW, experts=ExpertsSpec(count_key="num_local_experts")),
    _refused("modernbert-decoder", OWN_ATTENTION),
    _exact("moshi"),
    _refused("moss_transcribe_diarize", MULTIMODAL),
    _refused("mpt", OWN_ATTENTION),
    _refused("musicgen", ENCODER_DECODER),
    _refused("musicgen_melody", ENCODER_DECODER),
    _refused("mvp", ENCODER_DECODER),
    _exact("nanochat", logits=SOFTCAPPED),
    _refused("nemotron", OWN_ATTENTION),
    _exact("nemotron_h", MAMBA, mixers=("NemotronHMamba2Mixer",), untileable_mlp=NO_MLP_MODULE),
    _exact("olmo"),
    _exact("olmo2"),
    _exact("olmo3", WINDOW),
    _exact("olmo_hybrid", LINEAR_ATTENTION, mixers=("OlmoHybridGatedDeltaNet",)),
    _exact("olmoe", experts=ExpertsSpec()),
    _refused("openai-gpt", OWN_ATTENTION),
    _exact("opt", untileable_mlp=NO_MLP_MODULE),
    _refused("pegasus", ENCODER_DECODER),
    _exact("persimmon"),
    _exact("phi"),
    _exact("phi3", WINDOW, ropes=("longrope",)),  # Phi-3 / Phi-3.5 / Phi-4-mini long-context checkpoints
    _refused("phi4_multimodal", MULTIMODAL),
    _exact("phimoe", WINDOW, mask_only_window=True, ropes=("longrope",)),
    _refused("plbart", ENCODER_DECODER),
    _refused("prophetnet", ENCODER_DECODER,
             unreproducible_head="its forward predicts n-gram streams from a second hidden-state output"),
    _exact("qwen2"),
    _exact("qwen2_moe", WINDOW, experts=ExpertsSpec()),
    _exact("qwen3"),
    _exact("qwen3_5_moe_text", LINEAR_ATTENTION, mixers=("Qwen3_5MoeGatedDeltaNet",), experts=ExpertsSpec()),
    _exact("qwen3_5_text", LINEAR_ATTENTION, mixers=("Qwen3_5GatedDeltaNet",)),
    _exact("qwen3_moe", experts=ExpertsSpec()),
    _exact("qwen3_next", LINEAR_ATTENTION, mixers=("Qwen3NextGatedDeltaNet",), experts=ExpertsSpec()),
    _exact("qwen4_exp_text", LINEAR_ATTENTION, mixers=("Qwen4ExpTextGatedDeltaNet",)),
    _exact("recurrent_gemma", "RG-LRU and convolutions restarted per sequence (train/model/patches/recurrent.py), local "
                              "attention window", logits=(("logits_soft_cap", LogitOp.SOFTCAP),),
           mixers=("RecurrentGemmaRecurrentBlock",), untileable_mlp=NO_MLP_MODULE),
    _refused("reformer", OWN_ATTENTION),
    _refused("rembert", ENCODER),
    _refused("roberta", ENCODER),
    _refused("roberta-prelayernorm", ENCODER),
    _refused("roc_bert", ENCODER),
    _refused("roformer", ENCODER),
    # both mixers shift each token by one (time mixing)
    _exact("rwkv", "token shift and WKV state restarted per sequence (train/model/patches/recurrent.py)",
           mixers=("RwkvSelfAttention", "RwkvFeedForward"), untileable_mlp=SHIFTING_FEED_FORWARD),
    _exact("seed_oss"),
    _exact("smollm3"),
    _exact("solar_open"),
    _refused("stablelm", OWN_ATTENTION),
    _exact("starcoder2", WINDOW),
    _refused("trocr", ENCODER_DECODER),
    _exact("vaultgemma", ATTENTION_SOFTCAP, logits=SOFTCAPPED),
    _exact("whisper", untileable_mlp=NO_MLP_MODULE, media=SPEECH_ENCODER_DECODER),  # its decoder alone on text
    _refused("xglm", OWN_ATTENTION),
    _refused("xlm", ENCODER),
    _refused("xlm-roberta", ENCODER),
    _refused("xlm-roberta-xl", ENCODER),
    _refused("xlnet", UNPACKED_ONLY),
    _exact("xlstm", "mLSTM layers restarted per sequence (train/model/patches/recurrent.py)",
           logits=(("output_logit_soft_cap", LogitOp.SOFTCAP),), mixers=("xLSTMLayer",)),
    _refused("xmod", ENCODER),
    _exact("youtu"),
    _exact("zamba", MAMBA, mixers=("ZambaMambaMixer",), untileable_mlp=NO_MLP_MODULE),
    _exact("zamba2", MAMBA, mixers=("Zamba2MambaMixer",), untileable_mlp=NO_MLP_MODULE),
    # a convolution over q/k and a one-token-delayed v inside the attention block
    _exact("zaya", "attention-side convolution restarted per sequence (train/model/patches/recurrent.py)",
           mixers=("ZayaCCAProjection",)),
    # Composite checkpoints (transformers' image-text-to-text mapping): trained on packed text through their text
    # decoder (train/model/composite.py), towers kept; a refused text decoder refuses its composite (`_table`).
    _composite("aria", "aria_text"),
    _composite("aya_vision", "cohere2"),
    _refused("blip", MULTIMODAL),
    _composite("blip-2", "opt", NESTED_CAUSAL_LM),
    _refused("chameleon", MULTIMODAL, unreproducible_head=(
        "its forward sets the logits of the image tokens to the dtype's minimum (out of the softmax)")),
    _composite("cohere2_vision", "cohere2"),
    _composite("cohere_compass", "cohere_compass_text", logits=LOGIT_SCALE),
    _refused("cosmos3_edge", MULTIMODAL),
    _composite("cosmos3_omni", "qwen3_vl_text"),
    _refused("deepseek_ocr2", MULTIMODAL),
    _composite("deepseek_vl", "llama"),
    _composite("deepseek_vl_hybrid", "llama"),
    _refused("diffusion_gemma", MULTIMODAL),
    _composite("dots3_note", "dots3_note_text"),
    _refused("emu3", MULTIMODAL),
    _refused("ernie4_5_vl_moe", MULTIMODAL),
    _refused("evolla", MULTIMODAL),
    _composite("exaone4_5", "exaone4"),
    _composite("fast_vlm", "qwen2", TIMM_TOWER),
    _composite("florence2", "bart"),
    _composite("fuyu", "persimmon"),
    _composite("gemma3", "gemma3_text", media=GEMMA3_MEDIA),
    _composite("gemma3n", "gemma3n_text", TIMM_TOWER, logits=SOFTCAPPED),
    _composite("gemma4", "gemma4_text", logits=SOFTCAPPED),
    _composite("gemma4_unified", "gemma4_unified_text", logits=SOFTCAPPED),
    _refused("git", MULTIMODAL),
    _composite("glm46v", "glm4v_text"),
    _composite("glm4v", "glm4v_text"),
    _composite("glm4v_moe", "glm4v_moe_text"),
    _exact("glm4v_moe_text", MROPE, composite_only=True),
    _exact("glm4v_text", MROPE, composite_only=True),
    _refused("glm5_next", MULTIMODAL),
    _refused("glm_ocr", MULTIMODAL),
    _composite("glmga", "glm4v_text"),
    _composite("got_ocr2", "qwen2"),
    _refused("granite4_vision", MULTIMODAL, logits=GRANITE_SCALING),
    _refused("granite_docling", MULTIMODAL, logits=GRANITE_SCALING),
    _refused("hunyuan_vl", MULTIMODAL),
    _composite("hyperclovax_vision_v2", "hyperclovax", logits=(("logits_scaling", LogitOp.MULTIPLY),)),
    _refused("idefics", MULTIMODAL),
    _composite("idefics2", "mistral"),
    _composite("idefics3", "llama"),
    _composite("inkling2", "inkling2_text", logits=(*SOFTCAPPED, ("unpadded_vocab_size", LogitOp.VOCAB_SIZE))),
    _composite("inkling_mm_model", "inkling_text"),
    _composite("instructblip", "opt", NESTED_CAUSAL_LM),
    _composite("instructblipvideo", "opt", NESTED_CAUSAL_LM),
    _composite("internvl", "qwen2"),
    _composite("janus", "llama"),
    _composite("kimi_k25", "deepseek_v3"),
    _refused("kosmos-2", MULTIMODAL),
    _refused("kosmos-2.5", MULTIMODAL),
    _composite("lfm2_vl", "lfm2"),
    _composite("lfm3_vl", "lfm3"),
    _composite("lighton_ocr", "qwen3"),
    _composite("llama4", "llama4_text"),
    _composite("llava", "llama"),
    _composite("llava_next", "llama"),
    _composite("llava_next_video", "llama"),
    _composite("llava_onevision", "qwen2"),
    _composite("minicpm_ocr", "qwen3_5_text"),
    _composite("minicpmv4_6", "qwen3_5_text"),
    _composite("minicpmv4_7", "qwen3_5_text"),
    _composite("minimax_m3_vl", "minimax_m3_vl_text"),
    _composite("mistral3", "mistral"),
    _refused("mistral4", MULTIMODAL),
    _refused("mistral_large4", MULTIMODAL, logits=SOFTCAPPED),
    _refused("mllama", MULTIMODAL),
    _refused("molmo2", MULTIMODAL),
    _refused("muse_glimmer", MULTIMODAL, logits=MUSE_HEAD),
    _refused("muse_spark", MULTIMODAL, logits=MUSE_HEAD),
    _composite("nemotron_h_omni", "nemotron_h", NESTED_CAUSAL_LM),
    _composite("ovis2", "qwen2"),
    _refused("paddleocr_vl", MULTIMODAL),
    _composite("paligemma", "gemma", PREFIX_IMAGE_TEXT, logits=SOFTCAPPED),
    _composite("perception_lm", "llama", TIMM_TOWER),
    _refused("pi0", MULTIMODAL),
    _refused("pix2struct", MULTIMODAL),
    _composite("pp_chart2table", "qwen2"),
    _refused("pp_formulanet", MULTIMODAL),
    _composite("qianfan_ocr", "qwen3"),
    _refused("qwen2_5_omni", WHOLE_OMNI),
    _exact("qwen2_5_omni_text", MROPE, composite_only=True),
    _composite("qwen2_5_omni_thinker", "qwen2_5_omni_text", media=OMNI_MEDIA),
    _composite("qwen2_5_vl", "qwen2_5_vl_text", media=QWEN_VL_MEDIA),
    _exact("qwen2_5_vl_text", MROPE, composite_only=True),
    _composite("qwen2_audio", "qwen2", media=QWEN2_AUDIO_MEDIA),
    _composite("qwen2_vl", "qwen2_vl_text", media=QWEN_VL_MEDIA),
    _exact("qwen2_vl_text", MROPE, composite_only=True),
    _composite("qwen3_5", "qwen3_5_text"),
    _composite("qwen3_5_moe", "qwen3_5_moe_text"),
    _refused("qwen3_asr", AUDIO_LM),
    _refused("qwen3_omni_moe", WHOLE_OMNI),
    _refused("qwen3_omni_moe_thinker", MULTIMODAL),
    _composite("qwen3_vl", "qwen3_vl_text", media=QWEN3_VL_MEDIA),
    _composite("qwen3_vl_moe", "qwen3_vl_moe_text", media=QWEN3_VL_MEDIA),
    _exact("qwen3_vl_moe_text", MROPE, composite_only=True, experts=ExpertsSpec()),
    _exact("qwen3_vl_text", MROPE, composite_only=True),
    _composite("qwen4_exp", "qwen4_exp_text"),
    _composite("shieldgemma2", "gemma3_text"),
    _composite("smolvlm", "llama"),
    _refused("step3p7", MULTIMODAL),
    _refused("t5gemma2", MULTIMODAL),
    _refused("udop", MULTIMODAL),
    _refused("unlimited_ocr", MULTIMODAL),
    _composite("video_llama_3", "qwen2"),
    _composite("video_llava", "llama"),
    _composite("vipllava", "llama"),
    _composite("vision-encoder-decoder", "bert"),
    # The other models of transformers' multimodal-LM, seq2seq-causal-LM and speech-seq2seq mappings that take
    # audio (tests/train/test_media.py enumerates them): audio-language composites and speech encoder-decoders.
    _refused("audioflamingo3", AUDIO_LM),
    _refused("canary", SPEECH_ENCODER_DECODER),
    _refused("cohere_asr", SPEECH_ENCODER_DECODER),
    _refused("fun_asr_nano", AUDIO_LM),
    _refused("glmasr", AUDIO_LM),
    _refused("granite_speech", AUDIO_LM),
    _refused("granite_speech_plus", AUDIO_LM),
    _refused("kyutai_speech_to_text", AUDIO_LM),
    _refused("moonshine", SPEECH_ENCODER_DECODER),
    _refused("moonshine_streaming", SPEECH_ENCODER_DECODER),
    _refused("musicflamingo", AUDIO_LM),
    _refused("nemo_speechlm", AUDIO_LM),
    _refused("pop2piano", SPEECH_ENCODER_DECODER),
    _refused("seamless_m4t", SPEECH_ENCODER_DECODER),
    _refused("seamless_m4t_v2", SPEECH_ENCODER_DECODER),
    _refused("speech-encoder-decoder", SPEECH_ENCODER_DECODER),
    _refused("speech_to_text", SPEECH_ENCODER_DECODER),
    _refused("speecht5", SPEECH_ENCODER_DECODER),
    _refused("vibevoice", SPEECH_ENCODER_DECODER),
    _refused("vibevoice_asr", AUDIO_LM),
    _refused("voxtral", AUDIO_LM),
    _refused("voxtral_realtime", AUDIO_LM),
)


def expert_parallel_families() -> list[str]:
    """The model types whose experts expert parallelism splits (`FamilySpec.experts`), sorted."""
    return sorted(model_type for model_type, spec in FAMILIES.items() if spec.experts is not None)


def text_config(config):
    """The config of a model's language model: a composite's text config, a plain model's own config (also a plain
    object without `get_text_config`, as tests and the memory plan's shapes pass)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
