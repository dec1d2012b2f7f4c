"""Image conversations: image references in records, the processor that counts image tokens, and the images of
a micro-batch.

A canonical record with images holds `images` (a list of paths or `data:` URIs, in order) and one `<image>`
placeholder per image in its user messages (LLaMA-Factory's convention; OpenAI image parts are converted to it
by the preprocess stage). The tokenize stage renders such a record with the processor's chat template (the
placeholders become the template's image parts), and the real `transformers` processor expands each image's
token run: `expand` applies the processor's own replacements (`return_text_replacement_offsets`) to the render,
so the token ids are exactly `processor(text=rendered, images=...)["input_ids"]` (checked for every record).

The shards keep each image's encoded bytes (the file as read, not re-encoded) and the patch grid the processor
gave it (benchmarks/bench_images.py: the preprocessed patches of a 300x168 JPEG are 100x its bytes); the
trainer's `ImageLoader` runs the same image processor on them for each micro-batch.

Nothing here imports PIL, torchvision or a processor at import time: text-only runs never need them.
"""
from __future__ import annotations

import base64
import binascii
import io
import multiprocessing
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import ConfigError
from data.records import IMAGE_PLACEHOLDER, RecordError
from data.shards.dataset import StoredImage

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# the default `image_pixel_limit` (data/config.py): PIL's own decompression-bomb bound (2**30 // 4 // 3 pixels),
# also what a dataset whose meta.json predates the key was decoded under
DEFAULT_PIXEL_LIMIT = 89_478_485
VISION_SETUP = ("image conversations need torchvision and Pillow, which load only next to PyPI's (CUDA) torch "
                "build: run `bash scripts/setup_vision.sh` (builds .venv-vision, runs on CPU too) or, beside a CUDA "
                "torch, `pip install -r requirements-vision.txt`")
VISION_VENV = Path(__file__).resolve().parents[1] / ".venv-vision"


def vision_setup_message() -> str:
    """What to do when torchvision or Pillow does not load here: where the image environment is built already
    (scripts/setup_vision.sh) but this is another interpreter, run the command again with `PACKSFT_VENV=.venv-vision`;
    else build it."""
    python = VISION_VENV / "bin" / "python"
    if python.exists() and Path(os.path.realpath(sys.prefix)) != Path(os.path.realpath(VISION_VENV)):
        return ("image conversations need torchvision and Pillow, which this Python environment "
                f"({sys.prefix}) lacks; the image environment is built ({VISION_VENV}): run the command with "
                "the prefix `PACKSFT_VENV=.venv-vision`, e.g. `PACKSFT_VENV=.venv-vision sh data_process.sh CONFIG` "
                "or `PACKSFT_VENV=.venv-vision sh train.sh CONFIG`")
    return VISION_SETUP


# ---------------------------------------------------------------------------------------------- records
def resolve_image(ref: Any, base_dir: str, source: str, where: str, roots: tuple[str, ...] = ()) -> str:
    """One image reference of a raw record -> what canonical records hold: an absolute path (a relative one is
    relative to the data file's directory, as in LLaMA-Factory) that exists, or a `data:` URI. Accepts a string
    or `{"path": ...}` / `{"url": ...}` / `{"bytes": ...}` (datasets' Image feature).

    A path (relative with `../`, absolute, `file://`) must resolve, after symlinks, under `base_dir` or one of
    `roots` (the config's `image_root`, resolved): a data file cannot make the pipeline copy any readable file of
    the machine into the shards. Else a RecordError `image_outside_root` naming the path and the fix."""
    if isinstance(ref, dict):
        if isinstance(ref.get("bytes"), (bytes, bytearray)) and ref["bytes"]:
            return "data:application/octet-stream;base64," + base64.b64encode(ref["bytes"]).decode()
        ref = ref.get("path") or ref.get("url")
    if not isinstance(ref, str) or not ref:
        raise RecordError(source, where, f"expected an image path or data: URI, got {ref!r}", "bad_image")
    if ref.startswith("data:"):
        return ref
    if ref.startswith(("http://", "https://")):
        raise RecordError(source, where, f"{ref}: remote images are not fetched; download them and give the path",
                          "bad_image")
    path = os.path.abspath(os.path.join(base_dir, ref.removeprefix("file://")))
    real, allowed = os.path.realpath(path), [os.path.realpath(base_dir or "."), *roots]
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in allowed):
        via = f" (via {path})" if real != path else ""
        roots_note = f" nor under image_root {', '.join(roots)}" if roots else ""
        raise RecordError(source, where, f"image {ref} resolves to {real}{via}, which is not under the data file's "
                          f"directory {allowed[0]}{roots_note}: add the directory holding the images to image_root "
                          "in the data config to read them", "image_outside_root")
    if not os.path.isfile(path):
        raise RecordError(source, where, f"image file {path} does not exist", "missing_image")
    return path


