"""The contract package data/shards/: the reader's public row-slice API that the writer copies rows through, and the
image loader's error for stored bytes that do not decode."""
import numpy as np
import pytest

from data.shards.dataset import PackedDataset, ShardFormatError
from tests.shards.test_format import make_sequence, write_rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(3)
    rows = [[make_sequence(rng, int(rng.integers(5, 40)), category=1 + r % 2) for _ in range(1 + r % 3)]
            for r in range(17)]
    path = tmp_path_factory.mktemp("contract") / "ds"
    write_rows(path, rows, max_shard_bytes=300)
    return PackedDataset(path)


@pytest.mark.parametrize("start, end", [(0, 17), (3, 11), (5, 6), (16, 17), (4, 4)])
def test_row_slices_cover_the_range_shard_by_shard(dataset, start, end):
    slices = list(dataset.row_slices(start, end))
    assert len(dataset.shard_row_ranges()) > 2  # several shards, so ranges cross them
    assert [int(n) for s in slices for n in s.rows["n_tokens"]] == \
        [len(dataset.row_tokens(i)) for i in range(start, end)]
    assert np.array_equal(np.concatenate([s.nbytes for s in slices] or [np.zeros(0, np.int64)]),
                          dataset.row_nbytes(start, end))
    assert [s.shard for s in slices] == sorted({s.shard for s in slices})


def test_a_stored_run_is_what_its_rows_hold(dataset):
    start, end = 2, 15
    shard_first = [first for first, _ in dataset.shard_row_ranges()]
    for row_slice in dataset.row_slices(start, end):
        first = max(start, shard_first[row_slice.shard])  # the slice's first row, globally
        run = dataset.stored_run(row_slice.shard, row_slice.rows)
        rows = range(first, first + len(row_slice.rows))
        assert np.array_equal(run.tokens, np.concatenate([dataset.row_tokens(i) for i in rows]))
        assert np.array_equal(run.seqs, np.concatenate([dataset.row_sequences(i) for i in rows]))
        assert [int(u) for u in run.uids] == [int(u) for i in rows for uids in dataset.row_uids(i) for u in uids]
        assert (run.token_offset, run.seq_offset) == (int(row_slice.rows["token_offset"][0]),
                                                      int(row_slice.rows["seq_offset"][0]))
        assert run.media is None and run.media_data is None  # a dataset without media


def test_the_media_loader_raises_the_format_error_for_bytes_that_do_not_decode():
    pytest.importorskip("PIL")
    from data.shards.dataset import StoredMedia
    from data.shards.media import MediaLoader
    from data.shards.processor import MediaSettings

    loader = MediaLoader(MediaSettings("unused-processor-dir"))
    loader.processor._processor = object()  # the processor is not reached: decoding fails first
    with pytest.raises(ShardFormatError, match="the shards hold an image that does not decode: .*unreadable image"):
        loader.item(StoredMedia("image", b"not an image", (1, 2, 2), 1))
