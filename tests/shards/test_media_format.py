"""The media store of the shard format (format 3): images, videos and audio clips beside the tokens, with their kind,
flags, grids, audio frames and durations, counted and checksummed with the rows; format 2's image stores stay
readable (tests/shards/format2_image_store was written by format 2's writer). No decoding here (plain .venv)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data.shards.dataset import (AUDIO_IN_VIDEO, FORMAT_VERSION, PackedDataset, ShardFormatError, ShardWriter,
                                 StoredMedia)
from data.shards.media import MediaLoader

FORMAT2 = Path(__file__).parent / "format2_image_store"


def _seq(ids):
    ids = np.asarray(ids, dtype=np.int32)
    return {"input_ids": ids, "labels": np.where(ids > 5, ids, -100).astype(np.int32),
            "category_ids": np.zeros_like(ids, dtype=np.int16), "turn_ids": (ids > 5).astype(np.int16)}


ITEMS = [StoredMedia("video", b"v" * 30, (2, 4, 6), 12, AUDIO_IN_VIDEO, 212, 2064),
         StoredMedia("audio", b"a" * 20, (0, 0, 0), 5, 0, 150, 1500),
         StoredMedia("image", b"i" * 10, (1, 2, 2), 1),
         StoredMedia("video", b"w" * 40, (3, 2, 2), 3, 0, 0, 3000)]


def test_the_media_store_round_trips_counts_and_checks_every_field(tmp_path):
    with ShardWriter(tmp_path / "src", kind="tokenized", media=True, max_shard_bytes=120) as w:
        w.add_row([_seq([1, 7, 7, 8])], media=[ITEMS[:2]])
        w.add_row([_seq([1, 9])])
        w.add_row([_seq([1, 2, 6, 6])], media=[ITEMS[2:]])
        w.close({"media": {"processor_path": "/p", "video_fps": 2.0}})
    src = PackedDataset(tmp_path / "src", verify="full")
    assert src.meta["format_version"] == FORMAT_VERSION == 3 and src.meta["media_store"]
    assert [src.row_media(i) for i in range(3)] == [[ITEMS[:2]], [[]], [ITEMS[2:]]]
    counts = src.meta["counts"]
    assert (counts["videos"], counts["video_tokens"], counts["video_bytes"], counts["video_millis"]) == (2, 15, 70, 5064)
    assert (counts["audios"], counts["audio_tokens"], counts["audio_millis"], counts["videos_with_audio"]) == \
        (1, 5, 1500, 1)
    assert (counts["images"], counts["image_tokens"], counts["image_bytes"]) == (1, 1, 10)
    both = src.gather([2, 0])
    assert both["media"] == [ITEMS[2:], ITEMS[:2]]  # per sequence, in the gathered order
    assert both["image_data"] == [b"i" * 10] and both["image_grid_thw"].tolist() == [[1, 2, 2]]
    # packed rows of several sequences, the bulk copy re-cut into small shards: the same items and counts
    with ShardWriter(tmp_path / "packed", media=True) as w:
        w.add_row([src.row_tokens(2), src.row_tokens(0)], media=[src.row_media(2)[0], src.row_media(0)[0]])
        w.close()
    assert PackedDataset(tmp_path / "packed", verify="full").row_media(0) == [ITEMS[2:], ITEMS[:2]]
    with ShardWriter(tmp_path / "copy", kind="tokenized", media=True, max_shard_bytes=60) as w:
        w.add_rows(src, 0, 3)
        w.close()
    copy = PackedDataset(tmp_path / "copy", verify="full")
    assert [copy.row_media(i) for i in range(3)] == [src.row_media(i) for i in range(3)]
    assert copy.meta["counts"] == {**src.meta["counts"], "shards": copy.meta["counts"]["shards"]}
    # a flag or duration changed in the index: the index file's hash refuses it at open; with a fixed-up hash the
    # row checksum, which covers every field, refuses the row
    index = tmp_path / "src" / src.meta["shards"][0]["files"]["media"]["file"]
    entries = np.load(index)
    entries["millis"][0] += 1
    index.chmod(0o644)
    np.save(index, entries)
    with pytest.raises(ShardFormatError, match="checksum mismatch"):
        PackedDataset(tmp_path / "src")
    reopened = PackedDataset.__new__(PackedDataset)  # as a DataLoader worker opens it: index hashes not re-read
    reopened.__setstate__({"path": tmp_path / "src", "verify": "rows", "release_pages": False})
    with pytest.raises(ShardFormatError, match="row 0 .*corrupt"):
        reopened[0]


def test_a_changed_media_byte_fails_its_row(tmp_path):
    with ShardWriter(tmp_path / "ds", media=True) as w:
        w.add_row([_seq([1, 7, 8])], media=[ITEMS[:2]])
        w.close()
    ds = PackedDataset(tmp_path / "ds")
    data = tmp_path / "ds" / ds.meta["shards"][0]["files"]["media_data"]["file"]
    raw = bytearray(data.read_bytes())
    raw[31] ^= 1  # in the audio clip
    data.chmod(0o644)
    data.write_bytes(bytes(raw))
    with pytest.raises(ShardFormatError, match="row 0 .*corrupt"):
        PackedDataset(tmp_path / "ds")[0]
    with pytest.raises(ValueError, match="without a media store"):
        ShardWriter(tmp_path / "text").add_row([_seq([1, 7])], media=[ITEMS[:1]])


def test_format_2_image_stores_stay_readable(tmp_path):
    old = PackedDataset(FORMAT2, verify="full")
    assert old.format_version == 2 and old.has_media and old.has_images
    a, b, c = (StoredMedia("image", bytes([65 + k]) * (10 + k), (1, 2, 2 + k), 1 + k) for k in range(3))
    assert old.row_media(0) == [[a, b], []] and old.row_media(1) == [[c]]
    assert old[0]["image_data"] == [a.data, b.data] and old[1]["media"] == [[c]]
    # its settings reach the loader (format 2's meta.json `images`)
    assert MediaLoader.of(old.meta).processor.settings.image_max_pixels == 401408
    assert MediaLoader.of(old.meta).processor.settings.image_pixel_limit == 1000
    # rows copied one by one are written in this format; a bulk copy (checksummed by format 2's rule) is refused
    with ShardWriter(tmp_path / "new", media=True) as w:
        for i in range(len(old)):
            ends = np.cumsum(old.row_sequences(i)["length"])
            tokens = old.row_tokens(i)
            w.add_row([tokens[e - n:e] for n, e in zip(old.row_sequences(i)["length"], ends)],
                      media=old.row_media(i))
        w.close()
    new = PackedDataset(tmp_path / "new", verify="full")
    assert [new.row_media(i) for i in range(len(new))] == [old.row_media(i) for i in range(len(old))]
    with ShardWriter(tmp_path / "bulk", media=True) as w, pytest.raises(ShardFormatError, match="format 2 media"):
        w.add_rows(old, 0, len(old))
