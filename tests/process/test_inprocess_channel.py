"""The in-process channel: the agent's hub and a worker's channel over a real socket."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from elastrun.inprocess.agent.hub import InprocessHub
from elastrun.inprocess.worker.channel import Channel
from elastrun.wire import inprocess as wire


def _until(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]  # a callable
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def hub() -> object:
    woken = threading.Event()
    made = InprocessHub(woken.set)
    made.woken = woken  # type: ignore[attr-defined]  # an Event the tests read
    yield made
    made.close()
    assert not os.path.exists(made.path)


@pytest.fixture
def channel(hub: InprocessHub, monkeypatch: pytest.MonkeyPatch) -> Iterator[Channel]:
    """A worker's channel to ``hub`` (local rank 0), closed at the end."""
    monkeypatch.setenv("ELASTRUN_INPROCESS_SOCKET", hub.path)
    made = Channel.from_env()
    assert made is not None
    yield made
    made.close()  # (a second close, after a test's own, is harmless)


def test_a_worker_opts_in_learns_rounds_and_reports_it_synced(
    hub: InprocessHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in hub.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_RANK", "1")
    channel = Channel.from_env()
    assert channel is not None
    try:
        channel.send("hello", pid=4242, round=0)
        assert _until(lambda: hub.opted_in(1, 4242))
        assert hub.woken.is_set()  # type: ignore[attr-defined]  # woken: added by the fixture
        assert not hub.opted_in(1, 999)  # another process of that local rank
        assert not hub.opted_in(0, 4242)
        envs = {1: {"MASTER_PORT": "1234", "RANK": "1", "PATH": "/not/sent"}}
        hub.announce(1, envs, {1: 4242})
        hub.announce(2, {1: {"MASTER_PORT": "5678", "RANK": "1"}}, {1: 4242})
        message = channel.wait_round(0, 5.0)
        assert message is not None and message["round"] == 2  # the newest supersedes
        assert message["env"] == {"MASTER_PORT": "5678", "RANK": "1"}
        assert channel.wait_round(2, 0.1) is None
        channel.send("synced", round=2, commit=7)
        assert _until(lambda: hub.synced(1, 4242, 2))
        assert not hub.synced(1, 4242, 1)
    finally:
        channel.close()


def test_a_round_for_another_process_of_the_rank_is_not_sent(
    hub: InprocessHub, channel: Channel
) -> None:
    try:
        channel.send("hello", pid=1, round=0)
        assert _until(lambda: hub.opted_in(0, 1))
        hub.announce(1, {0: {"RANK": "0"}}, {0: 2})  # local rank 0 is now pid 2
        assert channel.wait_round(0, 0.3) is None
    finally:
        channel.close()


def test_a_hello_of_another_channel_version_is_refused_and_the_channel_ends(
    hub: InprocessHub, channel: Channel
) -> None:
    try:
        channel.send("hello", version=wire.VERSION + 1, pid=7, round=0)
        # The agent closes the connection: the worker's channel ends at once (its own
        # errors then propagate), and the agent never counts it as recovering in place.
        started = time.monotonic()
        assert channel.wait_round(-1, 30.0) is None
        assert not channel.peer_failed(0, 30.0)
        assert time.monotonic() - started < 10.0  # ended, not timed out
        assert not hub.opted_in(0, 7)
    finally:
        channel.close()


def test_without_the_agent_there_is_no_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTRUN_INPROCESS_SOCKET", raising=False)
    assert Channel.from_env() is None
    monkeypatch.setenv("ELASTRUN_INPROCESS_SOCKET", "/nonexistent/elastrun.sock")
    assert Channel.from_env() is None


def test_the_reading_thread_acts_on_each_newer_round_while_the_worker_is_busy(
    hub: InprocessHub, channel: Channel
) -> None:
    seen: list[tuple[int, list[str]]] = []
    channel.on_round = lambda m: seen.append((m["round"], m["cut"]))
    channel.start()
    try:
        channel.send("hello", pid=7, round=0)
        assert _until(lambda: hub.opted_in(0, 7))
        hub.announce(2, {0: {"RANK": "0"}}, {0: 7}, ["0100007F:1F90"])
        assert _until(lambda: len(seen) == 1)  # nobody waits for it: the thread acts
        hub.announce(1, {0: {"RANK": "0"}}, {0: 7})  # older than the newest: not acted on
        hub.announce(3, {0: {"RANK": "0"}}, {0: 7})
        assert _until(lambda: len(seen) == 2)
        assert seen == [(2, ["0100007F:1F90"]), (3, [])]
        message = channel.wait_round(0, 5.0)
        assert message is not None and message["round"] == 3  # and the loop takes the newest
    finally:
        channel.close()
    hub.announce(4, {0: {"RANK": "0"}}, {0: 7})  # after close: nothing reads, nothing breaks


def test_a_workers_question_is_answered_by_the_agent_or_by_a_newer_round(
    hub: InprocessHub, channel: Channel
) -> None:
    try:
        channel.send("hello", pid=7, round=0)
        assert _until(lambda: hub.opted_in(0, 7))

        def answer_when_asked(round_no: int, peer_failed: bool) -> None:
            assert _until(lambda: hub.questions() == {0: (7, round_no)})
            hub.answer(0, 7, round_no, peer_failed)

        for peer_failed in (False, True):
            t = threading.Thread(target=answer_when_asked, args=(0, peer_failed))
            t.start()
            assert channel.peer_failed(0, 5.0) is peer_failed
            t.join()
            assert hub.questions() == {}
        hub.announce(1, {0: {"RANK": "0"}}, {0: 7})  # a newer round answers it too
        assert channel.peer_failed(0, 5.0) is True
        assert channel.peer_failed(1, 0.1) is False  # no answer in time: its own
        hub.forget(0, 8)  # another process of the rank: kept
        assert hub.questions() == {0: (7, 1)}
        hub.forget(0, 7)
        assert hub.questions() == {}
    finally:
        channel.close()
    hub.answer(0, 7, 1, True)  # after close: nothing reads, nothing breaks


def test_a_late_hello_is_answered_with_the_newest_round_announced_to_its_process(
    hub: InprocessHub, channel: Channel
) -> None:
    # Local rank 0's replacement (pid 7) was started into round 1; round 1 was abandoned
    # and round 2 announced before its hello came. Its hello (round 1) is answered with
    # round 2 at once: it never waits on round 1's stopped store.
    hub.announce(1, {0: {"RANK": "0", "MASTER_PORT": "1"}}, {0: 7})
    hub.announce(2, {0: {"RANK": "0", "MASTER_PORT": "2"}}, {0: 7}, ["0100007F:1F90"])
    try:
        channel.send("hello", pid=7, round=1)
        message = channel.wait_round(1, 5.0)
        assert message is not None and message["round"] == 2
        assert message["env"] == {"RANK": "0", "MASTER_PORT": "2"}
        assert message["cut"] == ["0100007F:1F90"]
        assert channel.newer_than(1)
    finally:
        channel.close()


@pytest.mark.parametrize(("pid", "round_no"), [(7, 2), (8, 1)], ids=["current", "another-pid"])
def test_a_hello_is_not_sent_a_round_it_is_in_or_one_for_another_process(
    hub: InprocessHub, channel: Channel, pid: int, round_no: int
) -> None:
    hub.announce(2, {0: {"RANK": "0"}}, {0: 7})
    try:
        channel.send("hello", pid=pid, round=round_no)
        assert _until(lambda: hub.opted_in(0, pid))
        assert channel.wait_round(-1, 0.3) is None
    finally:
        channel.close()


@pytest.mark.parametrize("first", [b"not json\n", b"x" * (wire.MAX_LINE + 2)])
def test_a_garbled_first_message_ends_the_channel_at_once(first: bytes) -> None:
    import socket

    agent, worker = socket.socketpair()
    channel = Channel(worker, local_rank=0)
    try:
        channel.start()  # (the reader takes a long line as it comes)
        agent.sendall(first)
        started = time.monotonic()
        # The reader ends the channel (as when the agent closes it): no wait to the bound.
        assert channel.wait_round(after=-1, timeout=30) is None
        assert channel.peer_failed(0, timeout=30) is False
        assert time.monotonic() - started < 10
    finally:
        channel.close()
        agent.close()
