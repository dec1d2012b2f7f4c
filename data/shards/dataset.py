"""Indexed token datasets: the on-disk format shared by tokenized/ (one sequence per row) and packed/ (many).

Layout of a dataset directory:
    meta.json                  manifest: format version, kind, token fields, counts, per-shard sizes + checksums,
                               plus what the caller passes (tokenizer path/hash, max_length, config, categories)
    shard_NNNNN.tokens.bin     flat token records (numpy structured dtype, one record per token, no padding)
    shard_NNNNN.rows.npy       per row: token_offset, n_tokens, seq_offset, n_seqs, n_loss_tokens,
                               n_trained_turns, n_samples (offsets local to the shard), checksum (zlib crc32 of
                               the row's token records, checked on every read: meta.json `row_checksum`)
    shard_NNNNN.seqs.npy       per sequence: length, record_index, n_loss_tokens, n_trained_turns, uid_offset, n_uids
    shard_NNNNN.uids.npy       flat int64 source-record uids of the sequences
    shard_NNNNN.media.npy      (media datasets, meta.json `media_store`) per image, video or audio clip, in sequence
                               order: its sequence (shard-local), byte offset and size in media.bin, token count,
                               kind, flags (audio-in-video), patch grid (t, h, w), audio feature frames, duration (ms)
    shard_NNNNN.media.bin      the media's encoded bytes (files as read, not re-encoded); a row's checksum goes on
                               over its media (`row_checksum`), so it covers the media data too
Format 2 datasets stay readable, their image stores too (`image_store`: images.npy / images.bin, images only).

Everything is memory-mapped on read, so opening a dataset costs O(shards) and `ds[i]` is O(1) whatever its size.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import orjson

from common.errors import PackSFTError
from common.fsutil import file_blake2b, fsync_dir, replace_dir, set_aside, temp_sibling, write_synced

FORMAT_NAME = "packsft-indexed"
FORMAT_VERSION = 3  # 2: per-row checksums in rows.npy; 3: the media store (images, videos, audio)
READ_VERSIONS = (2, 3)  # what this code reads: format 2 datasets (and their image stores) stay readable
ROW_CHECKSUM = "crc32"  # zlib.crc32 over the bytes of a row's token records, as stored in tokens.bin
VERIFY_MODES = ("full", "rows", "off")  # PackedDataset(verify=...): + token-file hashes at open | per row | none
IGNORE_INDEX = -100

# Every token field the format knows, in on-disk order, with its dtype.
KNOWN_TOKEN_FIELDS: dict[str, str] = {
    "input_ids": "<i4",
    "labels": "<i4",
    "category_ids": "<i2",
    "turn_ids": "<i2",
    "block_ids": "<i2",
    "path_ids": "<i2",
    "tree_spans": "<i4",  # stepwise trees (data/shards/prefix_tree.py): each token's subtree size
}
REQUIRED_TOKEN_FIELDS = ("input_ids", "labels", "category_ids", "turn_ids")
STRUCTURE_TOKEN_FIELDS = ("block_ids", "path_ids")
TREE_TOKEN_FIELDS = ("tree_spans",)


class Structure(str, Enum):
    """What a dataset's sequences carry beyond causal text, stated by its token fields (meta.json): nothing,
    Parallel-R1's block / path ids (data/shards/parallel_thinking.py), or stepwise prefix trees' subtree spans
    (data/shards/prefix_tree.py). The one reading of those fields: everything else asks `structure_of`."""

    NONE = "none"
    PARALLEL_THINKING = "parallel_thinking"
    TREE = "tree"


def structure_of(token_fields: Iterable[str]) -> Structure:
    fields = set(token_fields)
    if fields.issuperset(TREE_TOKEN_FIELDS):
        return Structure.TREE
    if fields.issuperset(STRUCTURE_TOKEN_FIELDS):
        return Structure.PARALLEL_THINKING
    return Structure.NONE

ROW_DTYPE = np.dtype(
    [
        ("token_offset", "<i8"),
        ("n_tokens", "<i8"),
        ("seq_offset", "<i8"),
        ("n_seqs", "<i8"),
        ("n_loss_tokens", "<i8"),
        ("n_trained_turns", "<i8"),
        ("n_samples", "<i8"),
        ("checksum", "<u4"),
    ]
)
SEQ_DTYPE = np.dtype(
    [
        ("length", "<i8"),
        ("record_index", "<i8"),
        ("n_loss_tokens", "<i8"),
        ("n_trained_turns", "<i8"),
        ("uid_offset", "<i8"),
        ("n_uids", "<i8"),
    ]
)
UID_DTYPE = np.dtype("<i8")
SHARD_FILES = ("tokens", "rows", "seqs", "uids")
MEDIA_KINDS = ("image", "video", "audio")  # a stored item's `kind` is its index here
TIMED_KINDS = ("video", "audio")  # kinds whose counts add up their duration (`{kind}_millis`)
AUDIO_IN_VIDEO = 1  # StoredMedia.flags: a video whose sound track is in its token run
MEDIA_DTYPE = np.dtype([("seq", "<i8"), ("byte_offset", "<i8"), ("n_bytes", "<i8"), ("n_tokens", "<i8"),
                        ("kind", "<i8"), ("flags", "<i8"), ("grid", "<i8", (3,)), ("audio_frames", "<i8"),
                        ("millis", "<i8")])
MEDIA_FILES = ("media", "media_data")  # the shard files of a dataset with `media_store`
IMAGE_DTYPE = np.dtype([("seq", "<i8"), ("byte_offset", "<i8"), ("n_bytes", "<i8"), ("n_tokens", "<i8"),
                        ("grid", "<i8", (3,))])  # format 2's image store (read only)
IMAGE_FILES = ("images", "image_data")  # format 2's shard files of a dataset with `image_store`
_IO_BATCH_BYTES = 1 << 22

# Keys of meta.json the writer owns; meta_extra may not replace them.
RESERVED_META_KEYS = ("format", "format_version", "row_checksum", "kind", "token_fields", "counts", "max_token_id",
                      "shards", "manifest_blake2b", "image_store", "media_store")
MANIFEST_CHECKSUM = "manifest_blake2b"  # meta.json's checksum of its own content (manifest_checksum)

class ShardFormatError(PackSFTError, ValueError):
    """An indexed dataset on disk is missing, truncated, corrupt or of an incompatible format version."""

    label = "data error"


class RowSlice(NamedTuple):
    """One source shard's part of a range of rows (`PackedDataset.row_slices`)."""

    shard: int
    rows: np.ndarray  # the rows' index entries (a view)
    nbytes: np.ndarray  # each row's stored bytes (token records, plus its media's bytes)


class StoredRun(NamedTuple):
    """Consecutive rows of one shard and what they point to, as stored (`PackedDataset.stored_run`): views whose
    offsets start at `token_offset`, `seq_offset` and `uid_offset` of that shard."""

    rows: np.ndarray
    seqs: np.ndarray
    uids: np.ndarray
    tokens: np.ndarray
    token_offset: int
    seq_offset: int
    uid_offset: int
    media: np.ndarray | None  # their media's index entries (None: a dataset without media)
    media_data: np.ndarray | None  # those media's encoded bytes (None: none)


class StoredMedia(NamedTuple):
    """One image, video or audio clip of a sequence: its kind, encoded bytes (the file as read), patch grid (t, h, w;
    images and videos), number of tokens of its run in the sequence, flags (`AUDIO_IN_VIDEO`), audio feature
    frames (audio, or a video's sound track) and duration in milliseconds (videos, audio)."""
    kind: str
    data: bytes
    grid: tuple[int, int, int]
    n_tokens: int
    flags: int = 0
    audio_frames: int = 0
    millis: int = 0

    def entry(self, seq: int, byte_offset: int) -> tuple:
        """Its `MEDIA_DTYPE` index entry."""
        return (seq, byte_offset, len(self.data), int(self.n_tokens), MEDIA_KINDS.index(self.kind), int(self.flags),
                tuple(self.grid), int(self.audio_frames), int(self.millis))


