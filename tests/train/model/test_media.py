"""Video and audio conversations in the trainer (train/model/media.py): one packed row mixing text, image, video and
audio conversations of the shared fixtures (H.264 / VP9 clips, wav, MP3, stereo FLAC, a clip with its sound), each
media item given as its processor's output alone (the data side's contract, train/model/media_batch.py), trains
exactly as transformers' composite forward on each conversation alone with the processor's output on the whole
conversation: per-sequence logits, the loss and every gradient (fp32), towers trained or frozen, for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL (and its MoE) videos, Qwen2-Audio, and the Qwen2.5-Omni thinker (images, videos, audios and
audio inside video, its time-aligned M-RoPE); under Ulysses and the torch / zigzag ring layouts of sequence
parallelism exactly as in one process (tests/_media_worker.py); every other composite that takes video or audio is
refused from its config alone, with the reason.

Run in .venv-vision (the processors import torchvision; PyAV decodes): `.venv-vision/bin/python -m pytest -m vision`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import _media_inputs as mi

LOGIT_TOL, LOSS_TOL, GRAD_TOL = 1e-6, 1e-6, 2e-5
EXACT = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_audio", "qwen2_5_omni_thinker")


@pytest.fixture(scope="module")
def convs(tmp_path_factory):
    """Each family's conversations, processed once (lazily: a family's only when one of its tests runs)."""
    torch.set_num_threads(1)
    cache = {}
    directory = tmp_path_factory.mktemp("processors")

    def get(family):
        if family not in cache:
            cache[family] = mi.conversations(family, directory)
        return cache[family]
    return get


def _check_row(model, conversations, split=None):
    """Reference vs packed (one row, or micro-batches of `split` conversations accumulated): the worst errors."""
    total = mi.n_targets(model, conversations)
    want_loss, want, want_logits = mi.reference(model, conversations, total)
    split = split or [len(conversations)]
    bounds = [0, *torch.tensor(split).cumsum(0).tolist()]
    batches = [mi.micro_batch(model, conversations[a:b], total) for a, b in zip(bounds[:-1], bounds[1:])]
    loss, got = mi.packed_step(model, batches)
    logit_error = 0.0
    for batch, wants in zip(batches, [want_logits[a:b] for a, b in zip(bounds[:-1], bounds[1:])]):
        logits = mi.packed_logits(model, batch)
        cu = batch.cu_seqlens.tolist()
        logit_error = max(logit_error, *(float((logits[a:b] - w).abs().max()) / float(w.abs().max())
                                         for a, b, w in zip(cu[:-1], cu[1:], wants)))
    return logit_error, abs(loss - want_loss) / want_loss, mi.grad_error(got, want), want


@pytest.mark.vision
@pytest.mark.parametrize("family,freeze,split", [
    ("qwen2_vl", False, None), ("qwen2_5_vl", False, None), ("qwen3_vl", False, None), ("qwen3_vl_moe", False, None),
    ("qwen2_audio", False, None), ("qwen2_5_omni_thinker", False, None), ("qwen2_5_omni_thinker", True, None),
    ("qwen2_5_omni_thinker", False, [4, 5]),
], ids=lambda v: "towers-frozen" if v is True else "towers-trained" if v is False else
    "accumulated" if isinstance(v, list) else "one-row" if v is None else v)
def test_packed_row_equals_the_composite_per_conversation(convs, family, freeze, split):
    """Every conversation the family takes (text, images, videos, audios, a clip with its sound) in one packed row,
    or two micro-batches accumulated with the step's weights."""
    conversations = convs(family)
    model = mi.tiny_model(family, freeze_towers=freeze)
    logits, loss, grad, want = _check_row(model, conversations, split)
    assert logits <= LOGIT_TOL and loss <= LOSS_TOL and grad <= GRAD_TOL, (logits, loss, grad)
    kinds = {kind for c in conversations for kind, _ in c.items}
    towers = [name for name in want if ".visual." in name or ".audio_tower." in name]
    assert (not towers) if freeze else towers  # a trained tower's gradients are among those compared
    if not freeze:  # each kind's tower got a gradient
        assert ("video" not in kinds and "image" not in kinds) or any(".visual." in n for n in towers)
        assert "audio" not in kinds or any(".audio_tower." in n for n in towers)


