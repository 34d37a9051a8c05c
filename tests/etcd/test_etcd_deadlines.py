"""Deadlines against an etcd member that went silent (stopped with SIGSTOP).

The contract suite (``tests/contract/test_store_deadlines.py``, collected on etcd too)
pins deadlines on waits that nothing answers; here no answer comes at all: each call in
a scope with a deadline ends by it with ``StoreTimeoutError`` -- a keep-alive, a write,
a watch -- and the client works again once the member does.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import pytest
from etcd_cluster import EtcdCluster

from _helpers import freeze
from elastrun.core.cancel import CancelScope
from elastrun.core.clock import Deadline
from elastrun.core.errors import StoreTimeoutError
from elastrun.store.etcd import EtcdStore

DEADLINE = 0.5
#: How far past its deadline a call may end on a loaded machine.
LATE = 1.0


@pytest.fixture
def silent(etcd: EtcdCluster) -> Iterator[EtcdCluster]:
    """The one member, stopped for the test's body and continued after it."""
    [member] = etcd.members
    assert member.proc is not None
    yield etcd
    member.proc.send_signal(signal.SIGCONT)


def _freeze(etcd: EtcdCluster) -> None:
    [member] = etcd.members
    assert member.proc is not None
    freeze(member.proc.pid)


def _ends_by_the_deadline(call: Callable[[], object]) -> StoreTimeoutError:
    t0 = time.monotonic()
    with (
        CancelScope(deadline=Deadline.after(DEADLINE)) as scope,
        scope.active(),
        pytest.raises(StoreTimeoutError) as caught,
    ):
        call()
    took = time.monotonic() - t0
    assert DEADLINE - 0.05 <= took < DEADLINE + LATE, took
    return caught.value


def test_calls_to_a_silent_member_end_at_their_scopes_deadline(silent: EtcdCluster) -> None:
    # A request timeout far longer than the deadline: only the deadline can end them.
    store = EtcdStore(silent.endpoints, request_timeout=30.0)
    try:
        lease = store.grant_lease(30)
        _, rev = store.get_prefix("dl/")
        _freeze(silent)
        _ends_by_the_deadline(lambda: store.keep_alive(lease))
        unknown = _ends_by_the_deadline(lambda: store.set("dl/k", b"v"))
        assert "may or may not have been applied" in str(unknown)
        _ends_by_the_deadline(lambda: store.watch("dl/", rev, 30.0))
        [member] = silent.members
        assert member.proc is not None
        member.proc.send_signal(signal.SIGCONT)
        assert store.keep_alive(lease) is True
        store.set("dl/k", b"w")
        assert store.get("dl/k") == b"w"
    finally:
        store.close()