def media_checksum(crc: int, entry: Any, data: Any, version: int = FORMAT_VERSION) -> int:
    """A row's crc32 (`ROW_CHECKSUM`) continued over one of its media (a `MEDIA_DTYPE` entry and its bytes): the
    entry's token count, kind, flags, grid, audio frames and duration, then the bytes (format 2: token count and
    grid, as its image store did)."""
    if version == 2:
        header = [entry["n_tokens"], *entry["grid"]]
    else:
        header = [entry["n_tokens"], entry["kind"], entry["flags"], *entry["grid"], entry["audio_frames"],
                  entry["millis"]]
    return zlib.crc32(data, zlib.crc32(np.array(header, dtype="<i8").tobytes(), crc))


def media_count_keys() -> list[str]:
    """The keys of `counts` a media store adds: per kind its items, tokens and bytes (and milliseconds for videos
    and audio), and the videos with their sound track."""
    keys = []
    for kind in MEDIA_KINDS:
        keys += [f"{kind}s", f"{kind}_tokens", f"{kind}_bytes"] + ([f"{kind}_millis"] if kind in TIMED_KINDS else [])
    return keys + ["videos_with_audio"]


def count_media(counts: dict, entries: np.ndarray) -> None:
    """Add `MEDIA_DTYPE` entries to a media store's `counts`."""
    for k, kind in enumerate(MEDIA_KINDS):
        of_kind = entries[entries["kind"] == k]
        counts[f"{kind}s"] += len(of_kind)
        counts[f"{kind}_tokens"] += int(of_kind["n_tokens"].sum())
        counts[f"{kind}_bytes"] += int(of_kind["n_bytes"].sum())
        if kind in TIMED_KINDS:
            counts[f"{kind}_millis"] += int(of_kind["millis"].sum())
    counts["videos_with_audio"] += int(np.count_nonzero(entries["flags"] & AUDIO_IN_VIDEO))


# ---------------------------------------------------------------------------------------------- helpers
def token_dtype(fields: Sequence[str]) -> np.dtype:
    return np.dtype([(name, KNOWN_TOKEN_FIELDS[name]) for name in fields])


def normalize_token_fields(token_fields: Iterable[str] | None) -> list[str]:
    """The canonical on-disk field list: the required four, then block_ids/path_ids when asked for."""
    if token_fields is None:
        return list(REQUIRED_TOKEN_FIELDS)
    requested = list(token_fields)
    unknown = [f for f in requested if f not in KNOWN_TOKEN_FIELDS]
    if unknown:
        raise ValueError(f"token_fields: unknown field(s) {unknown}; known: {list(KNOWN_TOKEN_FIELDS)}")
    missing = [f for f in REQUIRED_TOKEN_FIELDS if f not in requested]
    if missing:
        raise ValueError(f"token_fields: required field(s) {missing} missing")
    return [f for f in KNOWN_TOKEN_FIELDS if f in requested]


def manifest_checksum(meta: Mapping[str, Any]) -> str:
    """blake2b of a manifest's content without its own checksum (JSON, keys sorted): meta.json is checked like the
    shards it describes, so a hand-edited count or `max_token_id` is refused instead of trusted."""
    content = {k: v for k, v in meta.items() if k != MANIFEST_CHECKSUM}
    return hashlib.blake2b(orjson.dumps(content, option=orjson.OPT_SORT_KEYS), digest_size=32).hexdigest()


def _shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def _shard_file(name: str, kind: str) -> str:
    return {"tokens": f"{name}.tokens.bin", "media_data": f"{name}.media.bin",
            "image_data": f"{name}.images.bin"}.get(kind, f"{name}.{kind}.npy")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def dump_json(obj: Any) -> bytes:
    return orjson.dumps(
        obj, default=_json_default, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
    )


# ---------------------------------------------------------------------------------------------- writer
class _ShardBuffer:
    """The shard being written: tokens streamed to disk and hashed by a helper thread (hashlib and file writes
    release the GIL, so this overlaps with preparing the next row), indices kept in memory."""

    def __init__(self, directory: Path, index: int, durable: bool, media: bool = False):
        self.name = _shard_name(index)
        self.durable = durable
        self.tokens_path = directory / _shard_file(self.name, "tokens")
        self.file = open(self.tokens_path, "wb")
        self.hash = hashlib.blake2b(digest_size=32)
        self.n_tokens = 0
        self.n_bytes = 0
        self.rows: list[tuple] = []
        self.seqs: list[tuple] = []
        self.uids: list[int] = []
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._pending: Future | None = None
        self._batch: list[np.ndarray] = []
        self._batch_bytes = 0
        self.media: list[tuple] | None = [] if media else None  # MEDIA_DTYPE records; their bytes go here:
        self.media_path = directory / _shard_file(self.name, "media_data")
        self.media_file = open(self.media_path, "wb") if media else None
        self.media_hash = hashlib.blake2b(digest_size=32)
        self.media_bytes = 0

    @property
    def size(self) -> int:
        """What `max_shard_bytes` bounds: the token records and the media's bytes."""
        return self.n_bytes + self.media_bytes

    def add_media(self, seq: int, item: StoredMedia) -> tuple:
        entry = item.entry(seq, self.media_bytes)
        self.media.append(entry)
        self.add_media_bytes(item.data)
        return entry

    def add_media_bytes(self, data: Any) -> None:
        self.media_file.write(data)
        self.media_hash.update(data)
        self.media_bytes += len(data)

    def finish_media(self) -> str:
        self.media_file.flush()
        if self.durable:
            os.fsync(self.media_file.fileno())
        self.media_file.close()
        return self.media_hash.hexdigest()

    def _write(self, batch: list[np.ndarray]) -> None:
        for data in batch:
            self.file.write(data)
            self.hash.update(data)

    def append(self, data: np.ndarray) -> None:
        """Queue one row's bytes (`data` must not change afterwards). Rows go to the helper thread in batches
        of >= _IO_BATCH_BYTES, at most one batch in flight."""
        self._batch.append(data)
        self._batch_bytes += data.nbytes
        if self._batch_bytes >= _IO_BATCH_BYTES:
            self._submit()

    def _submit(self) -> None:
        if self._pending is not None:
            self._pending.result()
        self._pending = self._io.submit(self._write, self._batch) if self._batch else None
        self._batch, self._batch_bytes = [], 0

    def finish(self) -> str:
        """Flush, close, and return the blake2b of everything appended."""
        try:
            self._submit()
            if self._pending is not None:
                self._pending.result()
            self.file.flush()
            if self.durable:
                os.fsync(self.file.fileno())
        finally:
            self._io.shutdown()
            self.file.close()
        return self.hash.hexdigest()

    def discard(self) -> None:
        self._io.shutdown(wait=True)
        self.file.close()
        if self.media_file is not None:
            self.media_file.close()


