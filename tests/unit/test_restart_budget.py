"""The job-wide restart budget's count, read from a store that stops answering."""

from __future__ import annotations

import time

import pytest

from elastrun.agent import policy
from elastrun.agent.policy import JobRestartBudget
from elastrun.store.tcp import TcpStore, TcpStoreServer


class _Counted:
    """A budget source reading the count from a real store."""

    def __init__(self, store: TcpStore) -> None:
        self.store = store
        self.refusal: str | None = None

    def report_failure(self, max_restarts: int, what: str = "") -> bool:
        return True

    def restarts_used(self) -> int:
        return int(self.store.get("budget") or b"0")


def test_the_count_is_read_within_a_bound_and_else_the_last_one_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(policy, "READ_BOUND", 0.5)
    server = TcpStoreServer("127.0.0.1", 0)
    server.start()
    store = TcpStore("127.0.0.1", server.port, request_timeout=60.0)
    try:
        store.set("budget", b"2")
        budget = JobRestartBudget(_Counted(store), 5)
        assert budget.used() == 2
        server.stop()  # the store is gone: the client would try for 60 s
        started = time.monotonic()
        assert budget.used() == 2
        assert time.monotonic() - started < 5
    finally:
        store.close()
        server.stop()
