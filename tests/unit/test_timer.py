"""Expiration timers: requests, scopes, the bookkeeping and the reap decisions, with fakes."""

from __future__ import annotations

import json
import queue
import select
import signal
import time
from collections.abc import Hashable
from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError, ElastrunError
from elastrun.supervise.timers.agent_timer import AgentFileTimer
from elastrun.supervise.timers.file_server import plan_reaps
from elastrun.testing import FakeClock
from elastrun.timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
    LocalTimerServer,
    MultiprocessingRequestQueue,
    RequestQueue,
    TimerClient,
    TimerRequest,
    TimerServer,
    api,
    configure,
    expires,
)
from elastrun.timer.api import TimerNotConfiguredError, TimerTable, expired_timers
from elastrun.wire.timer import (
    TORCHELASTIC_ENABLE_FILE_TIMER,
    TORCHELASTIC_TIMER_FILE,
    TimerRequestError,
)

NOT_A_PID = 4_000_123  # above any default pid_max: never a running process


class RecordingClient(TimerClient):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None]] = []

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.calls.append(("acquire", scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self.calls.append(("release", scope_id, None))


@pytest.fixture(autouse=True)
def no_global_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "_timer_client", None)


# -- requests ------------------------------------------------------------------------


def test_timer_requests_compare_by_value() -> None:
    assert TimerRequest(1, "s", 5.0) == TimerRequest(1, "s", 5.0)
    assert TimerRequest(1, "s", 5.0) != TimerRequest(2, "s", 5.0)
    assert TimerRequest(1, "s", 5.0) != TimerRequest(1, "t", 5.0)
    assert TimerRequest(1, "s", 5.0) != TimerRequest(1, "s", 6.0)
    assert TimerRequest(1, "s", 5.0) != (1, "s", 5.0)
    assert "worker_id=1" in repr(TimerRequest(1, "s", 5.0))


def test_negative_expiration_is_a_release() -> None:
    assert TimerRequest(1, "s", -1).is_release
    assert not TimerRequest(1, "s", 0.0).is_release


def test_file_timer_requests_also_compare_signal_and_not_equal_plain_requests() -> None:
    assert FileTimerRequest(1, "s", 5.0, 9) == FileTimerRequest(1, "s", 5.0, 9)
    assert FileTimerRequest(1, "s", 5.0, 9) != FileTimerRequest(1, "s", 5.0, 15)
    assert FileTimerRequest(1, "s", 5.0, 9) != TimerRequest(1, "s", 5.0)
    assert TimerRequest(1, "s", 5.0) != FileTimerRequest(1, "s", 5.0, 9)


def test_file_timer_request_json_has_torchs_keys_and_round_trips() -> None:
    request = FileTimerRequest(1234, "train.py#10", 1.7e9 + 0.5, signal.SIGKILL)
    wire = json.loads(request.to_json())
    assert wire == {
        "version": 1,
        "pid": 1234,
        "scope_id": "train.py#10",
        "expiration_time": 1.7e9 + 0.5,
        "signal": signal.SIGKILL,
    }
    assert FileTimerRequest.from_json(request.to_json()) == request
    assert FileTimerRequest.from_json(request.to_json().encode()) == request
    assert request.worker_pid == 1234


def test_a_line_from_torchs_client_without_optional_fields_parses() -> None:
    parsed = FileTimerRequest.from_json('{"pid": 7, "scope_id": "x", "expiration_time": 3}')
    assert parsed == FileTimerRequest(7, "x", 3.0, 0)


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '{"scope_id": "x", "expiration_time": 1, "signal": 9}',
        '{"pid": "7", "scope_id": "x", "expiration_time": 1, "signal": 9}',
        '{"pid": true, "scope_id": "x", "expiration_time": 1, "signal": 9}',
        '{"pid": 7, "scope_id": 3, "expiration_time": 1, "signal": 9}',
        '{"pid": 7, "scope_id": "x", "expiration_time": "soon", "signal": 9}',
        '{"pid": 7, "scope_id": "x", "expiration_time": false, "signal": 9}',
        '{"pid": 7, "scope_id": "x", "expiration_time": 1, "signal": "KILL"}',
        '{"version": 2, "pid": 7, "scope_id": "x", "expiration_time": 1, "signal": 9}',
    ],
)
def test_malformed_wire_lines_are_rejected(line: str) -> None:
    with pytest.raises(TimerRequestError) as info:
        FileTimerRequest.from_json(line)
    assert isinstance(info.value, ElastrunError)
    assert isinstance(info.value, ValueError)