class ShardWriter:
    """Write an indexed token dataset row by row; nothing is visible at `out_dir` before `close()`.

    A row is a list of sequences; a sequence is a mapping field -> 1-D integer array, or a structured numpy
    array with those fields (e.g. `PackedDataset.row_tokens(i)` of another dataset; copied as bytes when its
    dtype is the writer's). Used as a context manager, a writer that is not closed is aborted. `durable=False`:
    nothing is fsynced (a scratch dataset, copied elsewhere and removed: a crash loses nothing of value).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        token_fields: Iterable[str] | None = None,
        max_shard_bytes: int = 1 << 30,
        kind: str = "packed",
        durable: bool = True,
        media: bool = False,
    ):
        if kind not in ("packed", "tokenized"):
            raise ValueError(f"kind must be 'packed' or 'tokenized', got {kind!r}")
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.kind = kind
        self.token_fields = normalize_token_fields(token_fields)
        self.dtype = token_dtype(self.token_fields)
        self.max_shard_bytes = int(max_shard_bytes)
        self.durable = durable
        self.media = media  # a media store: sequences may carry images, videos, audio (`add_row(media=...)`)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        aside = set_aside(self.out_dir)
        if len(aside) == 1:  # an earlier run died inside replace_dir: put the previous output back first
            os.replace(aside[0], self.out_dir)
        self.tmp_dir = temp_sibling(self.out_dir)
        self.tmp_dir.mkdir()
        self._shards: list[dict] = []
        self._current: _ShardBuffer | None = None
        self._counts = dict(rows=0, sequences=0, tokens=0, loss_tokens=0, trained_turns=0, samples=0, uids=0)
        if media:
            self._counts.update(dict.fromkeys(media_count_keys(), 0))
        self._category_tokens = np.zeros(0, dtype=np.int64)
        self._category_loss_tokens = np.zeros(0, dtype=np.int64)
        self._max_token_id = -1
        self._closed = False

    # ------------------------------------------------------------------ rows
    def _as_tokens(self, seq: Any, where: str) -> np.ndarray:
        """One sequence as a contiguous structured array of the writer's dtype (validated)."""
        if isinstance(seq, np.ndarray) and seq.dtype == self.dtype:
            if seq.ndim != 1:
                raise ValueError(f"{where}: expected a 1-D structured array, got shape {seq.shape}")
            return np.ascontiguousarray(seq)
        if isinstance(seq, np.ndarray) and seq.dtype.names:
            names = list(seq.dtype.names)
        elif isinstance(seq, Mapping):
            names = list(seq)
        else:
            raise TypeError(f"{where}: a sequence must be a dict of arrays or a structured array, got {type(seq).__name__}")
        missing = [f for f in self.token_fields if f not in names]
        if missing:
            raise ValueError(f"{where}: missing token field(s) {missing}")
        extra = [f for f in names if f not in self.token_fields]
        if extra:
            raise ValueError(f"{where}: field(s) {extra} not in this dataset's token_fields {self.token_fields}")
        length = None
        out = None
        for name in self.token_fields:
            arr = np.asarray(seq[name])
            if arr.ndim != 1:
                raise ValueError(f"{where}: {name} must be 1-D, got shape {arr.shape}")
            if length is None:
                length = arr.shape[0]
                out = np.empty(length, dtype=self.dtype)
            elif arr.shape[0] != length:
                raise ValueError(f"{where}: {name} has {arr.shape[0]} tokens, input_ids has {length}")
            if arr.dtype.kind not in "iu":
                if arr.size:
                    raise ValueError(f"{where}: {name} must be integers, got dtype {arr.dtype}")
            target = np.dtype(KNOWN_TOKEN_FIELDS[name])
            if arr.size and not np.can_cast(arr.dtype, target, casting="safe"):
                info = np.iinfo(target)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise ValueError(f"{where}: {name} value out of {target.name} range [{lo}, {hi}]")
            out[name] = arr
        return out

    def add_row(
        self,
        sequences: Sequence[Any],
        record_indices: Sequence[int] | None = None,
        uids: Sequence[Sequence[int]] | None = None,
        media: Sequence[Sequence[StoredMedia]] | None = None,
    ) -> None:
        """Append one row made of `sequences` (in order). record_indices default to -1, uids to none; `media`
        (a media store only): each sequence's media, in the order of their token runs."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        n = len(sequences)
        row_no = self._counts["rows"]
        if n == 0:
            raise ValueError(f"row {row_no}: a row needs at least one sequence")
        if media is not None and not self.media:
            raise ValueError(f"row {row_no}: media given to a writer without a media store (media=True)")
        if media is not None and len(media) != n:
            raise ValueError(f"row {row_no}: {len(media)} media lists for {n} sequences")
        if record_indices is not None and len(record_indices) != n:
            raise ValueError(f"row {row_no}: {len(record_indices)} record_indices for {n} sequences")
        if uids is not None and len(uids) != n:
            raise ValueError(f"row {row_no}: {len(uids)} uid lists for {n} sequences")
        parts = []
        for k, seq in enumerate(sequences):
            toks = self._as_tokens(seq, f"row {row_no} sequence {k}")
            if toks.shape[0] == 0:
                raise ValueError(f"row {row_no} sequence {k}: empty sequence")
            parts.append(toks)
        # copies go through uint8 views: numpy copies structured arrays element by element, ~30x slower
        if n > 1:
            row_tokens = np.concatenate([p.view(np.uint8) for p in parts]).view(self.dtype)
        elif not parts[0].flags.owndata:  # the caller's memory: copy, as it is written after we return
            row_tokens = parts[0].view(np.uint8).copy().view(self.dtype)
        else:
            row_tokens = parts[0]
        trained = row_tokens["labels"] != IGNORE_INDEX
        cats = row_tokens["category_ids"]
        if cats.min() < 0:
            raise ValueError(f"row {row_no}: negative category_ids")
        seq_lens = [p.shape[0] for p in parts]
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(seq_lens[:-1], out=starts[1:])
        seq_loss = np.add.reduceat(trained, starts).tolist() if n > 1 else [int(np.count_nonzero(trained))]
        seq_turns = []
        for k, toks in enumerate(parts):
            turns = toks["turn_ids"]
            if turns.min() < 0:
                raise ValueError(f"row {row_no} sequence {k}: negative turn_ids")
            seq_turns.append(int(np.count_nonzero(np.bincount(turns)[1:])))
        seq_uids = [[] for _ in range(n)] if uids is None else [[int(u) for u in us] for us in uids]
        recs = [-1] * n if record_indices is None else [int(r) for r in record_indices]

        # validated: from here on the writer's state changes
        row_bytes = row_tokens.nbytes + sum(len(item.data) for seq_media in media or () for item in seq_media)
        shard = self._current
        if shard is not None and shard.size > 0 and shard.size + row_bytes > self.max_shard_bytes:
            self._finish_shard()
            shard = None
        if shard is None:
            shard = self._new_shard()
        seq_offset = len(shard.seqs)
        for k in range(n):
            shard.seqs.append((seq_lens[k], recs[k], seq_loss[k], seq_turns[k], len(shard.uids), len(seq_uids[k])))
            shard.uids.extend(seq_uids[k])
        n_tok = row_tokens.shape[0]
        row_loss = sum(seq_loss)
        row_turns = sum(seq_turns)
        # a stepwise tree holds one sample per trained turn (data/shards/prefix_tree.py): count the expansion's
        row_samples = (sum(seq_turns) if structure_of(self.dtype.names) is Structure.TREE
                       else sum(1 for x in seq_loss if x > 0))
        row_data = row_tokens.view(np.uint8)
        crc = zlib.crc32(row_data)
        entries = [shard.add_media(seq_offset + k, item) for k, seq_media in enumerate(media or ())
                   for item in seq_media]
        if entries:
            index = np.array(entries, dtype=MEDIA_DTYPE)
            for entry, item in zip(index, (item for seq_media in media for item in seq_media)):
                crc = media_checksum(crc, entry, item.data)
            count_media(self._counts, index)
        shard.rows.append((shard.n_tokens, n_tok, seq_offset, n, row_loss, row_turns, row_samples, crc))
        shard.append(row_data)
        shard.n_tokens += n_tok
        shard.n_bytes += row_tokens.nbytes
        self._add_category_counts(cats, trained)
        self._max_token_id = max(self._max_token_id, int(row_tokens["input_ids"].max()))

        c = self._counts
        c["rows"] += 1
        c["sequences"] += n
        c["tokens"] += n_tok
        c["loss_tokens"] += row_loss
        c["trained_turns"] += row_turns
        c["samples"] += row_samples
        c["uids"] += sum(len(us) for us in seq_uids)

    def append_dataset(self, part_dir: str | os.PathLike) -> None:
        """Append every shard of a closed dataset written with this writer's token fields (e.g. by another
        process), as if its rows had been added here: its files move in under the next shard names, its counts
        add up, and `part_dir` is removed. With `shard_ranges` cutting the rows, the result is byte-identical
        to writing every row through one writer (data/engine_ray.py spreads row writing over workers so)."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        part_dir = Path(part_dir)
        part = read_meta(part_dir)
        fields = list(part["token_fields"])
        if fields != self.token_fields:
            raise ValueError(f"{part_dir}: token fields {fields} differ from this dataset's {self.token_fields}")
        if bool(part.get("media_store")) != self.media or part.get("image_store"):
            raise ValueError(f"{part_dir}: media_store {bool(part.get('media_store'))}, this dataset's {self.media}")
        self._finish_shard()
        for shard in part["shards"]:
            name = _shard_name(len(self._shards))
            files = {}
            for kind, info in shard["files"].items():
                files[kind] = {**info, "file": _shard_file(name, kind)}
                os.replace(part_dir / info["file"], self.tmp_dir / files[kind]["file"])
            self._shards.append({**shard, "name": name, "files": files})
        counts = part["counts"]
        for key in self._counts:
            self._counts[key] += counts[key]
        for cid, n in counts["category_tokens"].items():
            self._grow_categories(int(cid) + 1)
            self._category_tokens[int(cid)] += n
            self._category_loss_tokens[int(cid)] += counts["category_loss_tokens"][cid]
        self._max_token_id = max(self._max_token_id, part["max_token_id"])
        shutil.rmtree(part_dir)

    def add_rows(self, src: "PackedDataset", start: int, end: int) -> None:
        """Rows `[start, end)` of `src` (a dataset with this writer's token fields) added as `add_row` adds each
        of them, giving the same bytes and cut (`ShardCutter`), but copied in bulk: token records as bytes (rows
        valid as `src` holds them), index entries with their offsets shifted."""
        if self._closed:
            raise RuntimeError("ShardWriter is closed")
        if src.token_fields != self.token_fields:
            raise ValueError(f"{src.path}: token fields {src.token_fields} differ from this dataset's "
                             f"{self.token_fields}")
        if src.has_media != self.media:
            raise ValueError(f"{src.path}: media_store {src.has_media}, this dataset's {self.media}")
        if src.has_media and src.format_version != FORMAT_VERSION:  # rows checksummed by another rule
            raise ShardFormatError(f"{src.path}: a format {src.format_version} media dataset cannot be copied in "
                                   "bulk into this format; re-run the stage that made it (sh data_process.sh CONFIG "
                                   "--stages tokenize,pack)")
        for row_slice in src.row_slices(start, end):
            rows = row_slice.rows
            cutter = ShardCutter(self.max_shard_bytes, self._current.size if self._current is not None else 0)
            cuts = cutter.cut(row_slice.nbytes)
            for j, (run_start, run_end) in enumerate(zip([0, *cuts], [*cuts, len(rows)])):
                if j:  # a run after a cut starts a shard (the first may be empty: a cut before the first row)
                    self._finish_shard()
                if run_end > run_start:
                    self._copy_run(src.stored_run(row_slice.shard, rows[run_start:run_end]))

    def _copy_run(self, run: "StoredRun") -> None:
        """Append a run of consecutive stored rows (`PackedDataset.stored_run`) to the current shard, which takes
        them all."""
        shard = self._current
        if shard is None:
            shard = self._new_shard()
        tok_lo, seq_lo, uid_lo = run.token_offset, run.seq_offset, run.uid_offset
        seqs = np.array(run.seqs)
        uids = run.uids
        tokens = run.tokens
        rows = np.array(run.rows)
        rows["token_offset"] += shard.n_tokens - tok_lo
        rows["seq_offset"] += len(shard.seqs) - seq_lo
        seqs["uid_offset"] += len(shard.uids) - uid_lo
        if self.media and len(run.media):
            index = np.array(run.media)
            byte_lo = int(index["byte_offset"][0])
            index["seq"] += len(shard.seqs) - seq_lo
            index["byte_offset"] += shard.media_bytes - byte_lo
            shard.media.extend(index.tolist())
            shard.add_media_bytes(run.media_data)
            count_media(self._counts, index)
        shard.rows.extend(rows.tolist())
        shard.seqs.extend(seqs.tolist())
        shard.uids.extend(uids.tolist())
        shard.append(tokens.view(np.uint8))
        shard.n_tokens += tokens.shape[0]
        shard.n_bytes += tokens.nbytes
        self._add_category_counts(tokens["category_ids"], tokens["labels"] != IGNORE_INDEX)
        self._max_token_id = max(self._max_token_id, int(tokens["input_ids"].max()))
        c = self._counts
        c["rows"] += len(rows)
        c["sequences"] += len(seqs)
        c["tokens"] += tokens.shape[0]
        c["loss_tokens"] += int(rows["n_loss_tokens"].sum())
        c["trained_turns"] += int(rows["n_trained_turns"].sum())
        c["samples"] += int(rows["n_samples"].sum())
        c["uids"] += len(uids)

    def _new_shard(self) -> _ShardBuffer:
        self._current = _ShardBuffer(self.tmp_dir, len(self._shards), self.durable, self.media)
        return self._current

    def _grow_categories(self, size: int) -> None:
        grow = size - self._category_tokens.shape[0]
        if grow > 0:
            self._category_tokens = np.concatenate([self._category_tokens, np.zeros(grow, dtype=np.int64)])
            self._category_loss_tokens = np.concatenate([self._category_loss_tokens, np.zeros(grow, dtype=np.int64)])

    def _add_category_counts(self, cats: np.ndarray, trained: np.ndarray) -> None:
        both = np.bincount(cats.astype(np.intp) * 2 + trained)  # one pass: [c untrained, c trained, ...]
        if both.shape[0] % 2:
            both = np.append(both, 0)
        loss = both[1::2]
        tok = both[0::2] + loss
        self._grow_categories(tok.shape[0])
        self._category_tokens[: tok.shape[0]] += tok
        self._category_loss_tokens[: loss.shape[0]] += loss

    @property
    def counts(self) -> dict:
        """Totals so far: rows, sequences, tokens, loss_tokens, trained_turns, samples, uids, and per category id
        (only ids that occur) `category_tokens` / `category_loss_tokens`."""
        present = np.flatnonzero(self._category_tokens)
        return dict(
            self._counts,
            shards=len(self._shards) + (self._current is not None),
            category_tokens={int(c): int(self._category_tokens[c]) for c in present},
            category_loss_tokens={int(c): int(self._category_loss_tokens[c]) for c in present},
        )

    def _finish_shard(self) -> None:
        shard = self._current
        if shard is None:
            return
        digest = shard.finish()
        files = {"tokens": {"file": shard.tokens_path.name, "bytes": shard.n_bytes, "blake2b": digest}}
        arrays = {
            "rows": np.array(shard.rows, dtype=ROW_DTYPE),
            "seqs": np.array(shard.seqs, dtype=SEQ_DTYPE),
            "uids": np.array(shard.uids, dtype=UID_DTYPE),
        }
        for kind, arr in arrays.items():
            path = self.tmp_dir / _shard_file(shard.name, kind)
            with open(path, "wb") as f:
                np.save(f, arr, allow_pickle=False)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            files[kind] = {"file": path.name, "bytes": path.stat().st_size, "blake2b": file_blake2b(path)}
        entry = {"name": shard.name, "rows": len(shard.rows), "sequences": len(shard.seqs), "tokens": shard.n_tokens,
                 "uids": len(shard.uids), "files": files}
        if self.media:
            digest = shard.finish_media()
            files["media_data"] = {"file": shard.media_path.name, "bytes": shard.media_bytes, "blake2b": digest}
            path = self.tmp_dir / _shard_file(shard.name, "media")
            with open(path, "wb") as f:
                np.save(f, np.array(shard.media, dtype=MEDIA_DTYPE), allow_pickle=False)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            files["media"] = {"file": path.name, "bytes": path.stat().st_size, "blake2b": file_blake2b(path)}
            entry["media"] = len(shard.media)
        self._shards.append(entry)
        self._current = None

    # ------------------------------------------------------------------ close
    def close(self, meta_extra: Mapping[str, Any] | None = None, extra_files: Mapping[str, bytes] | None = None) -> dict:
        """Finish the last shard, write meta.json (+ `extra_files`, e.g. stats) and move the dataset into place
        (replacing an old one). Returns the manifest as written."""
        if self._closed:
            raise RuntimeError("ShardWriter is already closed")
        extra = dict(meta_extra or {})
        clash = [k for k in extra if k in RESERVED_META_KEYS]
        if clash:
            self.abort()
            raise ValueError(f"meta_extra may not set reserved key(s) {clash}")
        files = dict(extra_files or {})
        bad = [n for n in files if n == "meta.json" or n.startswith("shard_") or "/" in n or n.startswith(".")]
        if bad:
            self.abort()
            raise ValueError(f"extra_files may not be named {bad}")
        self._finish_shard()
        write = write_synced if self.durable else Path.write_bytes
        for name, data in files.items():
            write(self.tmp_dir / name, data)
        meta = orjson.loads(dump_json({  # as read back: the checksum covers what readers parse
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "row_checksum": ROW_CHECKSUM,
            "kind": self.kind,
            "token_fields": {name: KNOWN_TOKEN_FIELDS[name] for name in self.token_fields},
            "counts": self.counts,
            "max_token_id": self._max_token_id,
            **({"media_store": True} if self.media else {}),
            **extra,
            "shards": self._shards,
        }))
        meta[MANIFEST_CHECKSUM] = manifest_checksum(meta)
        write(self.tmp_dir / "meta.json", dump_json(meta))
        if self.durable:
            fsync_dir(self.tmp_dir)
        self._closed = True
        replace_dir(self.tmp_dir, self.out_dir, self.durable)
        return meta

    def abort(self) -> None:
        """Drop everything written so far (the temp directory); `out_dir` is left untouched."""
        if self._current is not None:
            self._current.discard()
            self._current = None
        self._closed = True
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._closed:
            self.abort()


