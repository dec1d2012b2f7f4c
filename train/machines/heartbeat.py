"""The machines of a multi-machine run watch each other, so that a lost machine stops the others within a bound.

Why: torchrun's agent on each machine watches only its own workers. When a machine is lost, the ranks of the other
machines wait in their next collective: a killed process's sockets are closed by its kernel (gloo then raises at
once, with a traceback that does not say which machine), but a machine that froze, lost power or was cut off sends
nothing at all, and gloo and NCCL wait for the process group's timeout, 30 minutes. torchrun's c10d rendezvous has a
keep-alive of its own, but it only drops a dead node from the next rendezvous round: it does not stop the running
workers; the static rendezvous of `accelerate launch` has none.

How: the supervisor of every machine (`sh train.sh`, train/launch.py) takes part, machine 0 as the hub. It listens on
`main_process_port + 1`; every other machine connects to it and says which machine it is (`hello MACHINE MACHINES
HOST`), and both ends send a line every `INTERVAL_S`. The machine at the other end of a connection is lost when the
connection closes without `done` (its processes died: its kernel closed their sockets) or when nothing came from it
for `timeout_s` (`launch.heartbeat_timeout_s`: frozen, powered off, cut off). A machine whose run ends says `done
CODE` before it closes; when CODE is not 0 the others stop too, as the run cannot go on without it. The hub passes a
loss or a failed end on to every other machine (`lost …`, `ended …`), so all of them stop, each once (`on_verdict`).
A machine that has not connected yet is not lost: starting the machines is the rendezvous' business.
"""
from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from common.errors import PackSFTError

INTERVAL_S = 1.0  # a line to each connected machine this often


def heartbeat_port(main_process_port: int) -> int:
    """The hub's port: the one after the rendezvous port (both must be open between the machines)."""
    return main_process_port + 1


@dataclass(frozen=True)
class Verdict:
    """Why this machine's run must stop: another machine is lost (`code` None) or ended with status `code`."""

    machine: int
    host: str
    reason: str
    code: int | None = None

    def line(self, me: int, machines: int) -> str:
        who = f"machine {self.machine} of {machines} ({self.host})"
        if self.code is None:
            return (f"[train.sh] lost {who}: {self.reason}; stopped the processes of machine {me}. resume=latest "
                    "continues from the last complete checkpoint, on these machines or on others")
        return (f"[train.sh] {who} ended with exit status {self.code} (its own output says why); stopped the processes "
                f"of machine {me}")


class HeartbeatError(PackSFTError, RuntimeError):
    """Machine 0 cannot listen on the heartbeat's port."""

    exit_code = 2


class _Link:
    """A connection to another machine (`machine` None until it said hello)."""

    def __init__(self, sock: socket.socket, machine: int | None = None, host: str = "?"):
        self.sock, self.machine, self.host = sock, machine, host
        self.heard = time.monotonic()
        self.pending = b""
        self.done: int | None = None  # the status it ended with, once it said so