def test_client_refuses_a_request_longer_than_pipe_buf_before_touching_the_fifo() -> None:
    client = FileTimerClient("/nonexistent/fifo")
    with pytest.raises(RuntimeError, match="PIPE_BUF"):
        client.acquire("x" * select.PIPE_BUF, 1.0)


# -- expires -------------------------------------------------------------------------


def test_expires_default_scope_names_the_callers_file_and_line() -> None:
    client = RecordingClient()
    with expires(after=1, client=client):
        line = _current_line() - 1
    assert client.calls[0][1] == f"{__file__}#{line}"
    assert client.calls[1] == ("release", f"{__file__}#{line}", None)


def _current_line() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_expires_acquires_now_plus_after_on_wall_clock_and_releases_the_same_scope() -> None:
    client = RecordingClient()
    before = time.time()
    with expires(after=30, scope="step", client=client):
        assert len(client.calls) == 1
    after = time.time()
    kind, scope, expiration = client.calls[0]
    assert (kind, scope) == ("acquire", "step")
    assert expiration is not None
    assert before + 30 <= expiration <= after + 30
    assert client.calls[1] == ("release", "step", None)


def test_expires_releases_when_the_block_raises() -> None:
    client = RecordingClient()
    with pytest.raises(KeyError), expires(after=1, scope="s", client=client):
        raise KeyError("boom")
    assert [c[0] for c in client.calls] == ["acquire", "release"]


def test_expires_uses_the_configured_client() -> None:
    client = RecordingClient()
    configure(client)
    with expires(after=1, scope="s"):
        pass
    assert [c[0] for c in client.calls] == ["acquire", "release"]


def test_expires_without_any_client_raises_a_runtime_error_on_entry() -> None:
    cm = expires(after=1)
    with pytest.raises(TimerNotConfiguredError) as info, cm:
        pass
    assert isinstance(info.value, RuntimeError)


def test_expires_does_not_release_what_it_failed_to_acquire() -> None:
    class Failing(RecordingClient):
        def acquire(self, scope_id: str, expiration_time: float) -> None:
            raise BrokenPipeError("no server")

    client = Failing()
    with pytest.raises(BrokenPipeError), expires(after=1, client=client):
        pass
    assert client.calls == []


# -- bookkeeping ---------------------------------------------------------------------


def test_expired_timers_are_those_at_or_before_the_deadline_grouped_by_worker() -> None:
    timers = [
        TimerRequest(1, "a", 10.0),
        TimerRequest(1, "b", 20.0),
        TimerRequest(2, "a", 9.0),
        TimerRequest(3, "a", 10.5),
        TimerRequest(4, "gone", -1),
    ]
    assert expired_timers(timers, 10.0) == {1: [timers[0]], 2: [timers[2]]}
    assert expired_timers(timers, 100.0) == {1: timers[:2], 2: [timers[2]], 3: [timers[3]]}
    assert expired_timers(timers, 0.0) == {}


def test_timer_table_arms_rearms_and_releases_by_worker_and_scope() -> None:
    table: TimerTable[TimerRequest] = TimerTable()
    seen = table.register([TimerRequest(1, "a", 10.0), TimerRequest(1, "b", 30.0)])
    assert seen == 2
    table.register([TimerRequest(1, "a", 50.0)])  # re-arm replaces
    assert table.next_expiration() == 30.0
    table.register([TimerRequest(1, "b", -1)])  # release
    assert [(r.scope_id, r.expiration_time) for r in table] == [("a", 50.0)]
    table.register([TimerRequest(2, "never-armed", -1)])  # releasing nothing is fine
    assert len(table) == 1


def test_timer_table_clears_workers_and_reports_no_expiration_when_empty() -> None:
    table: TimerTable[TimerRequest] = TimerTable()
    table.register([TimerRequest(w, "s", 10.0 + w) for w in (1, 2, 3)])
    table.clear({1, 3})
    assert table.workers() == {2}
    table.clear_if(lambda worker: worker == 2)
    assert len(table) == 0
    assert table.next_expiration() is None


def test_reap_plan_takes_the_earliest_expired_timer_that_carries_a_signal() -> None:
    t_nosig = FileTimerRequest(5, "early-no-signal", 1.0, 0)
    t_term = FileTimerRequest(5, "later-term", 2.0, signal.SIGTERM)
    t_kill = FileTimerRequest(5, "latest-kill", 3.0, signal.SIGKILL)
    (decision,) = plan_reaps({5: [t_kill, t_term, t_nosig]})
    assert decision.pid == 5
    assert decision.request == t_term
    assert decision.signal == signal.SIGTERM
    assert decision.scope_id == "later-term"
    assert decision.expired == (t_nosig, t_term, t_kill)