class ShardCutter:
    """The shard cut of `ShardWriter.add_row` over rows given a batch at a time: a row that would take a non-empty
    shard past `max_shard_bytes` starts the next one. Costs O(shards) steps over numpy sums, not a step a row."""

    def __init__(self, max_shard_bytes: int, fill: int = 0):
        self.max_shard_bytes = int(max_shard_bytes)
        self.fill = int(fill)  # bytes of the shard being filled

    def cut(self, row_nbytes: Sequence[int]) -> list[int]:
        """The next rows (their byte sizes, each > 0): the indices among them of the rows that start a shard."""
        ends = np.cumsum(np.asarray(row_nbytes, dtype=np.int64))  # ends[i]: bytes of rows 0..i
        cuts: list[int] = []
        start, before = 0, 0  # the shard's first row here, and the bytes of the rows before it
        while start < len(ends):
            over = int(np.searchsorted(ends, self.max_shard_bytes - self.fill + before, side="right"))
            if over == start and self.fill == 0:  # a row larger than a shard fills an empty one alone
                over += 1
            if over >= len(ends):
                self.fill += int(ends[-1]) - before
                break
            cuts.append(over)
            start, before, self.fill = over, int(ends[over - 1]) if over else 0, 0
        return cuts

    def cut_lazily(self, nbytes: int, row_nbytes: Callable[[], Sequence[int]]) -> list[int]:
        """`cut` for rows of `nbytes` in all, whose sizes `row_nbytes()` gives: called only when a cut falls among
        them (rows that fit the current shard need no per-row sizes)."""
        if self.fill + nbytes <= self.max_shard_bytes:
            self.fill += int(nbytes)
            return []
        return self.cut(row_nbytes())


