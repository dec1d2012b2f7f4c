"""`ray_address` that nothing answers at: refused in seconds naming the key and the address (Ray itself retries for
60-90 s and then raises a traceback naming neither). Needs no Ray: the check runs before `ray.init`."""
import os
import socket
import subprocess
import sys
import time

import orjson
import pytest

from common.config import ConfigError
from data.engine_ray import address_endpoint, check_reachable

pytestmark = pytest.mark.serial  # scripts/test.sh runs these alone (see pytest.ini)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free once the socket closes: nothing listens there


def test_address_forms():
    assert address_endpoint("ray://10.0.0.1:10001") == ("10.0.0.1", 10001)
    assert address_endpoint("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert address_endpoint("ray://[::1]:10001") == ("::1", 10001)
    assert address_endpoint("auto") is None and address_endpoint("local") is None


@pytest.mark.parametrize("scheme", ["ray://", ""])
def test_unreachable_address_is_refused_in_seconds_naming_key_and_address(scheme):
    address = f"{scheme}127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"ray_address='{address}': nothing answers at 127\.0\.0\.1:\d+"):
        check_reachable(address)
    assert time.monotonic() - start < 5


def test_reachable_address_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"ray://127.0.0.1:{server.getsockname()[1]}")


def test_data_process_with_an_unreachable_ray_address_stops_in_seconds_naming_it(tmp_path):
    """The user's command, `data_process.sh config engine=ray ray_address=...` with nothing at the address: exit 2 in
    seconds with one line naming the key and the address, before any stage writes."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -r requirements-ray.txt)")
    from tests.conftest import ROOT

    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    raw.update(output_dir=str(tmp_path / "out"),
               tokenizer_path=str(ROOT / raw["tokenizer_path"]),
               inputs=[{**spec, "path": str(ROOT / spec["path"])} for spec in raw["inputs"]])
    config = tmp_path / "config.json"
    config.write_bytes(orjson.dumps(raw))
    address = f"ray://127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    proc = subprocess.run(["sh", str(ROOT / "data_process.sh"), str(config), "engine=ray", f"ray_address={address}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"ray_address='{address}': nothing answers at" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60  # Python, torch-free imports and the check: seconds, not Ray's 60-90 s
    assert not (tmp_path / "out" / "canonical.jsonl").exists()
