"""The shutdown ladder's record of who ended each worker, and its work in a process
with no descriptor left."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import Deadline
from elastrun.supervise.processes.procset import UNWATCHED_SLICE, ProcessSet
from elastrun.supervise.processes.spawn import ProcessSpec, SubprocessStarter
from elastrun.testing import FakeProcess

# Says "ready" once its SIGTERM handler is in place; the handler aborts (SIGABRT), as a
# worker whose native teardown crashes while it is being stopped. It writes no core: on
# a machine where cores are written (ulimit -c, a core_pattern helper), a dump still
# under way when the ladder's SIGKILL comes makes the kernel report SIGKILL (that case
# is the next test's), and this test is about the signal only.
ABORTS_ON_SIGTERM = (
    "import os, resource, signal, sys, time\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))\n"
    "signal.signal(signal.SIGTERM, lambda *_: os.abort())\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
STOPS_ON_SIGTERM = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"


def test_a_worker_that_dies_of_its_own_signal_while_stopped_is_not_counted_as_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    starter = SubprocessStarter()
    procs = []
    for lr, code in enumerate((STOPS_ON_SIGTERM, ABORTS_ON_SIGTERM)):
        r, w = os.pipe()
        spec = ProcessSpec(lr, dict(os.environ), argv=(sys.executable, "-c", code), stdout_fd=w)
        procs.append(starter.start(spec))
        os.close(w)
        with os.fdopen(r) as out:
            assert out.readline() == "ready\n"
    group = ProcessSet(procs)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="elastrun"):
        report = group.stop(signal.SIGTERM, timeout=30.0)
    took = time.monotonic() - t0
    group.close()
    exits = {ex.local_rank: ex for ex in report.exits}
    # Seen once (-9 for the aborting worker): whether the ladder sent that SIGKILL (its
    # warnings, with each late worker's /proc state) or something else did, and when.
    evidence = (report, f"stopped in {took:.2f}s", [r.getMessage() for r in caplog.records])
    assert (exits[0].exitcode, exits[0].by_agent) == (-signal.SIGTERM, True), evidence
    assert (exits[1].exitcode, exits[1].by_agent) == (-signal.SIGABRT, False), evidence


def test_a_worker_still_writing_its_core_when_the_grace_ends_is_not_counted_as_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The kernel reports a process that a SIGKILL interrupted in its core dump as killed
    # by SIGKILL, not by the signal it was dying of: the ladder notes which late workers
    # were writing a core before it sends its SIGKILL, and records their exits as their
    # own failures. (A fake /proc here: a dump that outlasts a grace takes gigabytes.)
    dumping, deaf = (
        FakeProcess(ProcessSpec(lr, {}, argv=("w",)), 0, ignore_signals=True) for lr in (0, 1)
    )
    group = ProcessSet([dumping, deaf], dumping_core=lambda pid: pid == dumping.pid)
    with caplog.at_level(logging.WARNING, logger="elastrun"):
        report = group.stop(signal.SIGTERM, timeout=0.05)
    group.close()
    for proc in (dumping, deaf):
        proc.release()
    exits = {ex.local_rank: ex for ex in report.exits}
    assert report.killed == (0, 1)
    assert (exits[0].exitcode, exits[0].by_agent) == (-signal.SIGKILL, False)
    assert (exits[1].exitcode, exits[1].by_agent) == (-signal.SIGKILL, True)
    said = [r.getMessage() for r in caplog.records if "core dump" in r.getMessage()]
    assert said == [
        f"local rank 0 (pid {dumping.pid}) is writing a core dump (it dies of a signal of "
        "its own): the SIGKILL cuts the dump short and the kernel reports SIGKILL"
    ]


IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_worker_that_outlives_the_grace_is_described_before_its_sigkill(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r, w = os.pipe()
    argv = (sys.executable, "-c", IGNORES_SIGTERM)
    spec = ProcessSpec(0, dict(os.environ), argv=argv, stdout_fd=w)
    proc = SubprocessStarter().start(spec)
    os.close(w)
    with os.fdopen(r) as out:
        assert out.readline() == "ready\n"
    group = ProcessSet([proc])
    with caplog.at_level(logging.WARNING, logger="elastrun"):
        report = group.stop(signal.SIGTERM, timeout=0.5)
    group.close()
    assert report.killed == (0,)
    (line,) = [r.getMessage() for r in caplog.records if f"(pid {proc.pid}):" in r.getMessage()]
    ignored = int(line.split("SigIgn: ")[1].split(",")[0], 16)
    assert ignored & (1 << (signal.SIGTERM - 1)), line  # the evidence: SIGTERM ignored
    assert "State: " in line and "SigPnd: " in line and "SigBlk: " in line, line


def _ready_worker(code: str = STOPS_ON_SIGTERM) -> ProcessSet:
    r, w = os.pipe()
    argv = (sys.executable, "-c", code)
    proc = SubprocessStarter().start(ProcessSpec(0, dict(os.environ), argv=argv, stdout_fd=w))
    os.close(w)
    with os.fdopen(r) as out:
        assert out.readline() == "ready\n"
    return ProcessSet([proc])


@contextlib.contextmanager
def _no_descriptor_left() -> Iterator[None]:
    """No new descriptor for the block: the soft limit is the lowest free number."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.dup(0)
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    try:
        with pytest.raises(OSError):
            os.pipe()
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_ladder_stops_and_reports_workers_in_a_process_out_of_descriptors() -> None:
    # A stop's grace scope makes its wake-up descriptor on first use; out of them, the
    # ladder still stops, reaps and reports (it never raises), and a second request
    # (the grace cancelled) is still seen at once.
    group = _ready_worker()
    grace = CancelScope()
    with _no_descriptor_left():
        report = group.stop(signal.SIGTERM, timeout=30.0, grace=grace)
    group.close()
    assert [(ex.exitcode, ex.by_agent) for ex in report.exits] == [(-signal.SIGTERM, True)]
    stubborn = _ready_worker(IGNORES_SIGTERM)
    threading.Timer(0.3, grace.cancel).start()
    started = time.monotonic()
    with _no_descriptor_left():
        report = stubborn.stop(signal.SIGTERM, timeout=30.0, grace=grace)
    stubborn.close()
    assert report.killed == (0,)  # the cancelled grace cut the 30 s short
    assert time.monotonic() - started < 5


def test_a_wait_for_exits_out_of_descriptors_still_ends_on_a_stop_request() -> None:
    group = _ready_worker()
    scope = CancelScope()
    threading.Timer(0.3, scope.cancel).start()
    started = time.monotonic()
    try:
        with _no_descriptor_left(), pytest.raises(Cancelled):
            group.wait_for_exits(Deadline.after(30.0), scope)
        assert time.monotonic() - started < 0.3 + 5 * UNWATCHED_SLICE
    finally:
        group.stop(signal.SIGKILL, timeout=5.0)
        group.close()