def shard_ranges(row_nbytes: Sequence[int], max_shard_bytes: int) -> list[tuple[int, int]]:
    """`[start, end)` row ranges of the shards `ShardWriter.add_row` cuts for rows of these byte sizes
    (`ShardCutter`)."""
    if not len(row_nbytes):
        return []
    starts = [0, *ShardCutter(max_shard_bytes).cut(row_nbytes)]
    return list(zip(starts, starts[1:] + [len(row_nbytes)]))


# ---------------------------------------------------------------------------------------------- the pipeline's report
# The data pipeline's report.json (data/report.py), in the output_dir that holds a dataset it wrote, moves under
# `stale` the sections of the stages whose outputs a later run of an earlier stage invalidated: `--stages tokenize`
# alone leaves packed/ made from the tokenized data before it.
PIPELINE_REPORT, STALE = "report.json", "stale"
STAGE_OF_KIND = {"tokenized": "tokenize", "packed": "pack"}  # the pipeline stage whose output a dataset is


def stale_stages(path: str | os.PathLike) -> tuple[Path, list[str]] | None:
    """(the report, the stages to re-run) when the data pipeline's report.json beside dataset `path` lists the stage
    that wrote it under `stale`: the stale stages in pipeline order (as the report lists them) up to that one.
    None otherwise (no report: a dataset the pipeline did not write; or one it wrote since)."""
    path = Path(path)
    report_path = path.parent / PIPELINE_REPORT
    try:
        report = orjson.loads(report_path.read_bytes())
        stage = STAGE_OF_KIND.get(read_meta(path).get("kind"))
    except (OSError, orjson.JSONDecodeError, ShardFormatError):
        return None
    stale = list(report.get(STALE) or {}) if isinstance(report, dict) else []
    if stage not in stale:
        return None
    return report_path, stale[:stale.index(stage) + 1]


