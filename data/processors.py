"""Processor directories of the released multimodal Qwen checkpoints, written offline:
`python -m data.processors NAME OUT_DIR [--tokenizer DIR]`.

No model hub is reachable from the machines this project runs on, and a test or an example must not download one.
What a processor directory holds is small and public: the tokenizer's BPE files (identical for Qwen2, Qwen2.5 and
Qwen3: vocab.json and merges.txt, taken from `--tokenizer`), the special tokens at their ids, the chat template and
the image / video / audio preprocessing values. `RELEASES` holds them per checkpoint with where each value comes
from; `write_processor` writes them in the layout transformers loads (`AutoProcessor.from_pretrained(OUT_DIR)`
builds transformers' own processor classes from it) and `check_processor` loads it back and checks the classes,
the token ids and the preprocessing values against the table.

Sources of the values (the released repositories on the Hugging Face hub, read through public copies):
- Qwen2.5-VL (`Qwen/Qwen2.5-VL-7B-Instruct`): preprocessor_config.json and chat template as in
  ../shared/fixtures/multimodal/qwen2_5_vl_processor (see its SOURCE.txt); there is no video_preprocessor_config.json,
  so transformers builds the video processor from preprocessor_config.json (every decoded frame used,
  `do_sample_frames` false, the image pixel limits per frame).
- Qwen3-VL (`Qwen/Qwen3-VL-8B-Instruct`): preprocessor_config.json (patch 16, pixels 65,536..16,777,216, mean and std
  0.5) and video_preprocessor_config.json (Qwen3VLVideoProcessor, 2 frames/s, 4..768 frames, pixels
  4,096..25,165,824, frame sampling on) as published copies of the release give them; the chat template is the one
  the release ships (5,292 bytes, sha256 3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4, the same
  bytes in its GGUF export's tokenizer.chat_template); tokens as Qwen3's (../shared/fixtures/tokenizers/qwen3).
- Qwen2-Audio (`Qwen/Qwen2-Audio-7B-Instruct`): Whisper feature extractor with 128 mel bins at 16 kHz, 30 s chunks
  (n_samples 480,000, nb_max_frames 3,000), hop 160, n_fft 400; `<|AUDIO|>` at 151646 (`Qwen2AudioConfig`'s
  audio_token_index, the released config's), `<|audio_bos|>` / `<|audio_eos|>` at 151647 / 151648 (the ids Qwen2.5-Omni,
  which took its audio tokens over, gives them; transformers' Qwen2-Audio tokenizer test shows each as one token); the
  chat template renders `Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>` and a newline per audio (transformers'
  Qwen2-Audio chat template test of the released processor).
- Qwen2.5-Omni (`Qwen/Qwen2.5-Omni-7B`): preprocessor_config.json (Whisper: 128 mel bins, 16 kHz, chunk_length 300,
  n_samples 4,800,000, nb_max_frames 30,000; Qwen2-VL image values: patch 14, pixels 3,136..12,845,056, CLIP mean /
  std), no video_preprocessor_config.json; chat_template.jinja (1,281 bytes: `<|vision_bos|><|IMAGE|><|vision_eos|>`,
  `<|audio_bos|><|AUDIO|><|audio_eos|>`, `<|vision_bos|><|VIDEO|><|vision_eos|>`, also transformers'
  Qwen2.5-Omni processor test); added tokens `<|AUDIO|>` 151646, `<|audio_bos|>` 151647, `<|audio_eos|>` 151648,
  `<|vision_bos|>` 151652, `<|vision_eos|>` 151653, `<|IMAGE|>` 151655, `<|VIDEO|>` 151656 (its added_tokens.json;
  the same ids are `Qwen2_5OmniThinkerConfig`'s defaults in transformers).
Qwen3-Omni is not written: its tokenizer moves the audio tokens to other ids (151669.. per transformers' talker
config) that no public copy read here confirms.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from common.config import ConfigError
from common.fsutil import atomic_directory

TEMPLATES = Path(__file__).resolve().parent / "processor_templates"
FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
BPE_FILES = ("vocab.json", "merges.txt")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

# Qwen2.5's added tokens (id -> text, special), as Qwen2.5-Instruct and Qwen2.5-VL ship them; Qwen3 adds 151665..151668
QWEN2_5_TOKENS: dict[int, tuple[str, bool]] = {
    151643: ("<|endoftext|>", True), 151644: ("<|im_start|>", True), 151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True), 151647: ("<|object_ref_end|>", True), 151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True), 151650: ("<|quad_start|>", True), 151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True), 151653: ("<|vision_end|>", True), 151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True), 151656: ("<|video_pad|>", True), 151657: ("<tool_call>", False),
    151658: ("</tool_call>", False), 151659: ("<|fim_prefix|>", False), 151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False), 151662: ("<|fim_pad|>", False), 151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
}
QWEN3_TOKENS = {**QWEN2_5_TOKENS, 151665: ("<tool_response>", False), 151666: ("</tool_response>", False),
                151667: ("<think>", False), 151668: ("</think>", False)}
AUDIO_TOKENS = {151646: ("<|AUDIO|>", True), 151647: ("<|audio_bos|>", True), 151648: ("<|audio_eos|>", True)}
QWEN2_AUDIO_TOKENS = {**{i: QWEN2_5_TOKENS[i] for i in (151643, 151644, 151645)}, **AUDIO_TOKENS}
OMNI_TOKENS = {**QWEN2_5_TOKENS, **AUDIO_TOKENS, 151652: ("<|vision_bos|>", True), 151653: ("<|vision_eos|>", True),
               151655: ("<|IMAGE|>", True), 151656: ("<|VIDEO|>", True)}


def _qwen2_vl_images(patch: int, pixels: dict, mean: list, std: list) -> dict:
    """Qwen2-VL image processor values; `pixels`: {min_pixels, max_pixels} (Qwen2.x's keys) or {size: ...} (Qwen3's)."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "temporal_patch_size": 2,
            "merge_size": 2, **pixels, "image_mean": mean, "image_std": std}


