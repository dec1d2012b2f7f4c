"""The training loop's plans and micro-batches, in order: built in the loop, or ahead on a thread.

Building a micro-batch is host work: the rows copied out of the shards (their checksums checked), the targets and
weights of `make_batch`, and for image data the image processor over every image (~80 ms of CPU per 1080p image).
Built in the loop, it stands between two micro-batches' GPU work. `PrefetchFeed` builds the coming ones on one
background thread while the current one trains: the same plans (made on that thread only: `StepSampler` is not
thread-safe) and the same values (a micro-batch is a pure function of its step's plan), at most `depth` micro-batches
ahead. An error building one (a corrupt row, an image the processor refuses) is raised in the loop when it asks
for that micro-batch, as the loop would have raised it.

Data that re-plans its rows per epoch (online packing, train/steps/online.py) changes under the loop's own reads (its
length, its rows' token counts) when a plan moves to the next epoch, so it gets the `InlineFeed`: built on demand.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from train.steps.batch import MicroBatch
from train.steps.sampler import MicroBatchPlan, StepPlan, StepSampler

BuildMicroBatch = Callable[[StepPlan, MicroBatchPlan], MicroBatch]


class InlineFeed:
    """Plans and micro-batches made when the loop asks for them."""

    waited = 0.0  # seconds the loop spent building micro-batches (all of it is on the loop's path here)

    def __init__(self, sampler: StepSampler, build: BuildMicroBatch, first_step: int, current: StepPlan | None = None):
        """`current`: a plan made elsewhere whose micro-batches this feed builds (`micro_batch`) before any
        `next_plan` (the plan of `first_step`)."""
        self.sampler, self.build, self.step = sampler, build, first_step
        self._plan = current

    def next_plan(self) -> StepPlan:
        self._plan = self.sampler.plan(self.step)
        self.step += 1
        return self._plan

    def micro_batch(self, k: int) -> MicroBatch:
        """The k-th micro-batch of the last plan (asked in order)."""
        start = time.perf_counter()
        batch = self.build(self._plan, self._plan.micro_batches[k])
        self.waited += time.perf_counter() - start
        return batch

    def close(self) -> None:
        pass


class _Stopped(Exception):
    """The feed was closed: the thread stops producing."""


class PrefetchFeed:
    """Plans of steps `[first_step, end_step)` and their micro-batches, built on a thread at most `depth` ahead."""

    def __init__(self, sampler: StepSampler, build: BuildMicroBatch, first_step: int, end_step: int, depth: int):
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.sampler, self.build = sampler, build
        self.waited = 0.0  # seconds the loop waited for a micro-batch the thread had not built yet
        self._items: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(first_step, end_step), daemon=True,
                                        name="packsft-micro-batches")
        self._thread.start()

    # ------------------------------------------------------------------ the thread
    def _produce(self, first_step: int, end_step: int) -> None:
        try:
            for step in range(first_step, end_step):
                plan = self.sampler.plan(step)
                self._put(("plan", plan))
                for micro in plan.micro_batches:
                    self._put(("batch", self.build(plan, micro)))
        except _Stopped:
            return
        except BaseException as exc:  # raised in the loop, where it asks for what could not be built
            try:
                self._put(("error", exc))
            except _Stopped:
                return

    def _put(self, item: tuple) -> None:
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                self._items.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    # ------------------------------------------------------------------ the loop
    def _get(self, kind: str):
        start = time.perf_counter()
        while True:
            try:
                got, value = self._items.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the micro-batch thread ended without building what the loop asks for")
        self.waited += time.perf_counter() - start
        if got == "error":
            raise value
        if got != kind:
            raise RuntimeError(f"the micro-batch feed is out of order: asked for a {kind}, got a {got}")
        return value

    def next_plan(self) -> StepPlan:
        return self._get("plan")

    def micro_batch(self, k: int) -> MicroBatch:
        """The k-th micro-batch of the last plan (asked in order)."""
        return self._get("batch")

    def close(self) -> None:
        """Stop the thread (it may be waiting to hand over a micro-batch, or building one) and wait for it."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._items.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)


def open_feed(sampler: StepSampler, build: BuildMicroBatch, first_step: int, end_step: int,
              depth: int) -> InlineFeed | PrefetchFeed:
    """The feed of the loop: built ahead by `depth` micro-batches (0: in the loop), in the loop for data that
    re-plans its rows per epoch (module docstring)."""
    if depth == 0 or sampler.replans:
        return InlineFeed(sampler, build, first_step)
    return PrefetchFeed(sampler, build, first_step, end_step, depth)
