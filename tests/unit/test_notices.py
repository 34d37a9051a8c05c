"""The wait for worker exits: a notice ends it without ending the run, none is lost, and
its cancel scope ends it with ``Cancelled``."""

from __future__ import annotations

import select
import threading
import time
from pathlib import Path

import pytest

from elastrun.agent.notices import Notices
from elastrun.agent.options import AgentOptions
from elastrun.agent.parts import World
from elastrun.agent.spec import WorkerSpec
from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import Deadline
from elastrun.core.errors import ShutdownRequested
from elastrun.core.shutdown import ShutdownRequest
from elastrun.launch.local_agent import LocalElasticAgent
from elastrun.supervise.processes.logs import DefaultLogsSpecs
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.testing import FakeStarter, NullGuard

# What "at once" allows on a loaded machine; each wait below would last LONG otherwise.
PROMPT = 2.0
LONG = 60.0


def _pending(notices: Notices) -> bool:
    return bool(select.select([notices.fileno()], [], [], 0)[0])


def _timed(call: object) -> float:
    t0 = time.monotonic()
    call()  # type: ignore[operator]  # a callable, typed object
    return time.monotonic() - t0


def test_a_notice_posted_between_two_waits_ends_the_next_wait_at_once() -> None:
    notices = Notices()
    procs = ProcessSet([])
    try:
        notices.take()  # the loop looks at what changed...
        notices.post()  # ...and news comes before its next wait
        took = _timed(lambda: procs.wait_for_exits(Deadline.after(LONG), None, notices.fileno()))
        assert took < PROMPT
        assert _pending(notices)  # the wait leaves it for the loop's look
        notices.take()
        assert not _pending(notices)
    finally:
        procs.close()
        notices.close()


def test_a_notice_posted_during_the_wait_ends_it() -> None:
    notices = Notices()
    procs = ProcessSet([])
    timer = threading.Timer(0.1, notices.post)
    try:
        timer.start()
        took = _timed(lambda: procs.wait_for_exits(Deadline.after(LONG), None, notices.fileno()))
        assert took < PROMPT
    finally:
        timer.cancel()
        procs.close()
        notices.close()


def test_a_notice_after_close_is_dropped() -> None:
    notices = Notices()
    notices.post()
    notices.close()
    notices.post()  # a watch thread that outlived the loop: nothing happens
    with pytest.raises(ValueError, match="closed"):
        notices.fileno()


def test_a_cancelled_scope_ends_the_wait_for_exits_with_cancelled() -> None:
    scope = CancelScope()
    procs = ProcessSet([])
    timer = threading.Timer(0.1, scope.cancel, args=("stop",))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(Cancelled, match="stop"):
            procs.wait_for_exits(Deadline.after(LONG), scope)
        assert time.monotonic() - t0 < PROMPT
    finally:
        timer.cancel()
        procs.close()
        scope.close()


def test_a_stop_request_ends_the_agents_wait_for_running_workers(tmp_path: Path) -> None:
    # The workers run until signalled; the loop would look again only after a minute.
    starter = FakeStarter(script=lambda a, r: None)
    request = ShutdownRequest()
    spec = WorkerSpec(local_world_size=2, entrypoint="/bin/prog", monitor_interval=LONG)
    agent = LocalElasticAgent(
        spec,
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
        options=AgentOptions(environ={}, run_id="unit"),
        world=World(starter=starter, guard=NullGuard(), shutdown=request),
    )
    timer = threading.Timer(0.2, request.request, args=(15,))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(ShutdownRequested):
            agent.run()
        assert time.monotonic() - t0 < PROMPT + 0.2
    finally:
        timer.cancel()
        request.close()
    assert all(p.signals[:1] == [15] for p in starter.started)