@pytest.mark.vision
@pytest.mark.parametrize("family", EXACT)
def test_items_are_the_conversation_s_processor_output(convs, family):
    """The contract: each item's processor output alone, concatenated per kind in token order, is the processor's
    output on the whole conversation (what the self-check's reference forward is given, `forward_inputs`)."""
    model = mi.tiny_model(family)
    for c in convs(family):
        inputs = model.media.forward_inputs(c.input_ids, c.items, c.audio_in_video)
        media_keys = {k for k in c.reference if k not in ("input_ids", "attention_mask")}
        assert media_keys <= set(inputs), (c.name, media_keys - set(inputs))
        for key in media_keys:
            want, got = c.reference[key], inputs[key]
            assert (want == got) if not torch.is_tensor(want) else torch.equal(want, got), (c.name, key)


@pytest.mark.vision
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen2_5_omni_thinker"])
def test_positions_are_the_composite_s_own_per_conversation(convs, family):
    """The row's positions restart at each packed sequence and equal the composite's get_rope_index on each
    conversation alone with its processor output; video tokens get time positions (Qwen2.5-VL: seconds per grid x
    tokens per second; the Omni thinker: a clip and its sound interleaved on one time axis)."""
    conversations = convs(family)
    model = mi.tiny_model(family)
    batch = mi.micro_batch(model, conversations, 1)
    row = model.row_media(batch)
    body = model.lm.model
    cu = batch.cu_seqlens.tolist()
    for c, (a, b) in zip(conversations, zip(cu[:-1], cu[1:])):
        ref = c.reference
        if family == "qwen2_5_omni_thinker":
            audio = ref.get("feature_attention_mask")
            want, _ = body.get_rope_index(ref["input_ids"], ref.get("image_grid_thw"), ref.get("video_grid_thw"),
                                          ref["attention_mask"], c.audio_in_video,
                                          None if audio is None else audio.sum(-1), ref.get("video_second_per_grid"))
        else:
            want, _ = body.get_rope_index(ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
                                          image_grid_thw=ref.get("image_grid_thw"),
                                          video_grid_thw=ref.get("video_grid_thw"),
                                          **({"second_per_grid_ts": ref["second_per_grid_ts"]}
                                             if "second_per_grid_ts" in ref else {}))
        assert torch.equal(row.positions[:, a:b], want[:, 0]), c.name
    video = torch.zeros_like(row.feature_index, dtype=torch.bool)
    video[batch.input_ids[0] == model.media.token_ids["video"]] = True
    t = row.positions[0][video]
    assert len(t.unique()) < len(t) and not torch.equal(t, row.positions[1][video])  # frames share a time
    if family == "qwen2_5_omni_thinker":  # the clip with its sound: audio and frames on one axis, not one after another
        inside = next(k for k, c in enumerate(conversations) if c.audio_in_video)
        a, b = cu[inside], cu[inside + 1]
        ids = batch.input_ids[0, a:b]
        frames = row.positions[0, a:b][ids == model.media.token_ids["video"]]
        sound = row.positions[0, a:b][ids == model.media.token_ids["audio"]]
        assert sound.min() < frames.max()  # time-aligned: the audio starts before the last frame's time


