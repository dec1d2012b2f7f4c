"""The heartbeat between the machines' supervisors (train/machines/heartbeat.py), in one process: a machine whose
connection closes without `done`, or that falls silent, is lost; a machine that ends with a failure stops the
others; machine 0 passes either on to every other machine; a clean end stops no one. The supervisors themselves,
frozen and killed: tests/train/test_launch_lost_machine.py."""
from __future__ import annotations

import socket
import time

import pytest

from tests._train_helpers import free_port
from train.machines.heartbeat import Heartbeat, HeartbeatError, Verdict

INTERVAL = 0.05
TIMEOUT = 1.0


class Machine:
    """One machine's heartbeat and the verdicts it gave."""

    def __init__(self, rank: int, machines: int, port: int):
        self.verdicts: list[tuple[float, Verdict]] = []
        self.heartbeat = Heartbeat(rank, machines, "127.0.0.1", port, TIMEOUT,
                                   on_verdict=lambda v: self.verdicts.append((time.monotonic(), v)),
                                   interval_s=INTERVAL).start()

    def wait(self, seconds: float = 5.0) -> Verdict | None:
        return self.heartbeat.wait_verdict(seconds)


def _connected(*machines: Machine, seconds: float = 5.0) -> None:
    """Until machine 0 knows every other machine by name."""
    hub = machines[0].heartbeat
    deadline = time.monotonic() + seconds
    while sorted(link.machine for link in hub._links if link.machine is not None) != list(range(1, len(machines))):
        assert time.monotonic() < deadline, "the machines did not connect"
        time.sleep(0.02)


class FakeMachine:
    """A machine that says hello and then does only what the test makes it do (close, fall silent)."""

    def __init__(self, rank: int, machines: int, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(f"hello {rank} {machines} fakehost\n".encode())


@pytest.fixture
def port():
    return free_port()


def test_a_clean_end_stops_no_one(port):
    hub, peer = Machine(0, 2, port), Machine(1, 2, port)
    _connected(hub, peer)
    time.sleep(3 * INTERVAL)
    peer.heartbeat.finish(0)
    hub.heartbeat.finish(0)
    assert hub.wait(0.5) is None and peer.verdicts == [] and hub.verdicts == []


def test_a_closed_connection_loses_the_machine_at_once_and_machine_0_tells_the_others(port):
    hub, other = Machine(0, 3, port), Machine(2, 3, port)
    dying = FakeMachine(1, 3, port)
    _connected(hub, dying, other)
    closed = time.monotonic()
    dying.sock.close()  # its processes died: the kernel closes the connection
    lost = hub.wait()
    assert lost == Verdict(1, "fakehost", "its heartbeat connection closed without a word (its processes died)")
    assert hub.verdicts[0][0] - closed < TIMEOUT  # not the silence: the closed connection
    assert other.wait() == lost  # relayed by machine 0
    assert "[train.sh] lost machine 1 of 3 (fakehost): its heartbeat connection closed" in lost.line(2, 3)
    for machine in (hub, other):
        machine.heartbeat.finish(75)
    assert len(hub.verdicts) == len(other.verdicts) == 1  # said once


def test_a_silent_machine_is_lost_after_the_timeout(port):
    hub = Machine(0, 2, port)
    frozen = FakeMachine(1, 2, port)  # connected, then never a line again (frozen, powered off, cut off)
    _connected(hub, frozen)
    start = time.monotonic()
    lost = hub.wait(10)
    assert lost is not None and lost.machine == 1 and lost.code is None
    assert lost.reason == f"no heartbeat for {TIMEOUT:g} s (frozen, powered off or cut off)"
    assert TIMEOUT - 2 * INTERVAL <= hub.verdicts[0][0] - start <= TIMEOUT + 5  # bounded (loose: a loaded CI)
    hub.heartbeat.finish(75)
    frozen.sock.close()


def test_machine_0_lost(port):
    """Machine 0 dies (here a stand-in that accepts the connection, answers hello and closes it): the others lose
    it."""
    hub = socket.create_server(("127.0.0.1", port))
    peer = Machine(1, 2, port)
    conn, _ = hub.accept()
    assert conn.makefile().readline().split()[:3] == ["hello", "1", "2"]
    conn.sendall(b"hello 0 2 hubhost\n")
    time.sleep(3 * INTERVAL)
    conn.close()
    lost = peer.wait()
    assert lost == Verdict(0, "hubhost", "its heartbeat connection closed without a word (its processes died)")
    peer.heartbeat.finish(75)
    hub.close()


def test_a_failed_end_stops_the_others(port):
    hub, failing, other = Machine(0, 3, port), Machine(1, 3, port), Machine(2, 3, port)
    _connected(hub, failing, other)
    failing.heartbeat.finish(2)  # e.g. a config error on its ranks
    ended = hub.wait()
    assert ended is not None and (ended.machine, ended.code) == (1, 2)
    assert other.wait() == ended
    assert ended.line(0, 3).startswith("[train.sh] machine 1 of 3 (")
    assert "ended with exit status 2 (its own output says why); stopped the processes of machine 0" in ended.line(0, 3)
    for machine in (hub, other):
        machine.heartbeat.finish(2)


def test_a_stranger_is_not_a_machine_of_the_run(port):
    """A connection that says nothing, names another run's layout or speaks another protocol is closed and loses no
    machine."""
    hub = Machine(0, 2, port)
    silent = socket.create_connection(("127.0.0.1", port))
    other_run = FakeMachine(1, 4, port)  # 4 machines: not this run
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(b"GET / HTTP/1.1\nhello x y z\n")
    time.sleep(TIMEOUT + 0.5)
    assert hub.verdicts == [] and hub.heartbeat._links == []
    hub.heartbeat.finish(0)
    for sock in (silent, other_run.sock, garbage):
        sock.close()


def test_machine_0_says_when_its_port_is_taken(port):
    taken = socket.create_server(("", port))
    with pytest.raises(HeartbeatError, match=rf"cannot listen on port {port} \(launch.main_process_port \+ 1\): "
                                             r"Address already in use; choose another launch.main_process_port"):
        Heartbeat(0, 2, "127.0.0.1", port, TIMEOUT, on_verdict=print).start()
    taken.close()
