"""The example pipeline, run once for the data tests that run later stages on its outputs (each takes a copy:
tests._data_helpers.copy_run)."""
from __future__ import annotations

import pytest

from data import pipeline
from tests._data_helpers import example_config


@pytest.fixture(scope="session")
def example_run(tmp_path_factory):
    """The example pipeline run once; tests take a copy (`copy_run`)."""
    directory = tmp_path_factory.mktemp("example")
    pipeline.main([str(example_config(directory))])  # preprocess writes ratios.json (every rate 1.0)
    return directory
