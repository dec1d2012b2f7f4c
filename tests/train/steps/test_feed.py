"""train/steps/feed.py: micro-batches built ahead on a thread are the loop's own, in its order; errors surface where the
loop asks; the thread never runs more than `depth` ahead and ends with the run; training is bitwise the same."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from data.shards.dataset import ShardFormatError
from tests._train_helpers import one_thread, random_rows, save_tiny_model, write_config, write_packed  # noqa: F401
from train.steps.sampler import StepSampler
from train.steps.feed import InlineFeed, PrefetchFeed, open_feed

THREAD = "packsft-micro-batches"


class Rows:
    """A dataset of `n` rows for the sampler (only its length and index columns are read)."""

    def __init__(self, n: int):
        self.row_n_tokens = np.full(n, 8)
        self.row_n_loss_tokens = np.full(n, 4)
        self.row_n_trained_turns = np.ones(n, dtype=np.int64)
        self.row_n_samples = np.ones(n, dtype=np.int64)

    def __len__(self):
        return len(self.row_n_tokens)


def _sampler(n_rows=10, grad_accum=3):
    return StepSampler(Rows(n_rows), dp_size=1, dp_rank=0, grad_accum=grad_accum, micro_batch_rows=1, seed=5)


def _drain(feed, steps: int) -> list:
    out = []
    for _ in range(steps):
        plan = feed.next_plan()
        batches = [feed.micro_batch(k) for k in range(len(plan.micro_batches))]
        out.append((plan.step, [(tuple(b["rows"]), b["filler"]) for b in batches]))
    return out


def _build(built: list):
    def build(plan, micro):
        built.append(plan.step)
        return {"rows": list(micro.rows), "filler": micro.filler}
    return build


def test_prefetched_plans_and_micro_batches_are_the_loops_in_its_order():
    """10 rows, 3 a step: the 4th step has one real row and two fillers; the same as built in the loop."""
    inline = _drain(InlineFeed(_sampler(), _build([]), 0), 4)
    feed = PrefetchFeed(_sampler(), _build([]), 0, 4, depth=2)
    try:
        assert _drain(feed, 4) == inline
    finally:
        feed.close()
    assert [[filler for _, filler in batches] for _, batches in inline] == [[False] * 3] * 3 + [[False, True, True]]
    assert sorted(row for _, batches in inline for (row,), filler in batches if not filler) == list(range(10))
    resumed = PrefetchFeed(_sampler(), _build([]), 2, 4, depth=1)  # a resumed run starts at its step
    try:
        assert _drain(resumed, 2) == inline[2:]
    finally:
        resumed.close()


def test_the_thread_runs_at_most_depth_ahead_and_stops_when_closed():
    built = []
    feed = PrefetchFeed(_sampler(100), _build(built), 0, 30, depth=2)
    feed.next_plan()
    feed.micro_batch(0)
    time.sleep(0.5)  # time enough to build everything, were it not bounded
    # taken: 1 micro-batch; queued: at most 2 items; one more built and waiting to be queued
    assert len(built) <= 1 + 2 + 1
    assert any(t.name == THREAD for t in threading.enumerate())
    feed.close()
    assert not any(t.name == THREAD and t.is_alive() for t in threading.enumerate())


def test_an_error_is_raised_where_the_loop_asks_for_what_could_not_be_built():
    def build(plan, micro):
        if plan.step == 1 and micro is plan.micro_batches[2]:
            raise ShardFormatError("shard_00000.tokens.bin: row 7 is corrupt")
        return {"rows": list(micro.rows), "filler": micro.filler}

    feed = PrefetchFeed(_sampler(), build, 0, 4, depth=4)
    try:
        _drain(feed, 1)  # step 0 whole, though the thread has reached the error
        feed.next_plan()
        feed.micro_batch(0), feed.micro_batch(1)
        with pytest.raises(ShardFormatError, match="row 7 is corrupt"):
            feed.micro_batch(2)
    finally:
        feed.close()


def test_data_that_replans_per_epoch_is_built_in_the_loop():
    class Replanning(Rows):
        epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

    sampler = StepSampler(Replanning(6), 1, 0, 2, 1, seed=0)
    assert sampler.replans and isinstance(open_feed(sampler, _build([]), 0, 3, depth=2), InlineFeed)
    assert isinstance(open_feed(_sampler(), _build([]), 0, 3, depth=0), InlineFeed)
    feed = open_feed(_sampler(), _build([]), 0, 3, depth=2)
    assert isinstance(feed, PrefetchFeed)
    feed.close()


# ---------------------------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "m")


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_training_is_bitwise_the_same_with_and_without_prefetch(tmp_path, model, one_thread):  # noqa: F811
    """7 rows, 2 micro-batches of 2 rows a step: 2 epochs with fillers at each epoch's end, a checkpoint, then the
    run resumed from it; every logged value but the times equal, and no thread left."""
    from train.config.sections import load_config
    from train.trainer import Trainer

    data = write_packed(tmp_path / "data", random_rows(3, 7, seqs_per_row=2))
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model), num_epochs=2,
                          micro_batch_rows=2, grad_accum=2, lr=1e-3, plot=False, save_steps=2,
                          output_dir=str(tmp_path / "unused"))
    logs = {}
    for depth in (0, 2):
        out = tmp_path / f"depth{depth}"
        Trainer(load_config(config, [f"output_dir={out}", f"prefetch_micro_batches={depth}", "stop_at_step=3"]),
                console=lambda *_: None).train()
        Trainer(load_config(config, [f"output_dir={out}", f"prefetch_micro_batches={depth}", "resume=latest"]),
                console=lambda *_: None).train()
        logs[depth] = _log(out)
        assert not any(t.name == THREAD and t.is_alive() for t in threading.enumerate())
    assert [r["step"] for r in logs[2]] == [1, 2, 3, 4]
    timed = ("tokens_per_s", "batch_wait_s")
    for got, want in zip(logs[2], logs[0], strict=True):
        assert {k: v for k, v in got.items() if k not in timed} == {k: v for k, v in want.items() if k not in timed}
        assert got["batch_wait_s"] >= 0 and want["batch_wait_s"] > 0


def test_a_corrupt_row_stops_training_with_prefetch_as_without(tmp_path, model, one_thread):  # noqa: F811
    from data.shards.dataset import PackedDataset
    from train.config.sections import load_config
    from train.trainer import Trainer

    data = write_packed(tmp_path / "data", random_rows(11, 6, seqs_per_row=2))
    ds = PackedDataset(data, verify="off")
    byte = (int(ds._rows[0][5]["token_offset"]) + 2) * ds.dtype.itemsize
    raw = bytearray((data / "shard_00000.tokens.bin").read_bytes())
    raw[byte] ^= 0x01
    (data / "shard_00000.tokens.bin").write_bytes(bytes(raw))
    config = write_config(tmp_path / "c.yaml", data_path=str(data), model_path=str(model), num_epochs=1,
                          micro_batch_rows=1, lr=1e-3, plot=False, output_dir=str(tmp_path / "out"))
    errors = []
    for depth in (0, 3):
        trainer = Trainer(load_config(config, [f"prefetch_micro_batches={depth}",
                                               f"output_dir={tmp_path / f'out{depth}'}"]), console=lambda *_: None)
        with pytest.raises(ShardFormatError, match=r"row 5 \(row 5 of the shard\) is corrupt") as info:
            trainer.train()
        errors.append((str(info.value), trainer.step))
        assert not any(t.name == THREAD and t.is_alive() for t in threading.enumerate())
    assert errors[0] == errors[1]  # the same error, after the same steps