# ---------------------------------------------------------------------------------------------- reader
def read_meta(path: str | os.PathLike) -> dict:
    """Parse and check `meta.json` of a dataset directory (format name and version)."""
    meta_path = Path(path) / "meta.json"
    aside = set_aside(Path(path))
    if aside:
        fix = "re-run the stage (it moves it back first) or rename it back" if len(aside) == 1 else \
            "rename the right one back"
        raise ShardFormatError(
            f"{path}: missing, but {', '.join(map(str, aside))} holds the previous output (a run was killed while "
            f"replacing it): {fix} to {path}"
        )
    if not meta_path.is_file():
        raise ShardFormatError(f"{meta_path}: missing (not an indexed dataset, or it was not closed)")
    try:
        meta = orjson.loads(meta_path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ShardFormatError(f"{meta_path}: manifest does not parse: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise ShardFormatError(f"{meta_path}: not a {FORMAT_NAME} manifest")
    version = meta.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version < min(READ_VERSIONS):
        raise ShardFormatError(
            f"{meta_path}: format_version {version} was written by an older PackSFT (this code reads versions "
            f"{min(READ_VERSIONS)}..{FORMAT_VERSION}; version 2 added per-row checksums); rewrite the dataset by "
            "re-running the stage that made it: sh data_process.sh CONFIG --stages tokenize,pack"
        )
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise ShardFormatError(
            f"{meta_path}: format_version {version!r} is not supported by this code (expects {FORMAT_VERSION}); "
            "re-run the tokenize/pack stage with this code, or update PackSFT"
        )
    if meta.get("row_checksum") != ROW_CHECKSUM:
        raise ShardFormatError(
            f"{meta_path}: row_checksum {meta.get('row_checksum')!r} is not supported (this code checks "
            f"{ROW_CHECKSUM!r}); re-run the tokenize/pack stage with this code"
        )
    for key in ("kind", "token_fields", "counts", "shards"):
        if key not in meta:
            raise ShardFormatError(f"{meta_path}: manifest field {key!r} missing")
    if meta["kind"] not in ("packed", "tokenized"):
        raise ShardFormatError(f"{meta_path}: kind {meta['kind']!r} is neither 'packed' nor 'tokenized'")
    fields = meta["token_fields"]
    if not isinstance(fields, dict) or any(KNOWN_TOKEN_FIELDS.get(k) != v for k, v in fields.items()):
        raise ShardFormatError(f"{meta_path}: token_fields {fields!r} do not match the known fields and dtypes "
                               f"{KNOWN_TOKEN_FIELDS}")
    if not isinstance(meta["shards"], list):
        raise ShardFormatError(f"{meta_path}: shards must be a list")
    for i, shard in enumerate(meta["shards"]):
        try:
            ok = all(isinstance(shard[k], int) for k in ("rows", "sequences", "tokens", "uids")) and all(
                isinstance(shard["files"][kind]["file"], str)
                and isinstance(shard["files"][kind]["bytes"], int)
                and isinstance(shard["files"][kind]["blake2b"], str)
                for kind in SHARD_FILES
            )
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise ShardFormatError(f"{meta_path}: shards[{i}] is malformed: {shard!r}"[:500])
    if MANIFEST_CHECKSUM in meta and meta[MANIFEST_CHECKSUM] != manifest_checksum(meta):
        stage = "tokenize,pack" if meta["kind"] == "tokenized" else "pack"
        raise ShardFormatError(
            f"{meta_path}: manifest checksum mismatch: meta.json changed after it was written (an edit, or damage), "
            f"so its counts, max_token_id and shard checksums cannot be trusted; re-create {path} (sh data_process.sh "
            f"CONFIG --stages {stage}) instead of editing it"
        )
    return meta


def trusted_manifest(meta: Mapping[str, Any]) -> bool:
    """Whether `meta` (from read_meta) carries its own checksum, i.e. was checked; older datasets' manifests were
    not, and what they claim about the tokens (max_token_id) is read from the tokens instead."""
    return MANIFEST_CHECKSUM in meta


def _concat_shards(parts: list[np.ndarray], dtype) -> np.ndarray:
    """Per-shard arrays as one: the memmap view itself for one shard (no copy), else a concatenation."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts)


class WholeRowColumn:
    """A `PackedDataset` attribute: one row-index column of the whole dataset (`row_column`), built on first use
    and then kept."""

    def __init__(self, field: str):
        self.field = field

    def __set_name__(self, owner, name: str) -> None:
        self.attribute = name

    def __get__(self, ds, owner=None):
        if ds is None:
            return self
        column = ds.__dict__[self.attribute] = ds.row_column(self.field)
        return column


class PackedDataset:
    """Random access to the rows of an indexed dataset (packed/ or tokenized/), all memory-mapped.

    `verify` (VERIFY_MODES): `rows` (default) checks each row's crc32 whenever its tokens are read (`ds[i]`,
    `gather`, `row_tokens`), also in DataLoader workers; `full` also re-hashes the token files at open (reads all
    the data once); `off` checks neither (True / False mean `full` / `off`). Index files are always hashed.
    `ds[i]` copies the row out and then drops the mapping of those pages (`release_pages`), so the resident
    set stays flat while an epoch reads every row; the data stays in the page cache, shared by all readers.
    """

    def __init__(self, path: str | os.PathLike, verify: str | bool = "rows", release_pages: bool = True):
        self.path = Path(path)
        self.verify = {True: "full", False: "off"}.get(verify, verify) if isinstance(verify, bool) else verify
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.release_pages = release_pages and hasattr(mmap, "MADV_DONTNEED")
        self._open(hash_index=True)

    def _open(self, hash_index: bool) -> None:
        self.meta = meta = read_meta(self.path)
        self.kind = meta["kind"]
        try:
            self.token_fields = normalize_token_fields(meta["token_fields"])
        except ValueError as exc:
            raise ShardFormatError(f"{self.path / 'meta.json'}: {exc}") from None
        self.dtype = token_dtype(self.token_fields)
        self.structure = structure_of(self.token_fields)
        self.format_version = int(meta["format_version"])
        self.has_media = bool(meta.get("media_store") or meta.get("image_store"))
        self.has_images = self.has_media  # what the trainer's image path keys on (format 2 stores held images only)
        self._media_files = IMAGE_FILES if meta.get("image_store") else MEDIA_FILES
        self._media: list[np.ndarray] = []  # MEDIA_DTYPE index per shard (media datasets)
        self._media_data: list[np.ndarray] = []  # the media's bytes per shard, memory-mapped
        self._media_maps: list[mmap.mmap | None] = []
        self._tokens: list[np.ndarray] = []
        self._maps: list[mmap.mmap | None] = []
        self._rows: list[np.ndarray] = []
        self._seqs: list[np.ndarray] = []
        self._uids: list[np.ndarray] = []
        for shard in meta["shards"]:
            files = shard["files"]
            for kind in SHARD_FILES + (self._media_files if self.has_media else ()):
                entry = files.get(kind)
                if entry is None:
                    raise ShardFormatError(f"{self.path / 'meta.json'}: shard {shard['name']} lists no {kind} file")
                fpath = self.path / entry["file"]
                if not fpath.is_file():
                    raise ShardFormatError(f"{fpath}: shard file missing")
                size = fpath.stat().st_size
                if size != entry["bytes"]:
                    raise ShardFormatError(
                        f"{fpath}: size {size} bytes, manifest says {entry['bytes']} (truncated or overwritten)"
                    )
                hashed = self.verify == "full" if kind in ("tokens", "media_data", "image_data") else hash_index
                if hashed and file_blake2b(fpath) != entry["blake2b"]:
                    raise ShardFormatError(f"{fpath}: checksum mismatch (corrupt shard)")
            tok_path = self.path / files["tokens"]["file"]
            if files["tokens"]["bytes"] != shard["tokens"] * self.dtype.itemsize:
                raise ShardFormatError(f"{tok_path}: {files['tokens']['bytes']} bytes for {shard['tokens']} tokens")
            if shard["tokens"]:
                with open(tok_path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps.append(mm)
                self._tokens.append(np.frombuffer(mm, dtype=self.dtype))
            else:
                self._maps.append(None)
                self._tokens.append(np.empty(0, dtype=self.dtype))
            for kind, dtype, store, count in (
                ("rows", ROW_DTYPE, self._rows, shard["rows"]),
                ("seqs", SEQ_DTYPE, self._seqs, shard["sequences"]),
                ("uids", UID_DTYPE, self._uids, shard["uids"]),
            ):
                fpath = self.path / files[kind]["file"]
                try:
                    arr = np.load(fpath, mmap_mode="r", allow_pickle=False)
                except ValueError as exc:
                    raise ShardFormatError(f"{fpath}: unreadable index: {exc}") from None
                if arr.dtype != dtype or arr.shape != (count,):
                    raise ShardFormatError(f"{fpath}: index has dtype {arr.dtype} shape {arr.shape}, expected {count}")
                store.append(arr)
            if self.has_media:
                self._open_media(shard)
        n_rows = [len(r) for r in self._rows]
        self._row_starts = np.zeros(len(n_rows) + 1, dtype=np.int64)
        np.cumsum(n_rows, out=self._row_starts[1:])
        self._n = int(self._row_starts[-1])
        if self._n != meta["counts"]["rows"]:
            raise ShardFormatError(f"{self.path}: shards hold {self._n} rows, manifest counts {meta['counts']['rows']}")

    def _open_media(self, shard: dict) -> None:
        files = shard["files"]
        index_kind, data_kind = self._media_files
        fpath = self.path / files[index_kind]["file"]
        try:
            index = np.load(fpath, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise ShardFormatError(f"{fpath}: unreadable index: {exc}") from None
        dtype = IMAGE_DTYPE if index_kind == "images" else MEDIA_DTYPE
        if index.dtype != dtype or index.shape != (shard.get(index_kind),):
            raise ShardFormatError(f"{fpath}: index has dtype {index.dtype} shape {index.shape}, expected "
                                   f"{shard.get(index_kind)} entries")
        if dtype is IMAGE_DTYPE:  # format 2's image store, as media entries (images, nothing else)
            entries = np.zeros(len(index), dtype=MEDIA_DTYPE)
            for name in IMAGE_DTYPE.names:
                entries[name] = index[name]
            index = entries
        self._media.append(index)
        mm = None
        if files[data_kind]["bytes"]:
            with open(self.path / files[data_kind]["file"], "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._media_maps.append(mm)
        self._media_data.append(np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.zeros(0, np.uint8))

    def _media_range(self, shard: int, seq_lo: int, seq_hi: int) -> tuple[int, int]:
        """The index entries `[lo, hi)` of the media of shard-local sequences `[seq_lo, seq_hi)`."""
        seqs = self._media[shard]["seq"]
        return int(np.searchsorted(seqs, seq_lo, "left")), int(np.searchsorted(seqs, seq_hi, "left"))

    def _row_media(self, shard: int, r: int) -> np.ndarray:
        row = self._rows[shard][r]
        lo, hi = self._media_range(shard, int(row["seq_offset"]), int(row["seq_offset"] + row["n_seqs"]))
        return self._media[shard][lo:hi]

    def _media_bytes(self, shard: int, entry) -> np.ndarray:
        off, n = int(entry["byte_offset"]), int(entry["n_bytes"])
        data = self._media_data[shard][off:off + n]
        if data.shape[0] != n:
            raise ShardFormatError(f"{self.path / self.meta['shards'][shard]['files'][self._media_files[1]]['file']}:"
                                   f" a media item at bytes {off}..{off + n} lies outside the file (corrupt index)")
        return data

    def _stored(self, shard: int, entry) -> StoredMedia:
        return StoredMedia(MEDIA_KINDS[int(entry["kind"])], self._media_bytes(shard, entry).tobytes(),
                           tuple(int(v) for v in entry["grid"]), int(entry["n_tokens"]), int(entry["flags"]),
                           int(entry["audio_frames"]), int(entry["millis"]))

    def row_media(self, i: int) -> list[list[StoredMedia]]:
        """The media of each sequence of row `i` (a media dataset; rows are checked as `row_tokens` checks), in the
        order of their token runs."""
        shard, r = self._locate(i)
        self._checked_view(shard, r)
        return self._sequence_media(shard, r)

    def _sequence_media(self, shard: int, r: int) -> list[list[StoredMedia]]:
        row = self._rows[shard][r]
        out: list[list[StoredMedia]] = [[] for _ in range(int(row["n_seqs"]))]
        for entry in self._row_media(shard, r):
            out[int(entry["seq"] - row["seq_offset"])].append(self._stored(shard, entry))
        return out

    # Whole-dataset row columns, built on first use: a memmap view for one shard, else a concatenation (8 bytes a
    # row), which readers of a slice (`row_column`) never pay for.
    row_n_tokens = WholeRowColumn("n_tokens")
    row_n_seqs = WholeRowColumn("n_seqs")
    row_n_loss_tokens = WholeRowColumn("n_loss_tokens")
    row_n_trained_turns = WholeRowColumn("n_trained_turns")
    row_n_samples = WholeRowColumn("n_samples")

    def _shard_spans(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(shard, first, end) local row ranges of the shards holding rows `[start, end)`, in row order."""
        if end <= start:
            return
        first = max(0, int(np.searchsorted(self._row_starts, start, side="right")) - 1)
        for k in range(first, len(self._rows)):
            lo, hi = int(self._row_starts[k]), int(self._row_starts[k + 1])
            if lo >= end:
                break
            if hi > start:
                yield k, max(start, lo) - lo, min(end, hi) - lo

    def shard_row_ranges(self) -> list[tuple[int, int]]:
        """Each shard's rows `[start, end)`."""
        bounds = self._row_starts.tolist()
        return list(zip(bounds[:-1], bounds[1:]))

    def row_column(self, name: str, start: int = 0, end: int | None = None) -> np.ndarray:
        """One row-index column (`ROW_DTYPE` field) of rows `[start, end)`, reading only the shards that hold them
        (a memmap view when one shard does)."""
        end = self._n if end is None else min(end, self._n)
        return _concat_shards([self._rows[k][name][a:b] for k, a, b in self._shard_spans(start, end)],
                              ROW_DTYPE[name])

    def row_nbytes(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """The size of each row of `[start, end)` as `pack.shard_size_mb` counts it: its token records and its
        media's encoded bytes (from the index only)."""
        end = self._n if end is None else min(end, self._n)
        return _concat_shards([self._local_row_nbytes(k, a, b) for k, a, b in self._shard_spans(start, end)],
                              np.dtype(np.int64))

    def row_slices(self, start: int, end: int) -> Iterator["RowSlice"]:
        """Rows `[start, end)` shard by shard, as stored: each source shard's part of the range as a `RowSlice` (its
        index entries and each row's stored bytes: token records plus media bytes), for a writer that copies rows
        in bulk (`ShardWriter.add_rows`)."""
        for k, (first, last) in enumerate(zip(self._row_starts[:-1].tolist(), self._row_starts[1:].tolist())):
            a, b = max(start, first) - first, min(end, last) - first  # this shard's rows, locally
            if a < b:
                yield RowSlice(k, self._rows[k][a:b], self._local_row_nbytes(k, a, b))

    def stored_run(self, shard: int, rows: np.ndarray) -> "StoredRun":
        """What consecutive `rows` (index entries of a `RowSlice` of `shard`) point to, as stored (views of the
        memory maps): their sequences, uids, token records and media, with the offsets they start at."""
        first, last = rows[0], rows[-1]
        tok_lo, tok_hi = int(first["token_offset"]), int(last["token_offset"] + last["n_tokens"])
        seq_lo, seq_hi = int(first["seq_offset"]), int(last["seq_offset"] + last["n_seqs"])
        seqs = self._seqs[shard][seq_lo:seq_hi]
        uid_lo = int(seqs[0]["uid_offset"])
        uids = self._uids[shard][uid_lo:uid_lo + int(seqs["n_uids"].sum())]
        media, media_data = None, None
        if self.has_media:
            lo, hi = self._media_range(shard, seq_lo, seq_hi)
            media = self._media[shard][lo:hi]
            if hi > lo:
                byte_lo = int(media["byte_offset"][0])
                byte_hi = int(media["byte_offset"][-1] + media["n_bytes"][-1])
                media_data = self._media_data[shard][byte_lo:byte_hi]
        return StoredRun(rows, seqs, uids, self._tokens[shard][tok_lo:tok_hi], tok_lo, seq_lo, uid_lo, media,
                         media_data)

    def _local_row_nbytes(self, shard: int, a: int, b: int) -> np.ndarray:
        rows = self._rows[shard][a:b]
        nbytes = rows["n_tokens"].astype(np.int64) * self.dtype.itemsize
        if self.has_media and len(self._media[shard]):
            index = self._media[shard]
            before = np.concatenate([[0], np.cumsum(index["n_bytes"], dtype=np.int64)])
            first = rows["seq_offset"].astype(np.int64)
            lo = np.searchsorted(index["seq"], first, "left")
            hi = np.searchsorted(index["seq"], first + rows["n_seqs"], "left")
            nbytes += before[hi] - before[lo]
        return nbytes

    def row_range_sequences(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """The per-sequence index records (`SEQ_DTYPE`) and the uids of rows `[start, end)`, in row order."""
        seqs, uids = [], []
        for k, a, b in self._shard_spans(start, min(end, self._n)):
            rows = self._rows[k][a:b]
            lo, hi = int(rows["seq_offset"][0]), int(rows["seq_offset"][-1] + rows["n_seqs"][-1])
            shard_seqs = self._seqs[k][lo:hi]
            seqs.append(shard_seqs)
            if hi > lo:
                first, last = shard_seqs[0], shard_seqs[-1]
                uids.append(self._uids[k][int(first["uid_offset"]):int(last["uid_offset"] + last["n_uids"])])
        return _concat_shards(seqs, SEQ_DTYPE), _concat_shards(uids, UID_DTYPE)

    # ------------------------------------------------------------------ pickling (DataLoader workers)
    def __getstate__(self) -> dict:
        """Only the path travels; the copy re-maps the files (sizes re-checked, file hashes already were) and keeps
        checking rows unless verification is off."""
        return {"path": self.path, "release_pages": self.release_pages,
                "verify": "off" if self.verify == "off" else "rows"}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self.verify = state["verify"]
        self.release_pages = state["release_pages"]
        self._open(hash_index=False)

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return self._n

    @property
    def categories(self) -> dict[int, str]:
        return {int(k): v for k, v in (self.meta.get("categories") or {}).items()}

    def _locate(self, i: int) -> tuple[int, int]:
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} out of range for a dataset of {self._n} rows")
        shard = int(np.searchsorted(self._row_starts, i, side="right")) - 1
        return shard, i - int(self._row_starts[shard])

    def _checked_view(self, shard: int, r: int) -> np.ndarray:
        """The token records of row `r` of `shard` (a memory-mapped view), checked against the row's crc32."""
        row = self._rows[shard][r]
        off, n = int(row["token_offset"]), int(row["n_tokens"])
        view = self._tokens[shard][off : off + n]
        if self.verify == "off":
            return view
        if off < 0 or view.shape[0] != n:
            self._corrupt(shard, r, f"the index places it at tokens {off}..{off + n}, outside the shard")
        actual = zlib.crc32(view.view(np.uint8))
        if self.has_media:
            for entry in self._row_media(shard, r):
                actual = media_checksum(actual, entry, self._media_bytes(shard, entry), self.format_version)
        if actual != int(row["checksum"]):
            self._corrupt(shard, r, f"{ROW_CHECKSUM} of its {n} token records is {actual:#010x}, the index says "
                          f"{int(row['checksum']):#010x}")
        return view

    def _corrupt(self, shard: int, r: int, what: str) -> None:
        name = self.meta["shards"][shard]["files"]["tokens"]["file"]
        stage = "tokenize,pack" if self.kind == "tokenized" else "pack"
        raise ShardFormatError(
            f"{self.path / name}: row {int(self._row_starts[shard]) + r} (row {r} of the shard) is corrupt: {what}; "
            f"the file changed after it was written: re-create {self.path} (sh data_process.sh CONFIG --stages "
            f"{stage}) and check the disk"
        )

    def row_tokens(self, i: int) -> np.ndarray:
        """The structured token records of row `i` (a memory-mapped view, nothing copied; checked per `verify`)."""
        return self._checked_view(*self._locate(i))

    def row_sequences(self, i: int) -> np.ndarray:
        """The per-sequence index records (SEQ_DTYPE) of row `i`."""
        shard, r = self._locate(i)
        row = self._rows[shard][r]
        off, n = int(row["seq_offset"]), int(row["n_seqs"])
        return self._seqs[shard][off : off + n]

    def row_uids(self, i: int) -> list[np.ndarray]:
        """Source-record uids of each sequence of row `i`."""
        shard, r = self._locate(i)
        row = self._rows[shard][r]
        off, n = int(row["seq_offset"]), int(row["n_seqs"])
        seqs = self._seqs[shard][off : off + n]
        uids = self._uids[shard]
        return [np.array(uids[s["uid_offset"] : s["uid_offset"] + s["n_uids"]]) for s in seqs]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """Row `i` as numpy arrays: the token fields, `seq_lens` and `record_index` (copies)."""
        return self.gather([i])

    def gather(self, rows: Iterable[int]) -> dict[str, np.ndarray]:
        """Rows concatenated in the given order, as one row dict like `ds[i]` (online packing of tokenized rows).

        Each field is copied straight from the mapped shards (one copy); with `release_pages` the pages read are
        then unmapped from this process."""
        tokens, seqs, views, media = [], [], [], []
        for i in rows:
            shard, r = self._locate(i)
            row = self._rows[shard][r]
            so, ns = int(row["seq_offset"]), int(row["n_seqs"])
            tokens.append((shard, int(row["token_offset"]), int(row["n_tokens"])))
            seqs.append(self._seqs[shard][so : so + ns])
            views.append(self._checked_view(shard, r))
            if self.has_media:
                entries = self._row_media(shard, r)
                media += self._sequence_media(shard, r)
                if self.release_pages and len(entries):  # as for the tokens below: the resident set stays flat
                    start = int(entries["byte_offset"][0]) & ~(mmap.PAGESIZE - 1)
                    end = int(entries["byte_offset"][-1] + entries["n_bytes"][-1])
                    self._media_maps[shard].madvise(mmap.MADV_DONTNEED, start, end - start)
        if not views:
            out = {name: np.zeros(0, dtype=self.dtype[name]) for name in self.token_fields}
            out["seq_lens"] = np.zeros(0, dtype=np.int64)
            out["record_index"] = np.zeros(0, dtype=np.int64)
            return out
        out = {name: np.concatenate([v[name] for v in views]) for name in self.token_fields}
        out["seq_lens"] = np.concatenate([s["length"] for s in seqs])
        out["record_index"] = np.concatenate([s["record_index"] for s in seqs])
        if self.has_media:  # in the order of their token runs in the rows
            out["media"] = media  # per sequence (as seq_lens), its StoredMedia
            images = [item for seq_media in media for item in seq_media if item.kind == "image"]
            out["image_data"] = [item.data for item in images]  # the images alone, as format 2 gave them
            out["image_grid_thw"] = np.array([item.grid for item in images], dtype=np.int64).reshape(-1, 3)
        if self.release_pages:
            size = self.dtype.itemsize
            for shard, off, n in tokens:
                start = (off * size) & ~(mmap.PAGESIZE - 1)
                self._maps[shard].madvise(mmap.MADV_DONTNEED, start, (off + n) * size - start)
        return out

    def release(self) -> None:
        """Unmap every token page this process touched (they stay in the page cache): keeps the resident set flat
        for readers that go through the zero-copy `row_tokens` views. Earlier views stay valid (re-faulted)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        for mm in self._maps + self._media_maps:
            if mm is not None:
                mm.madvise(mmap.MADV_DONTNEED)

    def __iter__(self):
        for i in range(self._n):
            yield self[i]

    # ------------------------------------------------------------------ whole-dataset views
    @property
    def seq_index(self) -> np.ndarray:
        """All per-sequence index records in row order (concatenated over shards; no token data)."""
        return _concat_shards(self._seqs, SEQ_DTYPE)

    def seq_column(self, name: str) -> np.ndarray:
        """One per-sequence index column (`SEQ_DTYPE` field) in row order: a memmap view for one shard, else a
        concatenation of that column alone (8 bytes a sequence, where `seq_index` copies all its fields)."""
        return _concat_shards([seqs[name] for seqs in self._seqs], SEQ_DTYPE[name])

    @property
    def all_uids(self) -> np.ndarray:
        """All uids in sequence order (concatenated over shards)."""
        return _concat_shards(self._uids, UID_DTYPE)

    def uid_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(uids, rows): every source uid of every sequence with the row holding it (the uid -> row trace)."""
        uids, rows = [], []
        for k, (row_idx, seqs) in enumerate(zip(self._rows, self._seqs)):
            row_of_seq = np.repeat(np.arange(len(row_idx), dtype=np.int64) + self._row_starts[k], row_idx["n_seqs"])
            rows.append(np.repeat(row_of_seq, seqs["n_uids"]))
            uids.append(np.asarray(self._uids[k]))
        if not uids:
            return np.zeros(0, dtype=UID_DTYPE), np.zeros(0, dtype=np.int64)
        return np.concatenate(uids), np.concatenate(rows)

    def token_chunks(self, chunk_tokens: int = 1 << 24) -> Iterable[np.ndarray]:
        """Every token record in storage order, in memory-mapped chunks (for whole-dataset statistics)."""
        for tokens in self._tokens:
            for start in range(0, tokens.shape[0], chunk_tokens):
                yield tokens[start : start + chunk_tokens]

    def __repr__(self) -> str:
        c = self.meta["counts"]
        return f"PackedDataset({str(self.path)!r}, kind={self.kind}, rows={c['rows']}, tokens={c['tokens']})"