@pytest.mark.vision
def test_positions_and_audio_in_video_change_the_loss(convs):
    """The checks can fail: the row with 1-D positions instead of the Omni thinker's, or with the clip's sound read
    as a separate audio (use_audio_in_video off), is far from the composite's forward (measured: 2e-4 and more of
    a loss near ln(vocab), against the 1e-6 tolerance; the sound's flag alone moves one conversation of nine:
    1.6e-5)."""
    conversations = convs("qwen2_5_omni_thinker")
    model = mi.tiny_model("qwen2_5_omni_thinker")
    total = mi.n_targets(model, conversations)
    want_loss, _, _ = mi.reference(model, conversations, total)
    batch = mi.micro_batch(model, conversations, total)
    row = model.row_media(batch)
    row.positions = batch.position_ids.expand(3, -1).clone()
    from train.attention.function import BACKENDS, AttentionContext, LayerKernels

    attn = AttentionContext.for_micro_batch(batch.cu_seqlens, "cpu", LayerKernels(every=BACKENDS["sdpa"]))
    with torch.no_grad():
        flat = float(model(batch.input_ids, batch.position_ids, batch.targets, batch.weights,
                           batch.target_categories, attn, media=row)[0])
    assert abs(flat - want_loss) / want_loss > 10 * LOSS_TOL
    batch.media.audio_in_video = [False] * len(conversations)
    with torch.no_grad():
        separate = float(model(batch.input_ids, batch.position_ids, batch.targets, batch.weights,
                               batch.target_categories, attn, media=model.row_media(batch))[0])
    assert abs(separate - want_loss) / want_loss > 10 * LOSS_TOL


@pytest.mark.vision
def test_mismatched_media_are_an_error(convs):
    conversations = convs("qwen2_5_omni_thinker")
    model = mi.tiny_model("qwen2_5_omni_thinker")
    batch = mi.micro_batch(model, conversations, 1)
    audios = [k for k, (kind, _) in enumerate(batch.media.items) if kind == "audio"]
    del batch.media.items[audios[-1]]  # one audio fewer than its tokens
    with pytest.raises(ValueError, match=r"the rows hold \d+ audio tokens, the \d+ audio items give \["):
        model.row_media(batch)
    batch = mi.micro_batch(model, conversations, 1)
    first = int(torch.isin(batch.input_ids[0], torch.tensor(mi.media_tokens(model))).nonzero()[0])
    assert first > int(batch.cu_seqlens[1])  # the first conversation is text: move its end into the first item
    batch = dataclasses.replace(batch, cu_seqlens=torch.tensor([0, first + 1, *batch.cu_seqlens[2:].tolist()],
                                                               dtype=torch.int32))
    with pytest.raises(ValueError, match="tokens straddle the packed sequences"):
        model.row_media(batch)


@pytest.mark.vision
def test_micro_batch_without_media_runs_each_tower_on_a_blank_item(convs):
    """A text-only micro-batch of a media run: every tower of the run's kinds still runs once (ZeRO-3 gathers and
    every rank's gradient reduction see the same modules), its gradients are exactly zero, the loss is the text
    path's."""
    model = mi.tiny_model("qwen2_5_omni_thinker")
    text = [c for c in convs("qwen2_5_omni_thinker") if not c.items]
    batch = mi.micro_batch(model, text, 100)
    loss, grads = mi.packed_step(model, [batch])
    towers = {n: g for n, g in grads.items() if ".visual." in n or ".audio_tower." in n}
    assert any(".visual." in n for n in towers) and any(".audio_tower." in n for n in towers)
    assert all(float(g.abs().max()) == 0.0 for g in towers.values())
    model.media = None  # the text path
    text_loss, _ = mi.packed_step(model, [dataclasses.replace(batch, media=None)])
    assert loss == pytest.approx(text_loss, rel=1e-6)