def test_reap_plan_reports_but_does_not_signal_workers_whose_timers_carry_no_signal() -> None:
    decisions = plan_reaps(
        {9: [FileTimerRequest(9, "quiet", 1.0, 0)], 3: [FileTimerRequest(3, "k", 1.0, 9)]}
    )
    assert [d.pid for d in decisions] == [3, 9]
    assert decisions[1].request is None
    assert decisions[1].signal == 0
    assert decisions[1].scope_id == "quiet"


# -- the generic watchdog round --------------------------------------------------------


class ScriptedQueue(RequestQueue):
    def __init__(self, batches: list[list[TimerRequest]]) -> None:
        self.batches = batches

    def size(self) -> int:
        return len(self.batches[0]) if self.batches else 0

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        return self.batches.pop(0) if self.batches else []


class FakeServer(TimerServer):
    def __init__(self, q: RequestQueue, clock: FakeClock, outcomes: dict[int, object]) -> None:
        super().__init__(q, max_interval=1, clock=clock)
        self.table: TimerTable[TimerRequest] = TimerTable()
        self.outcomes = outcomes  # worker -> True | False | an exception to raise
        self.reaped: list[Hashable] = []

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        self.table.register(timer_requests)

    def clear_timers(self, worker_ids: set[Hashable]) -> None:
        self.table.clear(worker_ids)

    def get_expired_timers(self, deadline: float) -> dict[Hashable, list[TimerRequest]]:
        return self.table.expired(deadline)

    def _reap_worker(self, worker_id: Hashable) -> bool:
        self.reaped.append(worker_id)
        # call-overload: worker ids are typed Hashable; the test's are the dict's int keys
        outcome = self.outcomes.get(worker_id, True)  # type: ignore[call-overload]
        if isinstance(outcome, BaseException):
            raise outcome
        return bool(outcome)


def test_watchdog_round_reaps_expired_workers_and_keeps_failed_reaps_for_a_retry() -> None:
    clock = FakeClock(wall=100.0)
    q = ScriptedQueue(
        [[TimerRequest(1, "a", 99.0), TimerRequest(2, "a", 99.0), TimerRequest(3, "a", 500.0)]]
    )
    server = FakeServer(q, clock, {2: False})
    server._run_watchdog()
    assert sorted(server.reaped) == [1, 2]  # type: ignore[type-var]  # ints here, typed Hashable
    assert server.table.workers() == {2, 3}  # 2 failed: retried; 3 not expired yet
    server.outcomes[2] = True
    server._run_watchdog()
    assert server.table.workers() == {3}


def test_an_exception_while_reaping_counts_as_reaped() -> None:
    clock = FakeClock(wall=100.0)
    server = FakeServer(ScriptedQueue([[TimerRequest(1, "a", 1.0)]]), clock, {1: OSError("x")})
    server._run_watchdog()
    assert server.reaped == [1]
    assert len(server.table) == 0


def test_timers_expire_only_once_the_clock_reaches_them() -> None:
    clock = FakeClock(wall=100.0)
    server = FakeServer(ScriptedQueue([[TimerRequest(1, "a", 105.0)]]), clock, {})
    server._run_watchdog()
    assert server.reaped == []
    clock.advance(5)
    server._run_watchdog()
    assert server.reaped == [1]


def test_servers_reject_a_non_positive_interval() -> None:
    with pytest.raises(ConfigError):
        LocalTimerServer(queue.Queue(), max_interval=0)
    with pytest.raises(ConfigError):
        FileTimerServer(None, "run", max_interval=-1)
    with pytest.raises(ConfigError):
        AgentFileTimer(max_interval=0)


# -- the multiprocessing queue adapter -------------------------------------------------


def test_request_queue_takes_at_most_size_and_skips_foreign_items() -> None:
    q: queue.Queue[object] = queue.Queue()
    for item in (TimerRequest(1, "a", 1.0), "junk", TimerRequest(2, "a", 1.0)):
        q.put(item)
    q.put(TimerRequest(3, "a", 1.0))
    adapter = MultiprocessingRequestQueue(q)
    assert adapter.size() == 4
    assert [r.worker_id for r in adapter.get(2, timeout=0)] == [1, 2]
    assert [r.worker_id for r in adapter.get(5, timeout=0)] == [3]
    assert adapter.get(5, timeout=0) == []


def test_request_queue_get_returns_at_a_wakeup() -> None:
    q: queue.Queue[object] = queue.Queue()
    adapter = MultiprocessingRequestQueue(q)
    q.put(TimerRequest(1, "a", 1.0))
    adapter.wake()
    q.put(TimerRequest(2, "a", 1.0))
    assert [r.worker_id for r in adapter.get(10, timeout=60)] == [1]


