"""The agent's typed view of a rendezvous: elastrun's handler as is, others adapted."""

from __future__ import annotations

import threading
import time

import pytest

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.errors import RendezvousClosedError, RendezvousTimeoutError
from elastrun.rendezvous.api import RendezvousInfo
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.elastic import (
    ElasticRendezvous,
    NoExclusions,
    PlainRendezvous,
    as_elastic,
)
from elastrun.rendezvous.excluding import Exclusions
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.rendezvous.outcome import Outcome
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.memory import MemoryStore


def test_the_dynamic_handler_is_elastic_itself() -> None:
    settings = RendezvousSettings("job", 1, 1)
    handler = DynamicRendezvousHandler(
        MemoryStore(), settings, NodeDesc("a", "127.0.0.1", "default", 1)
    )
    rdzv = as_elastic(handler)
    assert rdzv is handler
    assert isinstance(handler, ElasticRendezvous)
    # It keeps the job's outcome (budget, exit barrier) and exclusions in its store.
    assert isinstance(rdzv.outcome, Outcome) and isinstance(rdzv.exclusions, Exclusions)
    assert rdzv.loss_bound == settings.heartbeat_timeout


def test_a_torch_style_handler_gets_torchruns_answers() -> None:
    handler = LocalRendezvousHandler("job")
    rdzv = as_elastic(handler)
    assert isinstance(rdzv, PlainRendezvous) and rdzv.handler is handler
    # No job-wide outcome: the agent keeps its own budget and has no exit barrier.
    assert rdzv.outcome is None
    assert rdzv.change_reason == "" and rdzv.loss_bound == 0.0
    rdzv.set_node_info("trainer", 4)  # accepted and ignored
    rdzv.set_change_callback(lambda: None)
    assert rdzv.store_seat() is None  # a node is checked alone
    board = rdzv.exclusions  # no record to keep a node out in
    assert isinstance(board, NoExclusions)
    assert board.exclude("its node check failed") is None and board.take_kept_at_min() is None
    assert board.exclusion() is None and board.excluded_nodes() == []


class _BlockedHandler(LocalRendezvousHandler):
    """A torch-style handler whose join blocks until released (a foreign wait)."""

    def __init__(self) -> None:
        super().__init__("job")
        self.release = threading.Event()

    def next_rendezvous(self) -> RendezvousInfo:
        self.release.wait(30)
        return super().next_rendezvous()


def test_a_torch_style_join_is_waited_for_in_the_callers_scope() -> None:
    rdzv = as_elastic(LocalRendezvousHandler("job"))
    assert rdzv.next_round(CancelScope()).round == 0
    closed = LocalRendezvousHandler("job")
    closed.set_closed()
    with pytest.raises(RendezvousClosedError):  # its errors come through
        as_elastic(closed).next_round(CancelScope())


def test_a_cancelled_scope_ends_a_blocked_torch_style_join_at_once() -> None:
    handler = _BlockedHandler()
    scope = CancelScope()
    threading.Timer(0.05, scope.cancel, ("received SIGTERM",)).start()
    t0 = time.monotonic()
    with pytest.raises(Cancelled, match="SIGTERM"):
        as_elastic(handler).next_round(scope)
    assert time.monotonic() - t0 < 5  # not the handler's 30 s
    handler.release.set()  # (the abandoned call ends)


def test_a_blocked_torch_style_join_ends_at_the_scopes_deadline_as_a_rendezvous_timeout() -> None:
    handler = _BlockedHandler()
    rdzv = as_elastic(handler)
    with CancelScope().child(0.05) as scope, pytest.raises(RendezvousTimeoutError):
        rdzv.next_round(scope)
    assert "elastrun-rendezvous-join" in repr(rdzv)  # the abandoned call, still running
    handler.release.set()