@pytest.mark.vision
def test_self_check_compares_media_sequences_with_the_composite(convs):
    """The start-up self-check's inputs (whole sequences of a micro-batch, each with its media) and its comparison:
    packed = the composite's own forward on each sequence with the processor-style inputs rebuilt from the items."""
    from train.attention.function import BACKENDS, LayerKernels
    from train.model.self_check import compare_packed_with_reference

    conversations = convs("qwen2_5_omni_thinker")
    model = mi.tiny_model("qwen2_5_omni_thinker")
    batch = mi.micro_batch(model, conversations, 1)
    seqs, media = model.media.sequences(batch, limit=len(conversations))
    assert [s.numel() for s in seqs] == [c.input_ids.numel() for c in conversations]
    assert [m is not None and m.audio_in_video_of(0) for m in media] == [c.audio_in_video for c in conversations]
    result = compare_packed_with_reference(model, seqs, LayerKernels(every=BACKENDS["sdpa"]), media=media)
    assert result.ok and result.loss_error <= LOSS_TOL and result.grad_error <= GRAD_TOL, result.describe()


@pytest.mark.vision
@pytest.mark.multiprocess
def test_sequence_parallel_video_rows_equal_one_process(convs, tmp_path):
    """A row of video conversations (Qwen2.5-VL clips; the Omni thinker's with a clip's sound inside) over two
    ranks — Ulysses, the torch ring (contiguous) and the zigzag layouts — equals the single-process packed step,
    with clips straddling the rank boundary whose temporal patches each rank encodes only where its tokens are."""
    from tests._media_worker import CASES, save_conversations, worker
    from tests._sp_worker import spawned_results

    for family in CASES:
        save_conversations(convs(family), tmp_path / f"{family}.pt")
    results = spawned_results(worker, 2, tmp_path)
    assert set(results) == {f"{family}/{layout}" for family in CASES for layout in ("ulysses", "torch", "zigzag")}
    for name, r in results.items():
        assert r["loss"] <= LOSS_TOL and r["grad"] <= GRAD_TOL, (name, r)
        assert r["split_clip"], name  # a clip's temporal patches divided between the ranks
        assert r["encoded_patches"] < 2 * r["row_patches"], name  # not every clip encoded on both ranks


# ---------------------------------------------------------------------------------------------- refusals
def _media_universe() -> dict[str, set[str]]:
    """Every model type of transformers' image-text-to-text, multimodal-LM, seq2seq-causal-LM and speech-seq2seq
    mappings whose class takes video or audio (train/model/support.py's MEDIA_ARGUMENTS): the kinds it takes."""
    import inspect

    from transformers.models.auto import modeling_auto as auto

    from train.model.support import MEDIA_ARGUMENTS

    out: dict[str, set[str]] = {}
    for mapping in (auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, auto.MODEL_FOR_MULTIMODAL_LM_MAPPING,
                    auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING):
        for config_class, model_class in mapping.items():
            parameters = inspect.signature(model_class.forward).parameters
            kinds = {kind for kind in ("video", "audio") if any(a in parameters for a in MEDIA_ARGUMENTS[kind])}
            if kinds:
                out.setdefault(config_class.model_type, set()).update(kinds)
    return out


