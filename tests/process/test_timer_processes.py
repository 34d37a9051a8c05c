"""Expiration timers with real worker processes.

The file timer server runs inside the test process, as it runs inside the agent: torch's
server kills its own process when a timer expires, so every test here that sees a
worker reaped also pins that the server's process survives.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from _helpers import pid_alive, wait_for
from elastrun.supervise.timers.agent_timer import AgentFileTimer
from elastrun.timer import (
    FileTimerClient,
    FileTimerServer,
    LocalTimerClient,
    LocalTimerServer,
    configure,
    expires,
)

PY = sys.executable


class Expiries:
    """Collects ``on_expired`` calls from the watchdog thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, int]] = []
        self._lock = threading.Lock()

    def __call__(self, pid: int, scope: str, sig: int) -> None:
        with self._lock:
            self.calls.append((pid, scope, sig))

    def snapshot(self) -> list[tuple[int, str, int]]:
        with self._lock:
            return list(self.calls)


@pytest.fixture
def expiries() -> Expiries:
    return Expiries()


@pytest.fixture
def server(expiries: Expiries) -> Iterator[FileTimerServer]:
    # A long interval: expiries must be acted on when they happen, not at the next pass.
    srv = FileTimerServer(None, "test-run", max_interval=5, on_expired=expiries)
    srv.start()
    yield srv
    srv.stop()


