"""Typed configuration of the data pipeline, loaded from the JSON file the user edits plus `key=value` overrides
(through common.config, the machinery the trainer's YAML config shares)."""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import orjson

from common.config import (ConfigError, apply_overrides, check_keys, check_override_values, from_dict, key_tree,
                           pretrained_dir, relative_note, to_dict)
from data.shards.chat_templates import builtin_name, names as template_names
from data.shards.decode import MediaLimits

STAGES = ("preprocess", "sample", "merge", "tokenize", "pack")
# other tools' names for data config keys: the "did you mean" of an unknown key (difflib cannot find these)
DATA_KEY_ALIASES = {
    "max_seq_length": "max_length", "max_seq_len": "max_length", "cutoff_len": "max_length", "seq_length": "max_length",
    "tokenizer": "tokenizer_path", "tokenizer_name_or_path": "tokenizer_path", "template": "chat_template",
    "output_path": "output_dir", "out_dir": "output_dir", "dataset": "inputs", "datasets": "inputs",
    "data_files": "inputs", "preprocessing_num_workers": "num_workers", "workers": "num_workers",
    "val_size": "eval_size", "test_size": "eval_size", "validation_split": "eval_size", "eval_split": "eval_size",
}
DEFAULT_REASONING_TAGS = ("<think>\n", "\n</think>\n\n")
# how a run executes, not what it outputs
EXECUTION_KEYS = ("num_workers", "stages", "engine", "ray_address", "render_timeout")


@dataclass
class InputSpec:
    """One raw input: a file, a glob, or a list of them (`split@path` selects a split of a datasets dir)."""

    path: list[str]  # a file, a glob, split@dir (a datasets directory), or a list of them
    # auto | messages | sharegpt | prompt_response | verl | alpaca | function
    format: Literal["auto", "messages", "sharegpt", "prompt_response", "verl", "alpaca", "function"] = "auto"
    category_name: str | None = None  # fixed category for every record of this input
    category_field: str | None = None  # or: the raw field holding the category name
    prompt_key: str = "prompt"  # prompt_response / verl single-turn (prompt: string or message list)
    response_key: str = "response"  # prompt_response / verl: the answer column (verl falls back to `output`)
    system: str | None = None  # system prompt added to prompt_response / verl / alpaca records without one
    messages_key: str = "messages"  # messages format: the column holding the message list
    tools_key: str = "tools"  # the column holding the tool specs, if any
    function: str | None = None  # "path/to/file.py:function" mapping one raw row to a canonical record


@dataclass
class MergeConfig:
    """Pseudo-multiturn: consecutive records merged with this probability; token budget (None: max_length)."""

    probability: float = 0.0  # probability that a record is appended to the previous conversation
    max_tokens: int | None = None  # token budget of a merged conversation; None: max_length


@dataclass
class PackConfig:
    """Packing of tokenized sequences into fixed-capacity rows."""

    max_length: int | None = None  # row capacity; None: DataConfig.max_length
    shard_size_mb: int = 1024  # shard size of tokenized/ and packed/ (MB)
    # exact_fill: rows filled one at a time toward exact sums (never more rows than best_fit); best_fit and
    # first_fit over lengths in decreasing order
    algorithm: Literal["exact_fill", "best_fit", "first_fit"] = "exact_fill"


