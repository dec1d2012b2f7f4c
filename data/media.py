"""Media conversations (images, videos, audio): references in records, the processor that expands their tokens, and
what the shards keep of them.

A canonical record with media holds per kind a list (`images`, `videos`, `audios`: paths or `data:` URIs, in
order) and one placeholder per item in its user messages (`<image>`, `<video>`, `<audio>`: LLaMA-Factory's
convention; OpenAI / transformers content parts are converted to it by the preprocess stage). A video whose sound
track belongs to its token run (LLaMA-Factory's audio-in-video records name the same file in `videos` and `audios`,
its `<audio>` after its `<video>`) is listed in `audio_in_video` (indices into `videos`), its `<audio>` and audio
entry folded into it at preprocess (`fold_audio_in_video`).

The tokenize stage renders such a record with the processor's chat template (each placeholder becomes the template's
media part), and the real `transformers` processor expands each item's token run: `expand` decodes the items
(data/shards/decode.py), runs the processor on the render and the items and applies the processor's own
replacements (`return_text_replacement_offsets`) to the render, so the token ids are exactly
`processor(text=rendered, images=..., videos=..., audio=...)["input_ids"]` (checked for every record).

Nothing here imports PIL, torchvision, PyAV, soundfile or a processor at import time: text-only runs never need them.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data.records import MEDIA_KINDS, PLACEHOLDERS, RecordError
from data.shards.dataset import AUDIO_IN_VIDEO, StoredMedia
from data.shards.processor import MediaProcessor

PLACEHOLDER_RE = re.compile("|".join(re.escape(p) for p in PLACEHOLDERS.values()))
KIND_OF = {placeholder: kind for kind, placeholder in PLACEHOLDERS.items()}


# ---------------------------------------------------------------------------------------------- records
def resolve_media(kind: str, ref: Any, base_dir: str, source: str, where: str, roots: tuple[str, ...] = ()) -> str:
    """One media reference of a raw record -> what canonical records hold: an absolute path (a relative one is
    relative to the data file's directory, as in LLaMA-Factory) that exists, or a `data:` URI. Accepts a string
    or `{"path": ...}` / `{"url": ...}` / `{"bytes": ...}` (datasets' Image / Video / Audio features).

    A path (relative with `../`, absolute, `file://`) must resolve, after symlinks, under `base_dir` or one of
    `roots` (the config's `image_root`, resolved): a data file cannot make the pipeline copy any readable file of
    the machine into the shards. Else a RecordError `{kind}_outside_root` naming the path and the fix."""
    if isinstance(ref, dict):
        if isinstance(ref.get("bytes"), (bytes, bytearray)) and ref["bytes"]:
            return "data:application/octet-stream;base64," + base64.b64encode(ref["bytes"]).decode()
        ref = ref.get("path") or ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise RecordError(source, where, f"expected a{'n' if kind[0] in 'aeiou' else ''} {kind} path or data: URI, "
                          f"got {ref!r}", f"bad_{kind}")
    if ref.startswith("data:"):
        return ref
    if ref.startswith(("http://", "https://")):
        raise RecordError(source, where, f"{ref}: remote {kind}s are not fetched; download them and give the path",
                          f"bad_{kind}")
    path = os.path.abspath(os.path.join(base_dir, ref.removeprefix("file://")))
    real, allowed = os.path.realpath(path), [os.path.realpath(base_dir or "."), *roots]
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in allowed):
        via = f" (via {path})" if real != path else ""
        roots_note = f" nor under image_root {', '.join(roots)}" if roots else ""
        raise RecordError(source, where, f"{kind} {ref} resolves to {real}{via}, which is not under the data file's "
                          f"directory {allowed[0]}{roots_note}: add the directory holding the {kind}s to image_root "
                          "in the data config to read them", f"{kind}_outside_root")
    if not os.path.isfile(path):
        raise RecordError(source, where, f"{kind} file {path} does not exist", f"missing_{kind}")
    return path


def media_order(messages: list[dict]) -> list[tuple[str, int]]:
    """(kind, index in its list) of every placeholder of the messages, in the order they are rendered."""
    seen = dict.fromkeys(PLACEHOLDERS, 0)
    order = []
    for msg in messages:
        for match in PLACEHOLDER_RE.finditer(msg["content"]):
            kind = KIND_OF[match.group()]
            order.append((kind, seen[kind]))
            seen[kind] += 1
    return order


def fold_audio_in_video(rec: dict, source: str) -> dict:
    """LLaMA-Factory's audio-in-video layout -> canonical: an `<audio>` whose file is a video of the record named
    before it in the same message (`<video><audio>` with one file in `videos` and `audios`) is that video's sound
    track: its placeholder and audio entry go, the video's index goes into `audio_in_video`. The same file as audio
    anywhere else is an error (`audio_in_video_placement`). `rec` has resolved paths; returns it updated."""
    videos, audios = rec.get("videos") or [], rec.get("audios") or []
    if not isinstance(videos, list) or not isinstance(audios, list) or not set(videos) & set(audios) - {None}:
        return rec
    messages = rec["messages"]
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        return rec  # validation names what is wrong with them
    folded, dropped, v, a = [], set(), 0, 0
    out = []
    for i, msg in enumerate(messages):
        open_videos: list[int] = []  # videos of this message still waiting for their sound track

        def replace(match: re.Match) -> str:
            nonlocal v, a
            kind = KIND_OF[match.group()]
            if kind == "video":
                open_videos.append(v)
                v += 1
            elif kind == "audio":
                k, a = a, a + 1
                owner = next((j for j in open_videos if k < len(audios) and j < len(videos)
                              and videos[j] == audios[k]), None)
                if owner is not None:
                    open_videos.remove(owner)
                    folded.append(owner)
                    dropped.add(k)
                    return ""
                if k < len(audios) and audios[k] in videos:
                    raise RecordError(source, f"audios[{k}]", f"{audios[k]} is a video of this record (its sound "
                                      f"track): its {PLACEHOLDERS['audio']} must follow that video's "
                                      f"{PLACEHOLDERS['video']} in the same message", "audio_in_video_placement")
            return match.group()

        content = PLACEHOLDER_RE.sub(replace, msg["content"]) if msg.get("role") == "user" else msg["content"]
        out.append({**msg, "content": content} if content != msg["content"] else msg)
    if not folded:
        return rec
    return {**rec, "messages": out, "audios": [x for k, x in enumerate(audios) if k not in dropped],
            "audio_in_video": sorted(folded)}


def with_media_parts(messages: list[dict], record: dict) -> list[dict]:
    """Messages as the processor's chat template takes them: a user message holding placeholders becomes a list
    of parts (`{"type": kind, kind: reference}` at each placeholder, text parts between), the part the templates of
    the Qwen processors render as the kind's media tokens."""
    out, seen = [], dict.fromkeys(PLACEHOLDERS, 0)
    for msg in messages:
        content = msg["content"]
        if msg["role"] != "user" or not PLACEHOLDER_RE.search(content):
            out.append(msg)
            continue
        parts: list[dict] = []
        prev = 0
        for match in PLACEHOLDER_RE.finditer(content):
            if match.start() > prev:
                parts.append({"type": "text", "text": content[prev:match.start()]})
            kind = KIND_OF[match.group()]
            parts.append({"type": kind, kind: record[MEDIA_KINDS[kind]][seen[kind]]})
            seen[kind] += 1
            prev = match.end()
        if prev < len(content):
            parts.append({"type": "text", "text": content[prev:]})
        out.append({**msg, "content": parts})
    return out


def read_media_bytes(kind: str, ref: str, source: str, where: str) -> bytes:
    """The encoded bytes of a canonical media reference (a path or a `data:` URI)."""
    try:
        if ref.startswith("data:"):
            header, _, payload = ref.partition(",")
            return base64.b64decode(payload, validate=True) if header.endswith(";base64") else payload.encode()
        return Path(ref).read_bytes()
    except (OSError, binascii.Error, ValueError) as exc:
        raise RecordError(source, where, f"cannot read {kind} {ref[:120]}: {exc}", f"bad_{kind}") from None


# ---------------------------------------------------------------------------------------------- the processor
@dataclass
class Expanded:
    """A render with each item's placeholder replaced by the processor's token run: the text, the character spans
    of the assistant turns and of the media runs (one per item, in token order), the processor's token ids and the
    items as the shards keep them (their `n_tokens` filled in once the text is encoded)."""
    text: str
    spans: list[tuple[int, int]]
    media_spans: list[tuple[int, int]]
    reference_ids: list[int]
    media: list[StoredMedia]


def expand(mp: MediaProcessor, text: str, spans: list[tuple[int, int]], record: dict, source: str) -> Expanded:
    """Read and decode the record's media, run the processor on the render and them, and apply the processor's
    replacements to the render (assistant spans shifted). A kind the processor does not take is `unsupported_media`;
    a record mixing videos with and without their sound track, under a processor that interleaves them, is
    `audio_in_video_mixed` (its models take `use_audio_in_video` per conversation)."""
    order = media_order(record["messages"])
    with_audio = set(record.get("audio_in_video") or ())
    taken = mp.kinds()
    for kind, k in order:
        if kind not in taken:
            raise RecordError(source, f"{MEDIA_KINDS[kind]}[{k}]", f"the processor {type(mp.processor).__name__} "
                              f"of {mp.path} takes no {kind} (it takes {', '.join(taken) or 'text only'})",
                              "unsupported_media")
    videos = [k for kind, k in order if kind == "video"]
    if with_audio:
        if not mp.interleaves_audio_in_video:
            raise RecordError(source, "audio_in_video", f"the processor {type(mp.processor).__name__} has no "
                              "audio-in-video (videos with their sound track): use an omni model's processor",
                              "unsupported_media")
        if len(with_audio) != len(videos):
            raise RecordError(source, "audio_in_video", f"{len(with_audio)} of the record's {len(videos)} videos "
                              "carry their sound track: the omni models take audio-in-video per conversation, for "
                              "all its videos or none", "audio_in_video_mixed")
    datas, items = [], []
    for kind, k in order:
        where = f"{MEDIA_KINDS[kind]}[{k}]"
        data = read_media_bytes(kind, record[MEDIA_KINDS[kind]][k], source, where)
        datas.append(data)
        items.append(mp.decode(kind, data, source, where, with_audio=kind == "video" and k in with_audio))
    try:
        out = mp.inputs(items, text=[text], return_text_replacement_offsets=True)
    except RecordError:
        raise
    except Exception as exc:  # the processor rejects this record (e.g. an image too small to patch)
        raise RecordError(source, "messages", f"the processor failed on the record's media: {type(exc).__name__}: "
                          f"{exc}", "bad_media") from None
    replacements = out["text_replacement_offsets"][0]
    if [r["type"] for r in replacements] != [kind for kind, _ in order]:
        raise RecordError(source, "messages", f"the processor replaced {[r['type'] for r in replacements]} where "
                          f"the record holds {[kind for kind, _ in order]} (the chat template renders other media "
                          "parts)", "media_count_mismatch")
    pieces, prev, shift, media_spans = [], 0, [], []
    for r in replacements:
        (a, b), (na, nb) = r["span"], r["new_span"]
        pieces += [text[prev:a], r["replacement"]]
        prev = b
        shift.append((b, len(r["replacement"]) - (b - a)))
        media_spans.append((na, nb))
    pieces.append(text[prev:])

    def moved(pos: int) -> int:
        return pos + sum(delta for end, delta in shift if end <= pos)

    media, slots = [], dict.fromkeys(("image", "video", "audio"), 0)  # each kind's row in the outputs
    for item, data in zip(items, datas):
        grid, frames = (0, 0, 0), 0
        if item.kind != "audio":
            grid = tuple(int(v) for v in out[f"{item.kind}_grid_thw"][slots[item.kind]])
            slots[item.kind] += 1
        if item.kind == "audio" or item.audio is not None:  # an audio slot: a clip, or a video's sound track
            frames = int(sum(out["feature_attention_mask"][slots["audio"]]))
            slots["audio"] += 1
        media.append(StoredMedia(item.kind, data, grid, 0, AUDIO_IN_VIDEO if item.audio is not None else 0,
                                 frames, int(round(item.seconds * 1000))))
    return Expanded("".join(pieces), [(moved(a), moved(b)) for a, b in spans], media_spans,
                    [int(t) for t in out["input_ids"][0]], media)