def with_image_parts(messages: list[dict]) -> list[dict]:
    """Messages as the processor's chat template takes them: a user message holding placeholders becomes a list
    of parts (`{"type": "image"}` at each placeholder, text parts between)."""
    out = []
    for msg in messages:
        content = msg["content"]
        if msg["role"] != "user" or IMAGE_PLACEHOLDER not in content:
            out.append(msg)
            continue
        parts: list[dict] = []
        for k, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**msg, "content": parts})
    return out


def read_image_bytes(ref: str, source: str, where: str) -> bytes:
    """The encoded bytes of a canonical image reference (a path or a `data:` URI)."""
    try:
        if ref.startswith("data:"):
            header, _, payload = ref.partition(",")
            return base64.b64decode(payload, validate=True) if header.endswith(";base64") else payload.encode()
        return Path(ref).read_bytes()
    except (OSError, binascii.Error, ValueError) as exc:
        raise RecordError(source, where, f"cannot read image {ref[:120]}: {exc}", "bad_image") from None


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError(vision_setup_message()) from None
    Image.MAX_IMAGE_PIXELS = None  # the bound is `decode_image`'s pixel_limit, checked from the header alike
    return Image


def decode_image(data: bytes, source: str, where: str, pixel_limit: int | None = DEFAULT_PIXEL_LIMIT):
    """Encoded bytes -> the PIL image as Pillow opens the file (decoded, in its own mode), which is what
    `processor(images=Image.open(path))` receives: the image processor's own conversion (`do_convert_rgb`:
    transformers' `convert_to_rgb`, which composites transparency onto white, as Qwen's own preprocessing does) then
    makes the pixel values exactly the processor's for that file. Converting to RGB here would drop the alpha channel
    instead: a transparent pixel would keep its hidden colour (often black) where the processor gives white. EXIF
    orientation is not applied (neither does the processor on an opened image, nor LLaMA-Factory).
    An image of more than `pixel_limit` pixels (width x height from its header: PIL's `open` reads no more) is a
    RecordError `image_too_large` before anything is decoded (None: no bound)."""
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(data))  # in memory: no file handle to close
        if pixel_limit is not None and img.width * img.height > pixel_limit:
            raise RecordError(source, where, f"image of {img.width}x{img.height} = {img.width * img.height:,} "
                              f"pixels exceeds image_pixel_limit={pixel_limit:,} (read from its header, not "
                              "decoded): downscale it, or raise image_pixel_limit in the data config",
                              "image_too_large")
        img.load()
        return img
    except RecordError:
        raise
    except Exception as exc:  # PIL raises several types (UnidentifiedImageError, OSError, DecompressionBombError)
        raise RecordError(source, where, f"unreadable image: {type(exc).__name__}: {exc}", "bad_image") from None


# ---------------------------------------------------------------------------------------------- the processor
def is_processor_dir(path: str) -> bool:
    return any((Path(path) / name).is_file() for name in PROCESSOR_FILES)