class Heartbeat:
    """This machine's end of the run's heartbeat: `start()`, then `finish(code)` when its run has ended. A verdict
    (`Verdict`) is given at most once, to `on_verdict`, on the heartbeat's thread."""

    def __init__(self, machine: int, machines: int, hub_address: str, port: int, timeout_s: float,
                 on_verdict: Callable[[Verdict], None], interval_s: float = INTERVAL_S):
        self.machine, self.machines, self.hub_address, self.port = machine, machines, hub_address, port
        self.timeout_s, self.interval_s, self.on_verdict = timeout_s, interval_s, on_verdict
        self.host = socket.gethostname()
        self.verdict: Verdict | None = None
        self._decided = threading.Event()
        self._finish_code: int | None = None
        self._links: list[_Link] = []
        self._joined = False  # machines other than 0: connected once (never again: a later hub is another run's)
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="packsft-heartbeat", daemon=True)

    # ------------------------------------------------------------------ the supervisor's side
    def start(self) -> Heartbeat:
        if self.machine == 0:  # bound before the launcher starts: a peer that connects early finds it
            try:
                listener = socket.create_server(("", self.port))
            except OSError as exc:
                why = os.strerror(exc.errno) if exc.errno else str(exc)
                raise HeartbeatError(
                    f"the machines' heartbeat cannot listen on port {self.port} (launch.main_process_port + 1): "
                    f"{why}; choose another launch.main_process_port") from None
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ, None)
            self._listener = listener
        self._thread.start()
        return self

    def wait_verdict(self, seconds: float) -> Verdict | None:
        self._decided.wait(seconds)
        return self.verdict

    def finish(self, code: int) -> None:
        """This machine's run has ended with `code`: say so to the other machines and close."""
        self._finish_code = code
        self._thread.join(timeout=5 * self.interval_s + 5)

    # ------------------------------------------------------------------ the heartbeat's thread
    def _run(self) -> None:
        next_beat = next_connect = 0.0
        try:
            while self._finish_code is None:
                for key, _ in self._selector.select(timeout=self.interval_s / 4):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                now = time.monotonic()
                if self.machine != 0 and not self._joined and now >= next_connect:
                    self._connect()
                    next_connect = now + self.interval_s
                if now >= next_beat:
                    for link in list(self._links):
                        self._send(link, "beat")
                    next_beat = now + self.interval_s
                for link in list(self._links):
                    if link.done is None and now - link.heard > self.timeout_s:
                        if link.machine is None:  # connected but never said who it is: not one of the run
                            self._close(link)
                        else:
                            self._lose(link, f"no heartbeat for {self.timeout_s:g} s (frozen, powered off or cut off)")
            for link in list(self._links):
                self._send(link, f"done {self._finish_code}")
                self._close(link)
        finally:
            if self._listener is not None:
                self._selector.unregister(self._listener)
                self._listener.close()
            self._selector.close()

    def _connect(self) -> None:
        try:
            sock = socket.create_connection((self.hub_address, self.port), timeout=self.interval_s)
        except OSError:  # machine 0 not listening yet
            return
        sock.setblocking(False)
        link = _Link(sock, 0, self.hub_address)
        self._joined = True
        self._add(link)
        self._send(link, f"hello {self.machine} {self.machines} {self.host}")

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        self._add(_Link(sock))

    def _add(self, link: _Link) -> None:
        self._links.append(link)
        self._selector.register(link.sock, selectors.EVENT_READ, link)

    def _close(self, link: _Link) -> None:
        if link in self._links:
            self._links.remove(link)
            self._selector.unregister(link.sock)
            link.sock.close()

    def _send(self, link: _Link, line: str) -> None:
        try:
            link.sock.send(f"{line}\n".encode())
        except BlockingIOError:  # the other end reads nothing (frozen): its silence decides, not ours
            pass
        except OSError:  # closed: the reading side says so
            pass

    def _read(self, link: _Link) -> None:
        try:
            data = link.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if link.done is None and link.machine is not None:
                self._lose(link, "its heartbeat connection closed without a word (its processes died)")
            self._close(link)
            return
        link.heard = time.monotonic()
        *lines, link.pending = (link.pending + data).split(b"\n")
        if len(link.pending) > 4096:  # no line ends: not a machine of the run
            self._close(link)
            return
        for line in lines:
            if link not in self._links:  # closed by the line before
                return
            try:
                self._handle(link, line.decode(errors="replace").split())
            except (ValueError, IndexError):  # not a line of this protocol: not a machine of the run
                self._close(link)
                return

    def _handle(self, link: _Link, words: list[str]) -> None:
        if not words:
            return
        kind, args = words[0], words[1:]
        if kind == "hello" and len(args) == 3:  # a machine's first line (and the hub's answer)
            machine, machines = int(args[0]), int(args[1])
            if machines != self.machines or not 0 <= machine < machines or machine == self.machine:
                self._close(link)  # not a machine of this run
                return
            first = link.machine is None
            link.machine, link.host = machine, args[2]
            if first and self.machine == 0:
                self._send(link, f"hello 0 {self.machines} {self.host}")
        elif kind == "done" and args and link.machine is not None:
            link.done = int(args[0])
            if link.done != 0:
                self._decide(Verdict(link.machine, link.host, "", link.done), relay_from=link)
        elif kind == "lost" and len(args) >= 2:  # from the hub: another machine is lost
            self._decide(Verdict(int(args[0]), args[1], " ".join(args[2:])))
        elif kind == "ended" and len(args) == 3:  # from the hub: another machine ended with a failure
            self._decide(Verdict(int(args[0]), args[1], "", int(args[2])))

    def _lose(self, link: _Link, reason: str) -> None:
        self._decide(Verdict(link.machine, link.host, reason), relay_from=link)
        self._close(link)

    def _decide(self, verdict: Verdict, relay_from: _Link | None = None) -> None:
        if self.machine == 0 and relay_from is not None:  # the hub tells every other machine
            relay = (f"lost {verdict.machine} {verdict.host} {verdict.reason}" if verdict.code is None else
                     f"ended {verdict.machine} {verdict.host} {verdict.code}")
            for other in self._links:
                if other is not relay_from:
                    self._send(other, relay)
        if self.verdict is None:
            self.verdict = verdict
            self._decided.set()
            self.on_verdict(verdict)
