"""Deadlines against a store that went silent: its process stopped with SIGSTOP.

A stopped server leaves its connections open (the kernel still acknowledges what the
client sends) and answers nothing, as a partition does. Calls bounded by a scope's
deadline end by it without a helper thread, a healthy connection survives a deadline,
and the silence itself is still found out: an answer ``request_timeout`` overdue gives
the server up, and the rendezvous says that the store stopped answering.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _helpers import freeze
from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Deadline
from elastrun.core.errors import (
    RendezvousConnectionError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.outcome import STEP_AWAY_BOUND
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.tcp import TcpStore

#: Seconds a call may end past its bound on a loaded 2-core machine.
SLACK = 1.0


class FrozenStore:
    """An ``elastrun store`` process that ``freeze`` stops and ``thaw`` continues."""

    def __init__(self, tmp: Path) -> None:
        self._err = (tmp / "store.err").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastrun", "store", "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE, stderr=self._err, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("elastrun store: serving on 127.0.0.1:"):
            self.stop()
            raise AssertionError(f"the store did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])

    def freeze(self) -> None:
        freeze(self.proc.pid)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.thaw()
            self.proc.kill()
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FrozenStore]:
    store = FrozenStore(tmp_path)
    yield store
    store.stop()


class ThreadWatch:
    """Samples the process's threads while a block runs (a helper thread started to
    bound a wait would show up, even briefly)."""

    def __init__(self) -> None:
        self.baseline = {t.ident for t in threading.enumerate()}
        self.names: set[str] = set()
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="test-thread-watch")

    def _sample(self) -> None:
        me = threading.current_thread()
        while not self._done.wait(0.01):
            for t in threading.enumerate():
                if t is not me and t.ident not in self.baseline:
                    self.names.add(t.name)

    def __enter__(self) -> ThreadWatch:
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sampler.join()


def _connections_to(port: int) -> set[int]:
    """The local ports of this machine's established TCP connections to ``port`` on
    127.0.0.1 (from the kernel's table: a reconnection shows as a new local port)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == "01" and int(remote.split(":")[1], 16) == port:
            found.add(int(local.split(":")[1], 16))
    return found


def _timed(call: Callable[[], object]) -> tuple[float, BaseException | None]:
    t0 = time.monotonic()
    try:
        call()
    except Exception as exc:
        return time.monotonic() - t0, exc
    return time.monotonic() - t0, None


def _in_scope(seconds: float, call: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with CancelScope(deadline=Deadline.after(seconds)) as scope, scope.active():
            return call()

    return run


def test_a_deadline_ends_a_call_to_a_silent_server_and_keeps_the_connection(
    server: FrozenStore,
) -> None:
    with TcpStore("127.0.0.1", server.port, connect_timeout=5, request_timeout=30) as store:
        lease = store.grant_lease(30)
        before = _connections_to(server.port)
        assert len(before) == 1, before
        server.freeze()
        with ThreadWatch() as threads:
            took, exc = _timed(_in_scope(0.5, lambda: store.keep_alive(lease)))
        assert isinstance(exc, StoreTimeoutError), exc
        assert 0.45 <= took < 0.5 + SLACK, took
        assert threads.names == set()
        server.thaw()
        # The late answer is dropped; the same connection serves the next calls.
        assert store.keep_alive(lease) is True
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert _connections_to(server.port) == before  # not cut, not replaced


def test_answers_overdue_by_the_request_timeout_give_a_silent_server_up(
    server: FrozenStore,
) -> None:
    with TcpStore("127.0.0.1", server.port, connect_timeout=1, request_timeout=1.5) as store:
        lease = store.grant_lease(30)
        server.freeze()
        frozen = time.monotonic()
        outcomes: list[BaseException | None] = []
        # Calls as the keep-alive loop makes them: each bounded well below the timeout.
        while time.monotonic() - frozen < 10:
            _, exc = _timed(_in_scope(0.3, lambda: store.keep_alive(lease)))
            outcomes.append(exc)
            if not isinstance(exc, StoreTimeoutError):
                break
        gave_up = time.monotonic() - frozen
        last = outcomes[-1]
        assert isinstance(last, StoreUnavailableError), outcomes
        assert 1.5 <= gave_up < 1.5 + 0.3 + SLACK, gave_up
        assert last.silent_for >= 1.5
        assert "has not answered for" in str(last)


def _handler(port: int, *, request_timeout: float) -> tuple[DynamicRendezvousHandler, TcpStore]:
    store = TcpStore(
        "127.0.0.1", port, connect_timeout=request_timeout, request_timeout=request_timeout
    )
    settings = RendezvousSettings(
        "silent", 1, 1, last_call_timeout=0.05, heartbeat_timeout=1.5, close_timeout=1.0
    )
    node = NodeDesc("a", "127.0.0.1", "default", 1)
    return DynamicRendezvousHandler(store, settings, node), store


def test_a_silent_store_costs_the_node_its_lease_then_the_store_without_a_thread(
    server: FrozenStore,
) -> None:
    handler, store = _handler(server.port, request_timeout=3.0)
    try:
        handler.next_rendezvous()
        assert handler.num_nodes_waiting() == 0
        time.sleep(0.6)  # one keep-alive acknowledged
        with ThreadWatch() as threads:
            server.freeze()
            frozen = time.monotonic()
            # No keep-alive acknowledged for TTL - interval (1 s): the node is lost.
            while handler.num_nodes_waiting() == 0 and time.monotonic() - frozen < 10:
                time.sleep(0.05)
            lost = time.monotonic() - frozen
            # An answer read_timeout overdue: the store is given up, in one line.
            with pytest.raises(RendezvousConnectionError, match="stopped answering") as gone:
                while time.monotonic() - frozen < 15:
                    handler.num_nodes_waiting()
                    time.sleep(0.05)
            given_up = time.monotonic() - frozen
        # Lost before the others drop it (the TTL, 1.5 s), given up one read_timeout
        # (3 s) after its first unanswered keep-alive, noticed at a later one's deadline.
        assert lost < 1.5 + SLACK, lost
        assert 3.0 <= given_up < 3.0 + 1.5 + SLACK, (given_up, str(gone.value))
        assert threads.names == set()
    finally:
        server.thaw()
        handler.leave()
        store.close()


def test_closing_and_leaving_end_within_their_bounds_on_a_silent_store(
    server: FrozenStore,
) -> None:
    handler, store = _handler(server.port, request_timeout=30.0)
    try:
        handler.next_rendezvous()
        server.freeze()
        closed: list[bool] = []
        with ThreadWatch() as threads:
            took, exc = _timed(lambda: closed.append(handler.shutdown()))
        assert exc is None, exc
        assert closed == [False]  # the store never confirmed it
        # close_timeout (1 s) for the close, 2 s for the revoke, and the keep-alive
        # thread's last call (an interval, 0.5 s) as it ends.
        assert 1.0 + 2.0 <= took < 1.0 + 2.0 + 0.5 + SLACK, took
        assert threads.names == set()
        assert not [t for t in threading.enumerate() if t.name.startswith("elastrun-rdzv")]
    finally:
        server.thaw()
        handler.leave()
        store.close()


def test_giving_notice_of_stepping_away_ends_within_its_bound_on_a_silent_store(
    server: FrozenStore,
) -> None:
    # On a signal the agent gives notice before it stops its workers: a store that does
    # not answer must not hold that stop, nor leave a thread behind to finish the write.
    handler, store = _handler(server.port, request_timeout=30.0)
    try:
        handler.next_rendezvous()
        server.freeze()
        with ThreadWatch() as threads:
            took, exc = _timed(lambda: handler.step_away("received SIGTERM"))
        assert exc is None, exc  # never raises
        assert STEP_AWAY_BOUND <= took < STEP_AWAY_BOUND + SLACK, took
        assert threads.names == set()
    finally:
        server.thaw()
        handler.leave()
        store.close()