def processor_chat_template(path: str) -> str | None:
    """The processor's own chat template (chat_template.json / .jinja of a processor directory), which renders
    image parts; None when the directory has none."""
    import orjson

    jinja, js = Path(path) / "chat_template.jinja", Path(path) / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if js.is_file():
        template = orjson.loads(js.read_bytes()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def pixel_kwargs(processor, min_pixels: int | None, max_pixels: int | None) -> dict:
    """`image_min_pixels` / `image_max_pixels` as the image processor's `size` (a pixel budget: Qwen2-VL's
    family); {} when neither is set."""
    if min_pixels is None and max_pixels is None:
        return {}
    image_processor = getattr(processor, "image_processor", processor)
    size = getattr(image_processor, "size", None)
    edge = (lambda key: size.get(key)) if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    shortest, longest = edge("shortest_edge"), edge("longest_edge")
    if shortest is None or longest is None:
        raise ConfigError(f"image_min_pixels / image_max_pixels: the image processor {type(image_processor).__name__} "
                          "has no pixel budget (size.shortest_edge / longest_edge in pixels, as Qwen2-VL's)")
    return {"size": {"shortest_edge": min_pixels if min_pixels is not None else shortest,
                     "longest_edge": max_pixels if max_pixels is not None else longest}}


def load_processor(path: str):
    """transformers' AutoProcessor of `path`, or a ConfigError saying what to install / set."""
    if not is_processor_dir(path):
        raise ConfigError(f"tokenizer_path: {path} holds no processor ({' or '.join(PROCESSOR_FILES)}); records "
                          "with images need the model's processor directory (e.g. a Qwen2.5-VL checkpoint)")
    _pil()
    try:
        import torchvision  # noqa: F401  (the Qwen2-VL processors import it; fail here with the fix)
    except Exception as exc:  # ImportError, or RuntimeError "operator torchvision::nms does not exist"
        raise ConfigError(f"{vision_setup_message()} ({type(exc).__name__}: {exc})") from None
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a bad directory
        raise ConfigError(f"tokenizer_path: cannot load a processor from {path}: {type(exc).__name__}: {exc}") from None


@dataclass
class Expanded:
    """A render with each image's placeholder replaced by the processor's token run: the text, the character
    spans of the assistant turns and of the image runs, the processor's token ids and the images."""
    text: str
    spans: list[tuple[int, int]]
    image_spans: list[tuple[int, int]]
    reference_ids: list[int]
    images: list[StoredImage]  # as the shards keep them


@dataclass
class Vision:
    """A tokenize process's processor (loaded on the first record with images) and its pixel limits."""
    path: str
    min_pixels: int | None = None
    max_pixels: int | None = None
    pixel_limit: int | None = DEFAULT_PIXEL_LIMIT  # the largest image decoded (`decode_image`)
    _processor: Any = field(default=None, init=False, repr=False)
    _kwargs: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def processor(self):
        if self._processor is None:
            self._processor = load_processor(self.path)
            if multiprocessing.parent_process() is not None:  # a pool worker: one core each, as its tokenizer
                import torch

                torch.set_num_threads(1)
            self._kwargs = pixel_kwargs(self._processor, self.min_pixels, self.max_pixels)
        return self._processor

    @property
    def images_kwargs(self) -> dict:
        """The image processor's keyword arguments for the pixel limits (`pixel_kwargs`)."""
        self.processor  # noqa: B018  (loads it, and the kwargs with it)
        return self._kwargs

    @property
    def image_token_id(self) -> int:
        processor = self.processor
        return int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))

    def expand(self, text: str, spans: list[tuple[int, int]], refs: list[str], source: str) -> Expanded:
        """Read the record's images (`refs`), run the processor on the render and its images, and apply the
        processor's replacements to the render (assistant spans shifted)."""
        processor = self.processor
        datas = [read_image_bytes(ref, source, f"images[{k}]") for k, ref in enumerate(refs)]
        pil = [decode_image(data, source, f"images[{k}]", self.pixel_limit) for k, data in enumerate(datas)]
        try:
            out = processor(text=[text], images=pil, return_text_replacement_offsets=True, **self.images_kwargs)
        except Exception as exc:  # the processor rejects this record (e.g. an image too small to patch)
            raise RecordError(source, "images", f"the processor failed: {type(exc).__name__}: {exc}",
                              "bad_image") from None
        replacements = [r for r in out["text_replacement_offsets"][0] if r["type"] == "image"]
        if len(replacements) != len(refs):
            raise RecordError(source, "images", f"the processor replaced {len(replacements)} image tokens for "
                              f"{len(refs)} images (the chat template renders another number of image parts)",
                              "image_count_mismatch")
        pieces, prev, shift, image_spans = [], 0, [], []
        for r in replacements:
            (a, b), (na, nb) = r["span"], r["new_span"]
            pieces += [text[prev:a], r["replacement"]]
            prev = b
            shift.append((b, len(r["replacement"]) - (b - a)))
            image_spans.append((na, nb))
        pieces.append(text[prev:])

        def moved(pos: int) -> int:
            return pos + sum(delta for end, delta in shift if end <= pos)

        grids = out.get("image_grid_thw")
        ids = [int(t) for t in out["input_ids"][0]]
        token_id = self.image_token_id
        counts = [r["replacement"].count(processor.image_token) for r in replacements]
        images = [StoredImage(data, tuple(int(v) for v in grids[k]) if grids is not None else (0, 0, 0), counts[k])
                  for k, data in enumerate(datas)]
        if sum(counts) != ids.count(token_id):
            raise RecordError(source, "images", "the processor's image token count differs from its replacements",
                              "image_count_mismatch")
        return Expanded("".join(pieces), [(moved(a), moved(b)) for a, b in spans], image_spans, ids, images)