def test_every_composite_that_takes_video_or_audio_is_exact_or_refused():
    """Each is in the family table and, from its config alone, either trains that kind exactly (a `MediaInputs`
    naming it) or is refused with one line naming the family, the kind and the reason."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from train.families import FAMILIES, MediaInputs
    from train.model.support import UnsupportedModelError, check_media_support

    universe = _media_universe()
    assert {"qwen2_5_vl", "qwen2_audio", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "voxtral", "gemma3n",
            "llava_onevision", "llava_next_video", "granite_speech", "phi4_multimodal"} <= set(universe)
    missing = sorted(set(universe) - set(FAMILIES))
    assert not missing, f"composites taking video or audio with no spec in train/families.py: {missing}"
    exact = {}
    for model_type, kinds in sorted(universe.items()):
        for kind in sorted(kinds):
            try:
                spec = check_media_support(CONFIG_MAPPING[model_type](), [kind])
            except UnsupportedModelError as err:
                line = str(err)
                assert "\n" not in line and line.startswith(f"model family '{model_type}' cannot")
                continue
            assert isinstance(spec, MediaInputs) and kind in spec.kinds
            exact.setdefault(model_type, set()).add(kind)
    assert exact == {"qwen2_vl": {"video"}, "qwen2_5_vl": {"video"}, "qwen3_vl": {"video"},
                     "qwen3_vl_moe": {"video"}, "qwen2_audio": {"audio"},
                     "qwen2_5_omni_thinker": {"video", "audio"}}


@pytest.mark.parametrize("model_type,kind,reason", [
    ("qwen2_5_vl", "audio", "its forward takes no audio input"),
    ("llava_onevision", "video", "PackSFT trains video conversations on the composites whose tower"),
    ("qwen2_audio", "video", "its forward takes no video input"),
    ("voxtral", "audio", "an audio-language composite"),
    ("whisper", "audio", "a speech encoder-decoder: the audio reaches the text decoder through cross-attention"),
    ("qwen2_5_omni", "audio", "the whole Omni model"),
    ("qwen2", "audio", "a text-only model: it has no audio tower"),
])
def test_media_refusals_name_the_reason(model_type, kind, reason):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from train.model.support import UnsupportedModelError, check_media_support

    with pytest.raises(UnsupportedModelError, match=f"model family '{model_type}' cannot .*{reason}"):
        check_media_support(CONFIG_MAPPING[model_type](), [kind])


def test_trainer_refuses_audio_before_any_weight_loads(tmp_path, monkeypatch):
    """Data holding audios and a Qwen2.5-VL checkpoint (config.json alone): the trainer stops at the media check."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import train.steps.online
    from tests._train_helpers import random_rows, write_config, write_packed
    from train.config.sections import load_config
    from train.model.support import UnsupportedModelError
    from train.trainer import Trainer

    def with_audio(*args, **kwargs):  # the dataset as a media store of audios opens (its meta.json counts)
        dataset = open_dataset(*args, **kwargs)
        dataset.has_media = True
        dataset.meta.setdefault("counts", {})["audios"] = 2
        return dataset

    open_dataset = train.steps.online.open_train_dataset
    monkeypatch.setattr(train.steps.online, "open_train_dataset", with_audio)
    model_dir = tmp_path / "model"
    CONFIG_MAPPING["qwen2_5_vl"]().save_pretrained(model_dir)
    packed = write_packed(tmp_path / "packed", random_rows(0, 2))
    config = write_config(tmp_path / "train.yaml", data_path=str(packed), model_path=str(model_dir),
                          output_dir=str(tmp_path / "out"), max_steps=1, tokenizer_mismatch="warn")
    with pytest.raises(UnsupportedModelError, match="model family 'qwen2_5_vl' cannot train on audio conversations "
                                                    r"\(the data holds audios\): its forward takes no audio input"):
        Trainer(load_config(config))


def test_towers_freeze_by_kind():
    """freeze_vision_tower / freeze_audio_tower / freeze_multi_modal_projector each freeze their modules only."""
    from transformers import AutoModelForMultimodalLM

    from train.model.composite import freeze_towers

    lm = AutoModelForMultimodalLM.from_config(mi.tiny_config("qwen2_audio"))
    assert freeze_towers(lm, vision_tower=True, projector=False, audio_tower=False) == []
    assert freeze_towers(lm, vision_tower=False, projector=True, audio_tower=False) == ["model.multi_modal_projector"]
    assert freeze_towers(lm, vision_tower=False, projector=False, audio_tower=True) == ["model.audio_tower"]
    lm = AutoModelForMultimodalLM.from_config(mi.tiny_config("qwen2_5_omni_thinker"))
    assert freeze_towers(lm, vision_tower=True, projector=False, audio_tower=False) == ["model.visual"]
    assert freeze_towers(lm, vision_tower=False, projector=False, audio_tower=True) == ["model.audio_tower"]


