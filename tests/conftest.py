"""Shared test helpers: project root on sys.path, the offline fixtures in ../shared/fixtures."""
import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT.parent / "shared" / "fixtures"
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _require(path: Path) -> Path:
    if not path.exists():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"CI must have the shared fixtures, missing: {path}")
        pytest.skip(f"needs ../shared/fixtures (absent in this clone): {path}")
    return path


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return _require(FIXTURES)


def fixture_path(*parts: str) -> Path:
    """Path of a fixture file; skips (or fails in CI) when the shared fixtures are absent."""
    return _require(FIXTURES.joinpath(*parts))


def tokenizer_dir(name: str) -> Path:
    return fixture_path("tokenizers", name)


def _vision_loads() -> bool:
    try:
        import PIL  # noqa: F401
        import torchvision  # noqa: F401
    except Exception:  # ImportError, or torchvision's RuntimeError next to the CPU-only torch wheel
        return False
    return True


def pytest_collection_modifyitems(config, items):
    import torch

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs CUDA")
    # `vision` tests need .venv-vision (scripts/test.sh runs them there); elsewhere they skip, but in CI they run
    if not os.environ.get("CI") and any("vision" in item.keywords for item in items) and not _vision_loads():
        skips["vision"] = pytest.mark.skip(reason="needs torchvision + Pillow: bash scripts/setup_vision.sh, then "
                                                  ".venv-vision/bin/python -m pytest -m vision")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@pytest.fixture(autouse=True)
def stop_signals_as_they_were():
    """Every test leaves the stop signals' handlers as it found them. A run that stops on an error ignores further
    stop signals while it says why (train/machines/stop_report.py `stopping`); called in-process, that SIG_IGN stayed
    in the pytest worker, every process a later test started inherited it, and a process pool's `terminate` hung on a
    worker that ignored the SIGTERM."""
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in before.items():
        if handler is not None and signal.getsignal(sig) != handler:
            signal.signal(sig, handler)