QWEN2_PIXELS = {"min_pixels": 3136, "max_pixels": 12845056}


def _whisper(chunk_length: int) -> dict:
    return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000,
            "hop_length": 160, "n_fft": 400, "chunk_length": chunk_length, "n_samples": chunk_length * 16000,
            "nb_max_frames": chunk_length * 100, "dither": 0.0, "padding_side": "right", "padding_value": 0.0,
            "return_attention_mask": True}


@dataclass(frozen=True)
class ProcessorRelease:
    """What one released checkpoint's processor directory holds besides the BPE files."""
    name: str
    checkpoint: str  # the hub repository the values are those of
    processor_class: str
    tokens: dict[int, tuple[str, bool]]  # added tokens: id -> (text, special)
    model_max_length: int
    preprocessor: dict  # preprocessor_config.json (without processor_class)
    video_preprocessor: dict | None = None  # video_preprocessor_config.json, where the release has one
    token_attributes: dict[str, str] = field(default_factory=dict)  # tokenizer.image_token ... the processor reads
    default_tokenizer: str = "tokenizers/qwen3"  # where the BPE files come from by default, under the fixtures

    @property
    def chat_template(self) -> str:
        return (TEMPLATES / f"{self.name}.jinja").read_text(encoding="utf-8")


RELEASES: dict[str, ProcessorRelease] = {r.name: r for r in (
    ProcessorRelease(
        "qwen2_5_vl", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen2_5_VLProcessor", QWEN2_5_TOKENS, 131072,
        _qwen2_vl_images(14, QWEN2_PIXELS, CLIP_MEAN, CLIP_STD)),
    ProcessorRelease(
        "qwen3_vl", "Qwen/Qwen3-VL-8B-Instruct", "Qwen3VLProcessor", QWEN3_TOKENS, 262144,
        _qwen2_vl_images(16, {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}, [0.5] * 3, [0.5] * 3),
        {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3, "do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768}),
    ProcessorRelease(
        "qwen2_audio", "Qwen/Qwen2-Audio-7B-Instruct", "Qwen2AudioProcessor", QWEN2_AUDIO_TOKENS, 32768,
        _whisper(30)),
    ProcessorRelease(
        "qwen2_5_omni", "Qwen/Qwen2.5-Omni-7B", "Qwen2_5OmniProcessor", OMNI_TOKENS, 32768,
        {**_whisper(300), **_qwen2_vl_images(14, QWEN2_PIXELS, CLIP_MEAN, CLIP_STD)},
        token_attributes={"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                          "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                          "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}),
)}


def tokenizer_config(release: ProcessorRelease) -> dict:
    """tokenizer_config.json: the release's added tokens at their ids, ChatML's end and padding tokens."""
    return {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "unk_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "errors": "replace", "split_special_tokens": False,
        "clean_up_tokenization_spaces": False, "model_max_length": release.model_max_length,
        "tokenizer_class": "Qwen2Tokenizer", "processor_class": release.processor_class,
        "added_tokens_decoder": {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": special}
                                 for i, (text, special) in sorted(release.tokens.items())},
        "additional_special_tokens": [text for text, special in release.tokens.values()
                                      if special and text != "<|endoftext|>"],
        **release.token_attributes,
    }


def _json(obj: dict) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2) + b"\n"


def write_processor(name: str, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write the processor directory of release `name` at `out_dir` (replacing it atomically): the BPE files of
    `tokenizer_dir` (default: the release's tokenizer among the shared fixtures), tokenizer_config.json,
    chat_template.jinja, preprocessor_config.json and, where the release has one, video_preprocessor_config.json."""
    release = RELEASES.get(name)
    if release is None:
        raise ConfigError(f"unknown processor {name!r}; known: {', '.join(RELEASES)}")
    source = Path(tokenizer_dir) if tokenizer_dir is not None else FIXTURES / release.default_tokenizer
    missing = [f for f in BPE_FILES if not (source / f).is_file()]
    if missing:
        raise ConfigError(f"--tokenizer {source}: no {' / '.join(missing)} there; give a directory holding the Qwen "
                          "BPE files (vocab.json and merges.txt of any Qwen2 / Qwen2.5 / Qwen3 tokenizer)")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as tmp:
        tmp.mkdir()
        for f in BPE_FILES:
            shutil.copyfile(source / f, tmp / f)
        (tmp / "tokenizer_config.json").write_bytes(_json(tokenizer_config(release)))
        (tmp / "chat_template.jinja").write_text(release.chat_template, encoding="utf-8")
        (tmp / "preprocessor_config.json").write_bytes(
            _json({**release.preprocessor, "processor_class": release.processor_class}))
        if release.video_preprocessor is not None:
            (tmp / "video_preprocessor_config.json").write_bytes(
                _json({**release.video_preprocessor, "processor_class": release.processor_class}))
    return out


def check_processor(name: str, path: str | Path):
    """Load `path` with `AutoProcessor` and check it is the release's: its class, every added token at its id, the
    token attributes, the chat template and the preprocessing values. Returns the processor."""
    from transformers import AutoProcessor

    release = RELEASES[name]
    processor = AutoProcessor.from_pretrained(str(path))
    problems = []
    if type(processor).__name__ != release.processor_class:
        problems.append(f"class {type(processor).__name__}, not {release.processor_class}")
    tokenizer = processor.tokenizer
    for i, (text, _) in release.tokens.items():
        if tokenizer.convert_tokens_to_ids(text) != i or tokenizer.convert_ids_to_tokens(i) != text:
            problems.append(f"token {text!r} is id {tokenizer.convert_tokens_to_ids(text)}, not {i}")
    for attr, text in release.token_attributes.items():
        if getattr(tokenizer, attr, None) != text:
            problems.append(f"tokenizer.{attr} is {getattr(tokenizer, attr, None)!r}, not {text!r}")
    if processor.chat_template != release.chat_template:
        problems.append("the chat template differs from the release's")
    expected = {**release.preprocessor, **(release.video_preprocessor or {})}
    for key in ("patch_size", "temporal_patch_size", "merge_size", "feature_size", "sampling_rate", "n_samples",
                "hop_length", "n_fft", "fps", "min_frames", "max_frames", "do_sample_frames"):
        if key not in expected:
            continue
        owners = [o for o in (getattr(processor, "video_processor", None) if key in (release.video_preprocessor or {})
                              else None, getattr(processor, "image_processor", None),
                              getattr(processor, "feature_extractor", None)) if o is not None and hasattr(o, key)]
        if owners and getattr(owners[0], key) != expected[key]:
            problems.append(f"{type(owners[0]).__name__}.{key} is {getattr(owners[0], key)!r}, not {expected[key]!r}")
    if problems:
        raise ConfigError(f"{path}: not the {release.checkpoint} processor: {'; '.join(problems)}")
    return processor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.processors", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(RELEASES))
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizer", help="a directory with the Qwen BPE files vocab.json and merges.txt (default: "
                        "the release's tokenizer under ../shared/fixtures/)")
    parser.add_argument("--no-check", action="store_true", help="write only; do not load it back with transformers")
    args = parser.parse_args(argv)
    try:
        out = write_processor(args.name, args.out_dir, args.tokenizer)
        if not args.no_check:
            check_processor(args.name, out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{RELEASES[args.name].checkpoint} processor written to {out}"
          + ("" if args.no_check else " (loaded back with AutoProcessor: classes, token ids, template and values match)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