def test_the_data_side_s_media_loader_output_becomes_the_micro_batch_s():
    """make_batch's `media=` loader (data/shards/media.py's MediaLoader: per packed sequence its items in token order,
    a video with its sound track as one item, and `rope`) -> the MediaBatch: the sound track becomes the audio item
    right after its video, one use_audio_in_video flag per sequence; the data's kinds from its meta.json counts."""
    from types import SimpleNamespace

    import numpy as np

    from train.model.media_batch import dataset_media_kinds
    from train.steps.batch import StepTotals, make_batch

    image = {"pixel_values": torch.zeros(4, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    clip = {"pixel_values_videos": torch.zeros(8, 8), "video_grid_thw": torch.tensor([[2, 2, 2]]),
            "video_second_per_grid": torch.tensor([1.0]), "input_features": torch.zeros(1, 128, 40),
            "feature_attention_mask": torch.ones(1, 40, dtype=torch.long)}
    loaded = [SimpleNamespace(items=[SimpleNamespace(kind="image", inputs=image, audio_in_video=False)], rope={}),
              SimpleNamespace(items=[], rope={}),
              SimpleNamespace(items=[SimpleNamespace(kind="video", inputs=clip, audio_in_video=True)],
                              rope={"use_audio_in_video": True})]
    asked = []

    def loader(sequences):
        asked.append(sequences)
        return loaded

    def row(lengths, media):
        n = sum(lengths)
        labels = np.arange(n) % 7
        labels[np.cumsum([0, *lengths[:-1]])] = -100
        return {"input_ids": np.arange(n) % 7, "labels": labels, "category_ids": np.zeros(n, np.int16),
                "turn_ids": (labels >= 0).astype(np.int16), "seq_lens": np.array(lengths), "media": media}

    rows = [row([5, 4], [["stored image"], []]), row([6], [["stored clip"]])]
    batch = make_batch(rows, StepTotals(100, 100, 100), "token", media=loader)
    assert asked == [[["stored image"], [], ["stored clip"]]]  # each packed sequence's stored items, in row order
    media = batch.media
    assert [kind for kind, _ in media.items] == ["image", "video", "audio"] and media.audio_in_video == [False, False, True]
    assert set(media.items[1][1]) == {"pixel_values_videos", "video_grid_thw", "video_second_per_grid"}
    assert set(media.items[2][1]) == {"input_features", "feature_attention_mask"}
    assert make_batch([row([5], [[]])], StepTotals(100, 100, 100), "token", media=loader).media is None

    def store(counts):
        return SimpleNamespace(has_media=True, meta={"counts": counts})
    assert dataset_media_kinds(store({"images": 3, "videos": 0, "audios": 0}), None) == ("image",)
    assert dataset_media_kinds(store({"videos": 2, "videos_with_audio": 1}), store({"images": 1})) == (
        "image", "video", "audio")
    assert dataset_media_kinds(SimpleNamespace(has_images=True, meta={})) == ("image",)  # an image store of before
    assert dataset_media_kinds(SimpleNamespace(meta={"counts": {"images": 1}})) == ()  # text shards


@pytest.mark.vision
def test_lora_on_the_decoder_trains_media_rows_exactly(convs):
    """LoRA (train/model/lora.py, as `lora_rank` > 0 builds it) adapts the text decoder only; the towers run frozen
    through the adapted composite, and the packed row equals its forward per conversation (adapter gradients)."""
    from train.families import FAMILIES
    from train.model.lora import apply_lora
    from train.model.packed import PackedCausalLM

    conversations = convs("qwen2_5_omni_thinker")
    base = mi.tiny_model("qwen2_5_omni_thinker")
    lm = apply_lora(base.lm, 4, 8.0)
    model = PackedCausalLM(lm, 64, 1, media=FAMILIES["qwen2_5_omni_thinker"].media,
                           media_kinds=mi.KINDS["qwen2_5_omni_thinker"])
    logits, loss, grad, want = _check_row(model, conversations)
    assert logits <= LOGIT_TOL and loss <= LOSS_TOL and grad <= GRAD_TOL, (logits, loss, grad)
    assert want and all("lora_" in name and ".language_model." in name for name in want)