class UnderOutput:
    """A read-only path attribute of `DataConfig`: `name` under its output_dir."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, cfg, owner=None):
        return self if cfg is None else Path(cfg.output_dir) / self.name


@dataclass
class DataConfig:
    inputs: list[InputSpec]  # the raw inputs (keys of each below)
    output_dir: str  # where every output goes: canonical/sampled/merged.jsonl, tokenized/, packed/, report.json
    tokenizer_path: str  # a local tokenizer directory (fast tokenizer) or a Hub id org/name; needed by merge and tokenize
    chat_template: str | None = None  # a Jinja file or a built-in name (chatml, llama3, phi3, qwen), for tokenizers without (or to replace) a chat template
    ratio_path: str | None = None  # the ratio JSON the user edits; None: <output_dir>/ratios.json
    max_length: int = 131072  # longest tokenized sequence (tokens); longer records follow `overlong`
    seed: int = 42  # seeds sampling, merging and packing
    num_workers: int = 0  # worker processes; 0: all cores (outputs are byte-identical for any count)
    on_error: Literal["error", "skip"] = "error"  # bad record: stop with path:line: field, or drop and count it
    # drop | error | truncate (at the last whole assistant turn that fits) | left | right (verl token truncation)
    overlong: Literal["drop", "error", "truncate", "left", "right"] = "drop"
    truncation: Literal["left", "right", "error"] | None = None  # verl's name; when set it overrides `overlong`
    loss_turns: Literal["all", "last"] = "all"  # rllm: cumulative (all assistant turns) or stepwise (last only)
    structure: Literal["parallel_thinking"] | None = None  # Parallel-R1 data: per-token block and path ids
    # multi-turn / agent records trained per assistant step in the context the template renders for it (docs/DATA.md):
    # off (one sequence per record) | samples (one sequence per trained turn) | tree (those as one prefix tree)
    stepwise: Literal["off", "samples", "tree"] = "off"
    enable_thinking: bool | None = None  # default for records without their own `enable_thinking`
    # image records (tokenizer_path a processor directory): the image processor's smallest pixel count per image,
    # replacing the processor's min_pixels (Qwen2-VL family); null: the processor's own
    image_min_pixels: int | None = None
    # the largest pixel count per image (larger images are resized), replacing the processor's max_pixels
    image_max_pixels: int | None = None
    # directories (one or a list) media paths (images, videos, audio) may resolve under (after symlinks) besides
    # the directory of the data file naming them; a path resolving elsewhere (`../`, absolute, file://) is a bad
    # record (follows on_error)
    image_root: list[str] = field(default_factory=list)
    # the largest image (width x height, read from its header before decoding) tokenize and the trainer decode;
    # a larger one is a bad record (follows on_error). PIL's decompression-bomb bound; null: no bound
    image_pixel_limit: int | None = 89_478_485
    # video records: frames sampled per second of video (the video processor's own sampling, with its frame limits;
    # the omni processors' seconds per temporal patch too); null: the processor's own (Qwen2.5-VL and the omni
    # processors use every decoded frame, Qwen3-VL samples 2 per second)
    video_fps: float | None = None
    # the smallest pixel count per video frame, replacing the video processor's; null: the processor's own
    video_min_pixels: int | None = None
    # the largest pixel count per video frame (larger frames are resized), replacing the video processor's
    video_max_pixels: int | None = None
    # the longest video (seconds), read from its header before decoding; longer is a bad record (follows on_error);
    # null: no bound
    video_max_seconds: float | None = MediaLimits.video_max_seconds
    # the most frames in a video file (its header's count, or its packets counted without decoding); null: no bound
    video_frame_limit: int | None = MediaLimits.video_frame_limit
    # the largest video frame (width x height, read from its header: 3840 x 2160 by default); null: no bound
    video_pixel_limit: int | None = MediaLimits.video_pixel_limit
    # the longest audio clip (seconds, a video's sound track included), read from its header before decoding
    audio_max_seconds: float | None = MediaLimits.audio_max_seconds
    # seconds the chat template may take to render one record (and a probe conversation); longer is an error naming
    # the template and the record (a template that loops); null: no bound
    render_timeout: float | None = 10.0
    # a category that loses more than this fraction of its records in tokenize (overlong, bad records) is a
    # warning at the end of the run and in report.json; one that loses all of them is an error
    category_loss_warning: float = 0.5
    # an input that loses more than this fraction of its rows in preprocess (bad rows under on_error: skip; rows a
    # user function filters out do not count) is a warning; one that loses all of them is an error
    input_loss_warning: float = 0.5
    # held-out eval split, taken per category before sampling copies and merging, packed into <output_dir>/eval/:
    # a fraction in (0, 1) of each category (0.05), or an integer count of records shared out over the categories by
    # size (40; 1.0 is a fraction, refused); null: none
    eval_size: int | float | None = None
    merge: MergeConfig = field(default_factory=MergeConfig)
    # ---- fidelity: what a record asks to train reaches the loss (docs/DATA.md, "What is trained")
    # reasoning_content of trained turns: auto (template renders it, else inline with reasoning_tags) |
    # template (the template's behaviour, losses counted) | drop | error (a turn whose reasoning would be lost)
    reasoning: Literal["auto", "template", "drop", "error"] = "auto"
    reasoning_tags: list[str] = field(default_factory=lambda: list(DEFAULT_REASONING_TAGS))  # [open, close]
    tool_arguments: Literal["parse", "keep"] = "parse"  # JSON-string tool-call arguments parsed to an object
    pack: PackConfig = field(default_factory=PackConfig)
    stages: list[str] = field(default_factory=lambda: list(STAGES))  # the stages to run (in pipeline order)
    # ---- execution engine (data/engine_ray.py): the output is byte-identical whichever engine runs it
    engine: Literal["local", "ray"] = "local"  # local: processes on this machine; ray: Ray Data (optional dep)
    ray_address: str | None = None  # ray: None starts a local instance; "auto" or "ray://host:10001" joins one

    # ------------------------------------------------------------------ derived paths
    @property
    def out(self) -> Path:
        return Path(self.output_dir)

    @property
    def ratio_file(self) -> Path:
        return Path(self.ratio_path) if self.ratio_path else self.out / "ratios.json"

    canonical_path = UnderOutput("canonical.jsonl")
    sampled_path = UnderOutput("sampled.jsonl")
    merged_path = UnderOutput("merged.jsonl")
    tokenized_dir = UnderOutput("tokenized")
    packed_dir = UnderOutput("packed")
    report_path = UnderOutput("report.json")
    eval_dir = UnderOutput("eval")

    def eval_config(self) -> "DataConfig":
        """The config the eval split's merge, tokenize and pack stages run with: the same settings with every
        output under <output_dir>/eval/ (its sampled.jsonl holds the held-out records) and no pseudo-multiturn
        merging, so an eval record is scored on its own."""
        return dataclasses.replace(self, output_dir=str(self.eval_dir), ratio_path=str(self.ratio_file),
                                   merge=dataclasses.replace(self.merge, probability=0.0), eval_size=None)

    @property
    def pack_max_length(self) -> int:
        return self.pack.max_length or self.max_length

    @property
    def effective_overlong(self) -> str:
        return self.truncation if self.truncation else self.overlong

    @property
    def workers(self) -> int:
        return self.num_workers if self.num_workers > 0 else (os.cpu_count() or 1)

    def validate(self) -> None:
        """Invariants checked before any heavy work."""
        for st in self.stages:
            if st not in STAGES:
                raise ConfigError(f"stages: unknown stage {st!r}; known: {list(STAGES)}")
        if self.max_length <= 0:
            raise ConfigError(f"max_length must be positive, got {self.max_length}")
        if self.pack_max_length > self.max_length and "tokenize" in self.stages:
            raise ConfigError(
                f"pack.max_length={self.pack_max_length} exceeds max_length={self.max_length}"
            )
        if not 0.0 <= self.merge.probability <= 1.0:
            raise ConfigError(f"merge.probability must be in [0, 1], got {self.merge.probability}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        for key in ("category_loss_warning", "input_loss_warning"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"{key} must be in [0, 1], got {getattr(self, key)}")
        if self.render_timeout is not None and not self.render_timeout > 0:
            raise ConfigError(f"render_timeout must be a positive number of seconds (null: no bound), got "
                              f"{self.render_timeout}")
        for key in ("image_min_pixels", "image_max_pixels", "image_pixel_limit", "video_fps", "video_min_pixels",
                    "video_max_pixels", "video_max_seconds", "video_frame_limit", "video_pixel_limit",
                    "audio_max_seconds"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                null = "the processor's" if key.endswith(("min_pixels", "max_pixels", "fps")) else "no bound"
                unit = " of pixels" if "pixel" in key else " of seconds" if "seconds" in key else ""
                raise ConfigError(f"{key} must be a positive number{unit} (null: {null}), got {getattr(self, key)}")
        for kind in ("image", "video"):
            low, high = getattr(self, f"{kind}_min_pixels"), getattr(self, f"{kind}_max_pixels")
            if low and high and low > high:
                raise ConfigError(f"{kind}_min_pixels={low} exceeds {kind}_max_pixels={high}")
        for root in self.image_root:
            if not Path(root).is_dir():
                raise ConfigError(f"image_root: {root} is not a directory{relative_note(root)}")
        if self.stepwise not in ("off", "samples", "tree"):
            raise ConfigError(f"stepwise must be one of off, samples, tree; got {self.stepwise!r}")
        if self.stepwise != "off" and self.merge.probability > 0:
            raise ConfigError(f"stepwise: {self.stepwise} trains every assistant turn in its own rendered context; "
                              f"pseudo-multiturn merging (merge.probability {self.merge.probability}) would join "
                              "records into one context: set merge.probability to 0")
        if self.stepwise == "tree" and self.structure:
            raise ConfigError(f"stepwise: tree cannot be combined with structure: {self.structure} (one attention "
                              "mask per row); use stepwise: samples")
        if self.pack.shard_size_mb <= 0:
            raise ConfigError(f"pack.shard_size_mb must be positive, got {self.pack.shard_size_mb}")
        self._validate_eval_size()
        if "preprocess" in self.stages:
            for i, spec in enumerate(self.inputs):
                for pattern in spec.path:
                    local = pattern.split("@", 1)[1] if _has_split(pattern) else pattern
                    if not glob.glob(local):
                        raise ConfigError(f"inputs[{i}].path: no file matches {pattern!r}{relative_note(local)}")
                if spec.format == "function" and not spec.function:
                    raise ConfigError(f"inputs[{i}]: format 'function' needs function: 'file.py:name'")
                if spec.function:
                    file, sep, name = spec.function.rpartition(":")
                    if not sep or not file or not name:
                        raise ConfigError(f"inputs[{i}].function: {spec.function!r} is not 'path/to/file.py:function'")
                    if not Path(file).is_file():
                        raise ConfigError(f"inputs[{i}].function: {file} is not a file{relative_note(file)}")
        self._validate_inputs_are_not_outputs()
        needs_tokenizer = {"tokenize", "merge"} & set(self.stages)
        if needs_tokenizer:
            self.tokenizer_path = str(check_tokenizer_dir(self.tokenizer_path))  # a Hub id: its cached snapshot
        if self.chat_template and not Path(self.chat_template).is_file() and not builtin_name(self.chat_template):
            raise ConfigError(f"chat_template: {self.chat_template} is neither a file{relative_note(self.chat_template)} "
                              f"nor a built-in template name ({template_names()})")
        self._validate_fidelity()
        self._validate_engine()

    def _validate_eval_size(self) -> None:
        """An integer is a count of records, a number with a decimal point a fraction of each category: 1 holds
        out one record, 1.0 every record (refused, as is any fraction outside (0, 1))."""
        size = self.eval_size
        if isinstance(size, float) and not 0 < size < 1:
            whole = (f": {size} would hold out every record and leave nothing to train" if size == 1 else "")
            raise ConfigError(f"eval_size={size}: a fraction (a number with a decimal point) must be in (0, 1)"
                              f"{whole}; for a count of records write an integer (eval_size: 1 holds out one record)")
        if isinstance(size, int) and size < 1:
            raise ConfigError(f"eval_size={size}: a count of records must be >= 1 (a fraction in (0, 1) holds out "
                              "that share of each category; null: no eval split)")

    def written_paths(self) -> list[tuple[Path, str]]:
        """What the stages write (a file, or a directory and everything under it), each with who writes it."""
        return [(self.canonical_path, "preprocess"), (self.ratio_file, "preprocess (the ratio file)"),
                (self.sampled_path, "sample"), (self.merged_path, "merge"), (self.tokenized_dir, "tokenize"),
                (self.packed_dir, "pack"), (self.eval_dir, "the eval split's stages"),
                (self.report_path, "every stage"), (self.out / "provenance.json", "every stage (its provenance)")]

    def _validate_inputs_are_not_outputs(self) -> None:
        """An input that a stage writes over (canonical.jsonl or merged.jsonl in output_dir, a file under packed/,
        the ratio file) would be lost the first time that stage runs, or read back as its own output: refused,
        whichever stages this run has."""
        written = [(os.path.realpath(path), who) for path, who in self.written_paths()]
        for i, spec in enumerate(self.inputs):
            for pattern in spec.path:
                for match in sorted(glob.glob(split_spec(pattern)[1])):
                    real = os.path.realpath(match)
                    for path, who in written:
                        if real == path or real.startswith(path + os.sep):
                            raise ConfigError(
                                f"inputs[{i}].path: {match} is an output of {who} (output_dir {self.output_dir}): a "
                                "run would write over this input, or read an earlier run's output as input; move "
                                "the input out of the output directory, or set another output_dir")

    def _validate_fidelity(self) -> None:
        tags = self.reasoning_tags
        if len(tags) != 2 or not all(tags):
            raise ConfigError(f"reasoning_tags must be two non-empty strings [open, close], got {tags!r}")

    def _validate_engine(self) -> None:
        """`engine: ray` needs Ray importable (an optional dependency); `ray_address` is only read by it."""
        if self.engine == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("engine: ray needs Ray installed: pip install -r requirements-ray.txt")
        if self.ray_address is not None and self.engine != "ray":
            raise ConfigError(f"ray_address={self.ray_address!r} is only used with engine: ray (engine is "
                              f"{self.engine!r})")


def check_tokenizer_dir(path: str) -> Path:
    """`tokenizer_path`: a local directory holding tokenizer files (their hash identifies the tokenizer), or a
    Hugging Face Hub id resolved to its snapshot (from the cache when offline). Returns the directory."""
    from common.fsutil import TOKENIZER_FILE_NAMES

    if Path(path).is_file():
        raise ConfigError(f"tokenizer_path: {path} is a file; give the tokenizer's directory (the one holding "
                          "tokenizer.json / tokenizer_config.json)")
    where = pretrained_dir(path, "tokenizer_path")
    if not any((where / name).is_file() for name in TOKENIZER_FILE_NAMES):
        raise ConfigError(f"tokenizer_path: {path} holds no tokenizer files (looked for "
                          f"{', '.join(TOKENIZER_FILE_NAMES[:3])}, ...)")
    return where


def output_config(cfg: DataConfig) -> dict:
    """The config stored in tokenized/ and packed/ meta.json: without the keys that do not change the output
    (`EXECUTION_KEYS`: `num_workers`, `stages`, `engine`, `ray_address`, `render_timeout`), so meta.json is
    byte-identical whatever the worker count, the stages run or the engine."""
    return {k: v for k, v in to_dict(cfg).items()
            if k not in EXECUTION_KEYS and not (k == "stepwise" and v == "off")}  # off: meta.json as before the key


def _has_split(pattern: str) -> bool:
    """`train@data/dir` selects a split; an '@' inside a real path (rare) is taken literally if it exists."""
    return "@" in pattern and not os.path.exists(pattern) and "/" not in pattern.split("@", 1)[0]


def split_spec(pattern: str) -> tuple[str | None, str]:
    """`split@path` -> (split, path); a plain path -> (None, path)."""
    if _has_split(pattern):
        split, path = pattern.split("@", 1)
        return split, path
    return None, pattern


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> DataConfig:
    try:
        raw = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist{relative_note(path)}") from None
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    for item in overrides or []:
        if "=" in item:
            key = item.split("=", 1)[0].strip()
            check_keys(key_tree(key), DataConfig, f"override {item!r}", aliases=DATA_KEY_ALIASES,
                       help_hint=" (sh data_process.sh --help lists every key)")
    check_override_values(DataConfig, overrides or [])
    apply_overrides(raw, overrides or [])
    return from_dict(DataConfig, raw, where=str(path), aliases=DATA_KEY_ALIASES)
