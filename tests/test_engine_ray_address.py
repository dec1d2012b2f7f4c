"""`ray_address` that nothing answers at: refused in seconds naming the key and the address (Ray itself retries for
60-90 s and then raises a traceback naming neither). Needs no Ray: the check runs before `ray.init`."""
import socket
import time

import pytest

from data.config import ConfigError
from data.engine_ray import address_endpoint, check_reachable


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
