"""train/__main__.py's console: one format for the run's log lines, PackSFT's warnings said once (by rank 0)."""
from __future__ import annotations

import logging

import pytest

from train.__main__ import PACKSFT_LOGGERS, configure_console


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in PACKSFT_LOGGERS}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_warnings_are_plain_lines_said_by_rank_0_only(rank, monkeypatch, capsys, restore_logging):
    monkeypatch.setenv("RANK", rank)
    configure_console()
    logging.getLogger("train.preflight").warning("data_path: the longest sequence is longer than the model's range")
    logging.getLogger("packsft.train").info("removed a stale temporary")
    logging.getLogger("packsft.train").error("a rank's own failure")
    err = capsys.readouterr().err.splitlines()
    if rank == "0":
        assert err == ["warning: data_path: the longest sequence is longer than the model's range",
                       "removed a stale temporary", "error: a rank's own failure"]
    else:
        assert err == ["error: a rank's own failure"]


def test_the_stop_signals_handlers_are_restored_when_main_returns(tmp_path, capsys):
    """An in-process `main` that stops on an error ignores further stop signals while it says why (stop_report's
    `stopping`); its caller gets its own handlers back. Before: SIGTERM stayed ignored in the caller (a pytest
    worker), and every process it started later inherited it: a process pool's `terminate` then hung on a worker
    that ignored the SIGTERM."""
    import signal

    from train.__main__ import main

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    assert main([str(tmp_path / "missing.yaml")]) == 2
    assert "config error: " in capsys.readouterr().err
    assert {sig: signal.getsignal(sig) for sig in before} == before