def test_local_timer_server_stops_promptly_despite_a_long_interval() -> None:
    server = LocalTimerServer(queue.Queue(), max_interval=60)
    server.start()
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 1.0
    assert "running=False" in repr(server)


# -- the file server's bookkeeping with fake time --------------------------------------


class RecordingFileServer(FileTimerServer):
    def __init__(self, clock: FakeClock, ok: bool = True) -> None:
        super().__init__(None, "run", on_expired=self._on, clock=clock)
        self.ok = ok
        self.events: list[tuple[str, object]] = []

    def _on(self, pid: int, scope: str, sig: int) -> None:
        self.events.append(("expired", (pid, scope, sig)))

    def _reap_worker(self, worker_pid: int, signal: int) -> bool:
        self.events.append(("reap", (worker_pid, signal)))
        return self.ok


def test_file_server_registers_releases_and_counts_requests() -> None:
    server = RecordingFileServer(FakeClock(wall=100.0))
    server.register_timers(
        [FileTimerRequest(NOT_A_PID, "a", 110.0, 9), FileTimerRequest(NOT_A_PID, "b", 120.0, 9)]
    )
    server.register_timers([FileTimerRequest(NOT_A_PID, "a", -1, 0)])
    assert server.active_timers() == {NOT_A_PID: ["b"]}
    assert server.request_count == 3
    assert server.get_expired_timers(119.0) == {}
    assert list(server.get_expired_timers(120.0)) == [NOT_A_PID]


def test_file_server_drops_timers_of_processes_that_are_not_running() -> None:
    server = RecordingFileServer(FakeClock(wall=100.0))
    server.register_timers([FileTimerRequest(NOT_A_PID, "a", 500.0, 9)])
    server.clear_timers(set())
    assert server.active_timers() == {}


def test_file_server_reports_an_expiry_before_signalling_and_only_for_expired_timers() -> None:
    clock = FakeClock(wall=100.0)
    server = RecordingFileServer(clock)
    server.register_timers(
        [FileTimerRequest(NOT_A_PID, "late", 150.0, 9), FileTimerRequest(NOT_A_PID + 1, "s", 90, 9)]
    )
    assert server._reap_expired(clock.time()) == {NOT_A_PID + 1}
    assert server.events == [
        ("expired", (NOT_A_PID + 1, "s", 9)),
        ("reap", (NOT_A_PID + 1, 9)),
    ]


def test_file_server_neither_signals_nor_reports_a_timer_without_signal() -> None:
    clock = FakeClock(wall=100.0)
    server = RecordingFileServer(clock)
    server.register_timers([FileTimerRequest(NOT_A_PID, "quiet", 90.0, 0)])
    assert server._reap_expired(clock.time()) == {NOT_A_PID}  # cleared all the same
    assert server.events == []


def test_file_server_keeps_a_failed_reap_for_the_next_pass() -> None:
    clock = FakeClock(wall=100.0)
    server = RecordingFileServer(clock, ok=False)
    server.register_timers([FileTimerRequest(NOT_A_PID, "s", 90.0, 9)])
    assert server._reap_expired(clock.time()) == set()


def test_progress_time_is_now_until_a_client_has_written() -> None:
    clock = FakeClock(wall=1000.0)
    server = RecordingFileServer(clock)
    clock.advance(50)
    assert server.get_last_progress_time() == 1050


# -- the agent's handle ------------------------------------------------------------------


def test_agent_timer_is_off_unless_enabled_with_exactly_1() -> None:
    assert AgentFileTimer.from_env({}) is None
    assert AgentFileTimer.from_env({TORCHELASTIC_ENABLE_FILE_TIMER: "0"}) is None
    assert AgentFileTimer.from_env({TORCHELASTIC_TIMER_FILE: "/x"}) is None
    with pytest.raises(ConfigError, match=TORCHELASTIC_ENABLE_FILE_TIMER):
        AgentFileTimer.from_env({TORCHELASTIC_ENABLE_FILE_TIMER: "true"})
    timer = AgentFileTimer.from_env({TORCHELASTIC_ENABLE_FILE_TIMER: "1"})
    assert timer is not None
    assert timer.file_path is None


def test_agent_timer_not_running_reports_now_as_progress_and_nothing_expired() -> None:
    timer = AgentFileTimer(clock=FakeClock(wall=1234.5))
    assert timer.get_last_progress_time() == 1234
    assert timer.expired_pids() == {}
    timer.stop()  # stopping what never started is fine


def test_a_fifo_that_cannot_be_made_leaves_no_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_fifo(path: str, mode: int = 0o666) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "mkfifo", no_fifo)
    server = FileTimerServer(None, "run", max_interval=1.0)
    with pytest.raises(OSError, match="Permission denied"):
        server.start()
    assert list(tmp_path.iterdir()) == []
