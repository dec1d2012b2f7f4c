"""The output directory's lock (common/lock.py): a lock whose holder is gone (dead pid, reused pid, torn file) is taken
over and said so; a live holder on this host, or a lock of another host, is kept."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from common.lock import LOCK_NAME, LockHeldError, directory_lock


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


@pytest.mark.parametrize("stale", ["dead pid", "reused pid", "torn file"])
def test_a_lock_whose_holder_is_gone_is_taken_over_and_said_so(tmp_path, capsys, stale):
    lock = tmp_path / LOCK_NAME
    holder = {"pid": _dead_pid(), "host": socket.gethostname(), "start": "x", "started": "then", "command": "old"}
    if stale == "reused pid":  # a live process with the holder's pid, started at another time
        holder.update(pid=os.getpid(), start="another boot:1")
    lock.write_text("{" if stale == "torn file" else json.dumps(holder))
    with directory_lock(tmp_path) as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"[lock] took over {lock}" in capsys.readouterr().out
    assert not lock.exists()


def test_a_live_holder_on_this_host_or_a_lock_of_another_host_is_kept(tmp_path):
    with directory_lock(tmp_path):
        with pytest.raises(LockHeldError, match=rf"pid {os.getpid()} on {socket.gethostname()}"):
            with directory_lock(tmp_path):
                pass
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": "elsewhere", "started": "then"}))
    with pytest.raises(LockHeldError, match=r"on elsewhere, started then.*if that run is gone, delete"):
        with directory_lock(tmp_path):
            pass
