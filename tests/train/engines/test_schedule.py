"""The learning-rate schedule every engine's optimizer steps with (train/engines/schedule.py): warmup, then cosine or
linear decay to min_lr_ratio."""
from __future__ import annotations

import numpy as np
import pytest

from train.engines.schedule import lr_lambda_factory


def test_lr_schedule():
    f = lr_lambda_factory(total_steps=10, warmup_steps=2, schedule="cosine", min_ratio=0.1)
    values = [f(s) for s in range(10)]
    assert values[0] == pytest.approx(0.5) and values[1] == pytest.approx(1.0) and values[2] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[1:], values[2:]))
    g = lr_lambda_factory(total_steps=5, warmup_steps=0, schedule="linear", min_ratio=0.0)
    assert np.allclose([g(s) for s in range(5)], [1.0, 0.75, 0.5, 0.25, 0.0])
