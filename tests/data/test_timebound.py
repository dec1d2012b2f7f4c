"""The time bound of a render (data/timebound.py): it stops a loop, costs little per record and leaves nothing
behind."""
from __future__ import annotations

import pytest


@pytest.mark.serial  # times the bound's cost per record
def test_time_bound_costs_little_and_leaves_nothing_behind():
    import time

    from data.timebound import TimeBoundExceeded, time_bound

    with pytest.raises(TimeBoundExceeded):
        with time_bound(0.05):
            while True:
                pass
    start = time.perf_counter()
    for _ in range(10_000):
        with time_bound(10):
            pass
    assert (time.perf_counter() - start) / 10_000 < 50e-6  # per record, far below a render (~100 us)
    time.sleep(0.3)  # the watchdog looks again: nothing fires outside a bound
    with time_bound(None):
        pass