def worker(path: str, body: str, *, own_group: bool = True) -> subprocess.Popen[str]:
    """A Python worker with a configured FileTimerClient; ``body`` runs after setup."""
    code = textwrap.dedent(
        """
        import os, sys, time
        from elastrun import timer
        client = timer.FileTimerClient(sys.argv[1])
        timer.configure(client)
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen(
        [PY, "-c", code, path],
        stdout=subprocess.PIPE,
        text=True,
        process_group=0 if own_group else None,
    )


def reap(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_an_expired_timer_kills_only_its_worker_and_never_the_server_process(
    server: FileTimerServer, expiries: Expiries
) -> None:
    path = str(server.file_path)
    doomed = worker(
        path,
        """
        with timer.expires(after=0.3, scope="stuck-step"):
            print("armed", flush=True)
            time.sleep(30)
        """,
    )
    bystander = worker(
        path,
        """
        with timer.expires(after=60, scope="slow-but-fine"):
            print("armed", flush=True)
            time.sleep(30)
        """,
    )
    try:
        assert doomed.stdout is not None and bystander.stdout is not None
        assert doomed.stdout.readline() == "armed\n"
        assert bystander.stdout.readline() == "armed\n"
        armed_at = time.monotonic()
        assert doomed.wait(timeout=10) == -signal.SIGKILL
        # Acted on when the timer ran out, not at some later polling interval.
        assert time.monotonic() - armed_at < 3
        assert expiries.snapshot() == [(doomed.pid, "stuck-step", signal.SIGKILL)]
        assert bystander.poll() is None
        assert server.active_timers() == {bystander.pid: ["slow-but-fine"]}
    finally:
        reap(doomed, bystander)


def test_the_workers_process_group_is_reaped_with_it(server: FileTimerServer) -> None:
    doomed = worker(
        str(server.file_path),
        """
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        print(child.pid, flush=True)
        with timer.expires(after=0.2):
            time.sleep(30)
        """,
    )
    try:
        assert doomed.stdout is not None
        grandchild = int(doomed.stdout.readline())
        assert doomed.wait(timeout=10) == -signal.SIGKILL
        wait_for(lambda: not pid_alive(grandchild), timeout=5, what="the worker's child to die")
    finally:
        reap(doomed)


def test_released_timers_do_not_fire(server: FileTimerServer, expiries: Expiries) -> None:
    proc = worker(
        str(server.file_path),
        """
        for i in range(3):
            with timer.expires(after=1.0, scope=f"quick-{i}"):
                time.sleep(0.01)
        time.sleep(1.2)  # past every expiration time
        print("survived", flush=True)
        """,
    )
    out, _ = proc.communicate(timeout=20)
    assert (proc.returncode, out) == (0, "survived\n")
    assert expiries.snapshot() == []
    assert server.request_count == 6


def test_ten_clients_with_ten_requests_each_are_all_registered(server: FileTimerServer) -> None:
    procs = [
        worker(
            str(server.file_path),
            """
            for i in range(10):
                with timer.expires(after=60, scope=f"step-{i}"):
                    pass
            """,
        )
        for _ in range(10)
    ]
    try:
        assert [p.wait(timeout=30) for p in procs] == [0] * 10
    finally:
        reap(*procs)
    wait_for(lambda: server.request_count == 200, timeout=5, what="200 requests")
    assert server.active_timers() == {}


def test_a_worker_that_exits_holding_a_timer_has_it_cleared_and_is_not_reaped(
    server: FileTimerServer, expiries: Expiries
) -> None:
    proc = worker(
        str(server.file_path),
        """
        client.acquire("abandoned", time.time() + 1.0)
        os._exit(0)
        """,
    )
    assert proc.wait(timeout=10) == 0
    proc.communicate()
    wait_for(lambda: server.request_count == 1, timeout=5, what="the request")
    wait_for(lambda: server.active_timers() == {}, timeout=5, what="the timer to be cleared")
    time.sleep(1.1)  # past its expiration: nothing may be reported
    assert expiries.snapshot() == []


def test_a_timer_naming_the_server_process_is_refused(
    server: FileTimerServer, expiries: Expiries
) -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        # A request for the server's own pid: torch's server would signal itself.
        FileTimerClient(str(server.file_path), signal=signal.SIGUSR1).acquire("self", 0.0)
        wait_for(lambda: server.request_count == 1, timeout=5, what="the request")
        wait_for(lambda: server.active_timers() == {}, timeout=5, what="the timer to be dropped")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []
    assert expiries.snapshot() == []


def test_stop_is_prompt_and_removes_the_fifo_and_its_private_directory() -> None:
    srv = FileTimerServer(None, "test-run", max_interval=10)
    srv.start()
    path = Path(str(srv.file_path))
    assert stat.S_ISFIFO(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    FileTimerClient(str(path)).acquire("pending", time.time() + 60)
    started = time.monotonic()
    srv.stop()
    assert time.monotonic() - started < 1.0
    assert not path.exists()
    assert not path.parent.exists()
    srv.stop()  # idempotent


def test_a_client_without_a_server_gets_a_broken_pipe(tmp_path: Path) -> None:
    srv = FileTimerServer(str(tmp_path / "fifo"), "test-run", max_interval=0.2)
    srv.start()
    srv.stop()
    with pytest.raises(BrokenPipeError):
        FileTimerClient(str(tmp_path / "fifo")).acquire("x", time.time() + 1)


def test_the_agent_timer_honours_a_given_path_and_knows_which_pid_expired(tmp_path: Path) -> None:
    calls = Expiries()
    given = str(tmp_path / "watchdog")
    (tmp_path / "watchdog").write_text("stale file from an earlier run")
    timer = AgentFileTimer(given, max_interval=0.2, on_expired=calls)
    try:
        assert timer.start("run-1") == given
        assert timer.start("run-1") == given  # already running: same path
        assert timer.file_path == given
        assert stat.S_ISFIFO(os.stat(given).st_mode)
        proc = worker(
            given,
            """
            with timer.expires(after=0.2, scope="hung-collective"):
                time.sleep(30)
            """,
        )
        assert proc.wait(timeout=10) == -signal.SIGKILL
        proc.communicate()
        # Recorded before the signal was sent: no waiting needed once the exit is seen.
        assert timer.expired_pids() == {proc.pid: "hung-collective"}
        assert timer.expired_pids() == {}
        assert calls.snapshot() == [(proc.pid, "hung-collective", signal.SIGKILL)]
        assert timer.get_last_progress_time() >= int(time.time()) - 2
    finally:
        timer.stop()
    assert not os.path.exists(given)
    assert timer.file_path is None


def test_the_agent_timer_uses_a_fresh_private_path_per_start() -> None:
    timer = AgentFileTimer(max_interval=0.2)
    first = timer.start("run")
    timer.stop()
    second = timer.start("run")
    timer.stop()
    assert first != second
    assert not os.path.exists(first) and not os.path.exists(second)


# -- the multiprocessing-queue timers ----------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def resource_tracker_started_outside_any_test() -> None:
    # A spawn-context queue registers a semaphore with multiprocessing's resource
    # tracker, which starts a helper process that lives as long as pytest. Started here,
    # before any test's leak check begins, it is not mistaken for a leaked worker.
    resource_tracker.ensure_running()


def _local_worker(q: object, after: float, hold: float) -> None:
    configure(LocalTimerClient(q))  # type: ignore[arg-type]  # q: a spawn queue, typed object
    with expires(after=after, scope="local"):
        time.sleep(hold)


def test_local_timer_server_kills_an_expired_child_and_spares_one_that_released() -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    srv = LocalTimerServer(q, max_interval=0.1)
    srv.start()
    doomed = ctx.Process(target=_local_worker, args=(q, 0.5, 30))
    fine = ctx.Process(target=_local_worker, args=(q, 30, 0.1))
    try:
        doomed.start()
        fine.start()
        doomed.join(timeout=20)
        fine.join(timeout=20)
        assert doomed.exitcode == -signal.SIGKILL
        assert fine.exitcode == 0
    finally:
        for p in (doomed, fine):
            if p.is_alive():
                p.kill()
                p.join()
            p.close()
        started = time.monotonic()
        srv.stop()
        assert time.monotonic() - started < 1.0
        q.close()
        q.join_thread()


def test_the_timer_client_never_loads_the_agents_watchdog_until_its_name_is_asked_for() -> None:
    code = textwrap.dedent(
        """
        import sys
        from elastrun import timer
        from elastrun.timer.file import FileTimerClient
        AGENT = [["elastrun", "supervise"], ["elastrun", "agent"]]
        agent_side = [m for m in sys.modules if m.split(".")[:2] in AGENT]
        assert not agent_side, agent_side
        from elastrun.supervise.timers.agent_timer import AgentFileTimer
        from elastrun.supervise.timers.file_server import FileTimerServer
        import elastrun.timer.file as file
        assert timer.FileTimerServer is FileTimerServer is file.FileTimerServer
        assert file.AgentFileTimer is AgentFileTimer
        print("ok")
        """
    )
    out = subprocess.run([PY, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
